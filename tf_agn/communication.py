"""Counting what replicas send each other."""

import keras
import tensorflow as tf

from tf_agn.aggregation import AggregationMethod
from tf_agn.compression import is_stateful


class CommunicationCounter:
    """Counts aggregations and the bytes one replica contributes to them.

    An aggregation (SUM, MEAN or ONLY_FIRST_REPLICA) counts as one call, and
    its payload is the bytes of one replica's values: what each replica puts
    on the wire in a reduce, and what replica 0 broadcasts for
    ONLY_FIRST_REPLICA. A compressor shrinks the payload to its
    `wire_bytes`: 2 bytes per float32 for "fp16" and "bf16", about 1 for
    "int8", (rows + cols) * rank floats per matrix for PowerSGD. NONE sends
    nothing and is not counted. An int8 or ring all-reduce sends its
    payload about twice (see `tf_agn.collective.traffic`); the payload is
    what compression changes.

    The counts are variables of the counter, not of the optimizer: an
    optimizer's `variables`, and what it saves, stay exactly those of
    Keras' optimizer of the same class, so checkpoints and code written for
    Keras' state line up. The counts start at zero when the optimizer is
    built (after loading too).

    Args:
        optimizer: the Keras optimizer whose aggregations are counted.
    """

    def __init__(self, optimizer):
        with keras.name_scope(optimizer.name, caller=optimizer):
            self.calls, self.bytes = (
                keras.Variable(
                    0, dtype="int64", trainable=False, aggregation="none", name=name
                )
                for name in ("all_reduce_calls", "bytes_sent")
            )

    def record(self, values, method, compressor=None, when=None):
        """Adds one aggregation of `values` (this replica's tensors).

        Args:
            values: this replica's tensors or `tf.IndexedSlices`.
            method: an `AggregationMethod` or its name.
            compressor: the `tf_agn.compression` compressor they travel in,
                or None.
            when: None, or a scalar boolean tensor: count only where true.
        """
        if AggregationMethod.parse(method) is AggregationMethod.NONE:
            return
        # Dense gradients have static shapes: their payload is a Python
        # number, so counting adds no per-tensor ops to the training step.
        payload = sum(_payload_bytes(v, compressor) for v in values)
        times = tf.constant(1, tf.int64) if when is None else tf.cast(when, tf.int64)
        self.calls.assign_add(times)
        self.bytes.assign_add(tf.cast(payload, tf.int64) * times)

    def result(self):
        """Returns `{"all_reduce_calls": int, "bytes_sent": int}`."""
        return {
            "all_reduce_calls": int(self.calls.numpy()),
            "bytes_sent": int(self.bytes.numpy()),
        }


def _payload_bytes(value, compressor):
    if isinstance(value, tf.IndexedSlices):
        return _payload_bytes(value.values, None) + _payload_bytes(value.indices, None)
    if compressor is not None and value.shape.is_fully_defined():
        if not is_stateful(compressor) or compressor.acts_on(value.dtype):
            return compressor.wire_bytes(value.shape, value.dtype)
    num_elements = value.shape.num_elements()
    if num_elements is None:  # e.g. the rows of an IndexedSlices
        num_elements = tf.size(value, out_type=tf.int64)
    return num_elements * value.dtype.size


def communication_stats(optimizer):
    """`optimizer`'s counts, or zeros before it is built.

    Returns:
        `{"all_reduce_calls": int, "bytes_sent": int}`.
    """
    if not optimizer.built:
        return {"all_reduce_calls": 0, "bytes_sent": 0}
    return optimizer._communication.result()
