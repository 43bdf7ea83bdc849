"""How per-replica values are combined: the `AggregationMethod` enum."""

import enum

import tensorflow as tf


class AggregationMethod(enum.Enum):
    """How values from several replicas are combined.

    Every replica receives the SUM or MEAN over replicas, replica 0's value
    (ONLY_FIRST_REPLICA), or keeps its own (NONE). The names mirror
    `tf.VariableAggregation`, not `tf.AggregationMethod`.

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
                member's name in any case.

        Raises:
            ValueError: if `value` names no member.
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
        """The members' names in lower case, as flags spell them."""
        return [member.value for member in cls]

    @property
    def reduce_op(self):
        """The matching `tf.distribute.ReduceOp`, or None where TF has none."""
        if self in (AggregationMethod.SUM, AggregationMethod.MEAN):
            return tf.distribute.ReduceOp[self.name]
        return None

    def __str__(self):
        return self.value


def contributor_weight(method, dtype, num_replicas, value_scale):
    """The Python factor `method` applies to the sum of `num_replicas`
    values (or replica 0's), each scaled by `value_scale`; raises ValueError
    for a MEAN or a scale of integers."""
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
    """Whether global replica `replica_id` (an int or a scalar tensor) adds
    its value under `method`: all do, but only replica 0 for
    ONLY_FIRST_REPLICA."""
    if method is not AggregationMethod.ONLY_FIRST_REPLICA:
        return True
    if isinstance(replica_id, int):
        return replica_id == 0
    return tf.equal(replica_id, 0)


def sum_weights(method, dtype, transport, value_scale):
    """Each local replica's weight in the sum over `transport` that realizes
    `method` (not NONE): a Python number, or a float32 scalar where the rank
    is a tensor (`ReplicaTransport`)."""
    scale = contributor_weight(method, dtype, transport.size, value_scale)
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


def weighted(tensors, weights, devices):
    """Each local replica's tensor times its weight (None: all 1), on its device."""
    if weights is None:
        return list(tensors)
    result = []
    for tensor, weight, device in zip(tensors, weights, devices):
        if isinstance(weight, (int, float)) and weight == 1:
            result.append(tensor)
            continue
        with tf.device(device):
            result.append(scale_value(tensor, weight))
    return result
