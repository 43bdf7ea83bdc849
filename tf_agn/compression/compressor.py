"""`Compressor`: the interface every compressor implements."""

import tensorflow as tf

from tf_agn.collectives.finite import all_finite

class StateSpec:
    """One piece of a compressor's per-replica state (`state_spec`).

    Args:
        shape: the state's shape.
        initializer: a Keras initializer name, or `(shape, dtype) -> tensor`;
            alike on every replica.
        owed: whether it is a linear part of the residual, which a `.keras`
            file keeps summed over the replicas and loading shares out.
    """

    def __init__(self, shape, initializer, owed=False):
        self.shape = shape
        self.initializer = initializer
        self.owed = owed


class Compressor:
    """Base class of compressors: what values become between replicas.

    A compressor answers, one method or attribute each: which values it
    acts on (`acts_on`), which collective patterns carry them (`patterns`),
    the bytes it sends (`wire_bytes`), and the state each replica keeps
    (`state_spec`, `start_step`). `combine` sums the replicas' values, by
    an all-reduce or a reduce-scatter (sharded optimizer state);
    `encode`/`decode` carry one value to a single receiver (a commit to a
    parameter server). `tf_agn.compression.Cast` is the
    smallest complete compressor, `tf_agn.compression.Int8` one with state.

    Attributes:
        name: a short string; every worker's compressor must have the same.
        patterns: {a pattern tf_agn combines by ("all_reduce",
            "reduce_scatter"): the transport patterns this compressor
            carries it with}. A pattern missing here is refused by name.
        start_step: the optimizer steps during which values travel
            uncompressed (0: none).
        travels_loss_scaled: whether values travel multiplied by a
            `LossScaleOptimizer`'s scale, a step whose combined values
            overflowed being skipped (casts: a narrow float would flush
            small gradients to zero).
    """

    name = None
    patterns = {"all_reduce": ("all_reduce",)}
    start_step = 0
    travels_loss_scaled = False

    def acts_on(self, value):
        """Whether `value` (a tensor, variable, `tf.TensorSpec` or
        `tf.IndexedSlices`) travels compressed: dense float32 values, by
        default; sparse ones never."""
        return not isinstance(value, tf.IndexedSlices) and tf.as_dtype(value.dtype) == tf.float32

    def wire_bytes(self, values, num_replicas=1, bytes_per_pack=None):
        """The bytes one replica sends for `values` (that it acts on):
        to a single receiver (`num_replicas=1`, each value alone), or in
        `combine` among `num_replicas` replicas, packed into buffers of at
        most `bytes_per_pack` bytes. An int, or an int64 scalar where a
        shape is unknown while tracing."""
        raise NotImplementedError

    def state_spec(self, shape):
        """{name: `tf_agn.compression.StateSpec`}: the state each replica
        keeps for a value of the fully defined `shape`; none by default."""
        del shape
        return {}

    def combine(self, transport, values, states, weights, pattern="all_reduce"):
        """Sums every local replica's values, compressed.

        Args:
            transport: the `tf_agn.transports` transport to send through.
            values: for each local replica, its list of tensors this
                compressor acts on; for a "reduce_scatter", each of
                `transport.size` rows, row r for replica r.
            states: for each local replica, one dict per value holding the
                tensors `state_spec` asked for.
            weights: for each local replica, the Python number (or float32
                scalar) its values are multiplied by before compression
                (0: it contributes nothing).
            pattern: a key of `patterns`: "all_reduce" (every replica gets
                the sums) or "reduce_scatter" (replica r gets row r of them).

        Returns:
            `(combined, new_states, finite)`: `combined` and `new_states`
            laid out like `values` and `states`; `finite`, per local
            replica, a scalar bool that is True exactly when its combined
            values are finite.
        """
        raise NotImplementedError

    def encode(self, value, state):
        """`(payload, new_state)`: a tuple of tensors that carries `value`
        to a single receiver, and this sender's new state."""
        raise NotImplementedError

    def decode(self, payload, shape, dtype):
        """The value `encode` made `payload` of, on the receiver."""
        raise NotImplementedError

    def get_config(self):
        """The constructor arguments, as a dict of Python values."""
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({arguments})"


def num_elements(value):
    """The elements of `value`: an int, or an int64 scalar where its shape
    is unknown while tracing."""
    count = tf.TensorShape(value.shape).num_elements()
    if count is None:
        return tf.size(value, out_type=tf.int64)
    return count


def each_finite(devices, combined):
    """Per local replica, on its device: whether its `combined` values are
    all finite (a scalar bool), as `Compressor.combine` returns."""
    finite = []
    for device, replica_combined in zip(devices, combined):
        with tf.device(device):
            finite.append(all_finite(replica_combined))
    return finite
