"""How per-replica values are combined: the `AggregationMethod` enum."""

import enum

import tensorflow as tf


class AggregationMethod(enum.Enum):
    """How gradients (or other values) from several replicas are combined.

    The names mirror `tf.VariableAggregation`. They are not
    `tf.AggregationMethod` (ADD_N, EXPERIMENTAL_TREE, ...), which governs how
    several gradient contributions to one tensor are summed inside one graph.

    | method             | every replica receives          |
    |--------------------|---------------------------------|
    | NONE               | its own value: no communication |
    | SUM                | the sum over replicas           |
    | MEAN               | the mean over replicas          |
    | ONLY_FIRST_REPLICA | replica 0's value               |

    Example:

    >>> AggregationMethod.parse("mean")
    <AggregationMethod.MEAN: 'mean'>
    >>> AggregationMethod.parse("Only_First_Replica").reduce_op is None
    True
    """

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"

    @classmethod
    def parse(cls, value):
        """Returns the member named by `value`.

        Args:
            value: an `AggregationMethod`, a `tf.distribute.ReduceOp`, or a
                member's name in any case ("mean", "MEAN", ...).

        Returns:
            An `AggregationMethod`.

        Raises:
            ValueError: if `value` names no member. The message lists the
                allowed names.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, tf.distribute.ReduceOp):
            return cls[value.name]
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
        raise ValueError(
            f"Unknown aggregation method {value!r}. Allowed: "
            f"{', '.join(cls.names())} (case-insensitive)."
        )

    @classmethod
    def names(cls):
        """Returns the members' names in lower case, as flags spell them."""
        return [member.value for member in cls]

    @property
    def reduce_op(self):
        """The matching `tf.distribute.ReduceOp`, or None where TF has none."""
        if self in (AggregationMethod.SUM, AggregationMethod.MEAN):
            return tf.distribute.ReduceOp[self.name]
        return None

    def __str__(self):
        return self.value


def method_scale(method, dtype, num_replicas, value_scale):
    """The factor a combination with `method` applies to the sum (or to
    replica 0's value).

    Args:
        method: an `AggregationMethod`.
        dtype: the values' `tf.DType`.
        num_replicas: how many replicas' values are combined.
        value_scale: a Python number every value is multiplied by.

    Returns:
        A Python number.

    Raises:
        ValueError: for a MEAN or a scale of integers.
    """
    if dtype.is_integer:
        if method is AggregationMethod.MEAN or value_scale != 1:
            raise ValueError(
                f"Cannot {method.name} {dtype.name} values with scale "
                f"{value_scale}: integers can only be summed or taken from "
                "the first replica, unscaled."
            )
        return 1
    if method is AggregationMethod.MEAN:
        return value_scale / num_replicas
    return value_scale


def contributes(method, replica_id):
    """Whether replica `replica_id` adds its value to a combination with
    `method`: every replica does, but with ONLY_FIRST_REPLICA only replica
    0 does.

    Args:
        method: an `AggregationMethod`.
        replica_id: the replica's index among all replicas of all workers,
            a Python int or a scalar integer tensor.

    Returns:
        A Python bool, or a scalar boolean tensor for a tensor `replica_id`.

    Example:

    >>> contributes(AggregationMethod.ONLY_FIRST_REPLICA, 2)
    False
    """
    if method is not AggregationMethod.ONLY_FIRST_REPLICA:
        return True
    if isinstance(replica_id, int):
        return replica_id == 0
    return tf.equal(replica_id, 0)


def replica_weights(method, dtype, transport, value_scale):
    """Each local replica's weight in the sum over replicas that realizes
    `method` (anything but NONE).

    Args:
        method: an `AggregationMethod`.
        dtype: the values' `tf.DType`.
        transport: the `tf_agn.transports` transport that sums them.
        value_scale: a Python number every value is multiplied by.

    Returns:
        One weight per local replica of `transport`: a Python number (0 for
        a replica that adds nothing), or a scalar float32 tensor where the
        replica's rank is one (`tf_agn.transports.ReplicaTransport`).

    Raises:
        ValueError: for a MEAN or a scale of integers.
    """
    scale = method_scale(method, dtype, transport.size, value_scale)
    weights = []
    for replica in range(len(transport.devices)):
        sends = contributes(method, transport.rank(replica))
        if isinstance(sends, bool):
            weights.append(scale if sends else 0 * scale)
        else:
            weights.append(tf.cast(sends, tf.float32) * scale)
    return weights


def scale_value(value, scale):
    """Multiplies a tensor or `tf.IndexedSlices` by a Python number."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(
            value.values * tf.cast(scale, value.dtype),
            value.indices,
            value.dense_shape,
        )
    return value * tf.cast(scale, value.dtype)
