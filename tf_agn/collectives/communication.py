"""Counting what replicas send each other."""

import keras
import tensorflow as tf

from tf_agn import compression
from tf_agn.compression.compressor import num_elements


PATTERNS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class CommunicationCounter:
    """Counts an optimizer's collectives, per pattern, and the bytes one
    replica sends and receives in them.

    Every aggregation but NONE counts as one all-reduce; sharded state
    counts a reduce-scatter of the gradients (all-to-all for int8) and an
    all-gather of the weights per step. `bytes_sent` is the payload as a
    compressor shrinks it (`payload_bytes`), half of it for sharded
    state's collectives; a ring moves about twice that
    (`tf_agn.transports.traffic`). `bytes_received` is the same, but
    (n - 1) payloads where a strategy without tf_agn's ops all-gathers what
    int8 reduces. The counts are not the optimizer's variables, so it saves
    what Keras's does; they start at zero when it is built.

    Args:
        optimizer: the Keras optimizer whose collectives are counted.
    """

    def __init__(self, optimizer):
        names = [f"{pattern}_calls" for pattern in PATTERNS] + ["bytes_sent", "bytes_received"]
        with keras.name_scope(optimizer.name, caller=optimizer):
            self.counts = {
                name: keras.Variable(
                    0, dtype="int64", trainable=False, aggregation="none", name=name
                )
                for name in names
            }

    def record(self, pattern, payload, when=None, received=None):
        """Adds one collective of `pattern` (one of `PATTERNS`) that sent
        `payload` bytes and received `received` (default `payload`), where
        the boolean tensor `when` (if given) is true."""
        times = tf.constant(1, tf.int64) if when is None else tf.cast(when, tf.int64)
        self.counts[f"{pattern}_calls"].assign_add(times)
        self.counts["bytes_sent"].assign_add(tf.cast(payload, tf.int64) * times)
        received = payload if received is None else received
        self.counts["bytes_received"].assign_add(tf.cast(received, tf.int64) * times)

    def result(self):
        """Returns `{"<pattern>_calls": int, ..., "bytes_sent": int,
        "bytes_received": int}`."""
        return {name: int(count.numpy()) for name, count in self.counts.items()}


def payload_bytes(
    values, compressor=None, step=None, num_replicas=1, bytes_per_pack=None, gathered=False
):
    """The bytes one replica sends to aggregate `values` among
    `num_replicas`, those `compressor` acts on as its `wire_bytes` counts
    them; with `gathered`, what it receives where reduce-scatter and
    all-to-all are all-gathers (`ReplicaTransport`).

    `step` matters only for a compressor with a `start_step`. Returns an
    int, or an int64 scalar where the count depends on `step` or on a shape
    unknown while tracing.
    """
    compressed = [v for v in values if compression.compresses(compressor, v)]
    exact = sum(_exact_bytes(v) for v in values if not compression.compresses(compressor, v))
    if not compressed:
        return exact
    sent = compressor.wire_bytes(compressed, num_replicas, bytes_per_pack)
    if gathered and gathers(compressor):
        sent *= num_replicas - 1
    if compressor.start_step:
        # Until then `combine_replicas` sums them uncompressed.
        uncompressed = sum(_exact_bytes(v) for v in compressed)
        sent = tf.where(
            step < compressor.start_step,
            tf.constant(uncompressed, tf.int64),
            tf.constant(sent, tf.int64),
        )
    return exact + sent


def gathers(compressor):
    """Whether `compressor` all-reduces by a reduce-scatter or an all-to-all
    (all-gathers of whole buffers without tf_agn's ops)."""
    return bool({"reduce_scatter", "all_to_all"} & set(compressor.patterns["all_reduce"]))


def _exact_bytes(value):
    if isinstance(value, tf.IndexedSlices):
        return _exact_bytes(value.values) + _exact_bytes(value.indices)
    return num_elements(value) * tf.as_dtype(value.dtype).size


def communication_stats(optimizer):
    """`optimizer`'s `CommunicationCounter.result()`, or zeros before it is built."""
    if not optimizer.built:
        names = [f"{pattern}_calls" for pattern in PATTERNS] + ["bytes_sent", "bytes_received"]
        return dict.fromkeys(names, 0)
    return optimizer._communication.result()
