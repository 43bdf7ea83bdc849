"""Counting what replicas send each other."""

import keras
import tensorflow as tf

from tf_agn.compression import is_stateful


# The collective patterns a counter counts, each under "<pattern>_calls".
PATTERNS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class CommunicationCounter:
    """Counts an optimizer's collectives, per pattern, and the bytes one
    replica sends and receives in them.

    Every aggregation (SUM, MEAN or ONLY_FIRST_REPLICA; the finite
    agreements and the clip norms of sharded state too) counts as one
    all-reduce, however its compressor builds it. Sharded state
    (`shard_optimizer_state=True`) counts, per step, one reduce-scatter of
    the gradients (an all-to-all for int8) and one all-gather of the
    weights. `bytes_sent` counts the payload (`payload_bytes`): the bytes
    of one replica's values as they travel, as a compressor shrinks them
    (2 bytes per float32 for "fp16" and "bf16"; for "int8" a byte per
    element and a float32 scale per chunk, its packs padded to whole chunks
    for every replica; (rows + cols) * rank floats per matrix for PowerSGD;
    float32 before a compressor's `start_step`), and half of it for a
    reduce-scatter or an all-gather of sharded state. A ring all-reduce,
    or int8's all-to-all and all-gather, moves about twice the payload in
    and out of each replica (`tf_agn.transports.traffic`); the payload is
    what compression changes. `bytes_received` counts the same payload,
    but (n - 1) payloads where a strategy without tf_agn's ops all-gathers
    what int8 reduces. NONE sends nothing and is not counted.

    The counts are variables of the counter, not of the optimizer: an
    optimizer's `variables`, and what it saves, stay exactly those of
    Keras' optimizer of the same class. They start at zero when the
    optimizer is built (after loading too).

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
        """Adds one collective.

        Args:
            pattern: "all_reduce", "reduce_scatter", "all_gather" or
                "all_to_all".
            payload: the bytes this replica sent, an int or a scalar
                integer tensor (`payload_bytes`).
            when: None, or a scalar boolean tensor: count only where true.
            received: the bytes it received; by default `payload`.
        """
        times = tf.constant(1, tf.int64) if when is None else tf.cast(when, tf.int64)
        self.counts[f"{pattern}_calls"].assign_add(times)
        self.counts["bytes_sent"].assign_add(tf.cast(payload, tf.int64) * times)
        received = payload if received is None else received
        self.counts["bytes_received"].assign_add(tf.cast(received, tf.int64) * times)

    def result(self):
        """Returns `{"all_reduce_calls": int, "reduce_scatter_calls": int,
        "all_gather_calls": int, "all_to_all_calls": int, "bytes_sent":
        int, "bytes_received": int}`."""
        return {name: int(count.numpy()) for name, count in self.counts.items()}


def payload_bytes(
    values, compressor=None, step=None, num_replicas=1, bytes_per_pack=None, gathered=False
):
    """The bytes one replica sends to aggregate `values`, as they travel, or
    with `gathered`, those it receives.

    Sparse values (`tf.IndexedSlices`: their rows and indices) travel
    exactly, and so do dense ones a stateful compressor does not act on. A
    cast compresses every dense value (`wire_bytes`); an
    `ErrorFeedbackCompressor` sends the values it acts on in its own
    buffers (`payload_bytes`), and uncompressed before its `start_step`.

    Args:
        values: this replica's tensors or `tf.IndexedSlices`.
        compressor: the `tf_agn.compression` compressor they travel in, or
            None.
        step: for an `ErrorFeedbackCompressor` with a `start_step`: the
            optimizer's step, a scalar integer tensor.
        num_replicas, bytes_per_pack: for an `ErrorFeedbackCompressor`: the
            replicas of all workers, and the most bytes one of its packs
            holds (the transport's `bytes_per_pack`).
        gathered: whether to count what one replica receives from a
            transport whose reduce-scatter and all-to-all are all-gathers
            (`tf_agn.transports.ReplicaTransport`): (n - 1) payloads of a
            compressor that uses them.

    Returns:
        An int; a scalar int64 tensor where the count depends on `step` or
        on a shape unknown while tracing (the rows of an `IndexedSlices`).
    """
    compressed = [v for v in values if _compresses(compressor, v)]
    exact = sum(_exact_bytes(v) for v in values if not _compresses(compressor, v))
    if not compressed:
        return exact
    if not is_stateful(compressor):
        return exact + sum(compressor.wire_bytes(v.shape, v.dtype) for v in compressed)
    sent = compressor.payload_bytes([v.shape for v in compressed], num_replicas, bytes_per_pack)
    if gathered and gathers(compressor):
        sent *= num_replicas - 1
    if compressor.start_step:
        # Until then `tf_agn.combining.combine_replicas` sums them
        # uncompressed.
        uncompressed = sum(_exact_bytes(v) for v in compressed)
        sent = tf.where(
            step < compressor.start_step,
            tf.constant(uncompressed, tf.int64),
            tf.constant(sent, tf.int64),
        )
    return exact + sent


def gathers(compressor):
    """Whether `compressor` uses a reduce-scatter or an all-to-all, which a
    strategy without tf_agn's ops builds from an all-gather of whole
    buffers."""
    return bool({"reduce_scatter", "all_to_all"} & set(compressor.patterns))


def _compresses(compressor, value):
    """Whether `value` travels in `compressor`'s form (as
    `tf_agn.AggregatingAllReduce.aggregate` routes it)."""
    if compressor is None or isinstance(value, tf.IndexedSlices):
        return False
    if not value.shape.is_fully_defined():
        return False
    return not is_stateful(compressor) or compressor.acts_on(value.dtype)


def _exact_bytes(value):
    if isinstance(value, tf.IndexedSlices):
        return _exact_bytes(value.values) + _exact_bytes(value.indices)
    num_elements = value.shape.num_elements()
    if num_elements is None:  # e.g. the rows of an IndexedSlices
        num_elements = tf.size(value, out_type=tf.int64)
    return num_elements * value.dtype.size


def communication_stats(optimizer):
    """`optimizer`'s counts, or zeros before it is built.

    Returns:
        `CommunicationCounter.result()`'s dict.
    """
    if not optimizer.built:
        names = [f"{pattern}_calls" for pattern in PATTERNS] + ["bytes_sent", "bytes_received"]
        return dict.fromkeys(names, 0)
    return optimizer._communication.result()
