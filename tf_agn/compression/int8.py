"""`Int8`: values travel as 8-bit integers with a float32 scale per chunk.

A sum of int8 values with different scales has no int8 answer, and an int8
sum of 8 replicas' values overflows. So the sum is never taken in int8:
each pack is reduced as a ring all-reduce is, reduce-scatter then
all-gather, with the reduce-scatter built from an all-to-all (TensorFlow's
CPU collectives have no reduce-scatter):

1. every replica adds its residual to its pack, splits it into one part
   per replica, quantizes it, and sends part j to replica j (all-to-all);
2. replica j dequantizes the n copies of its part, sums them in float32,
   and quantizes the sum (a second rounding, whose error joins replica j's
   residual for its part);
3. every replica's quantized sum travels to every replica (all-gather),
   which dequantizes it.

Each replica sends about a quarter of float32's bytes, twice, as a ring
all-reduce of float32 sends its whole volume twice. Every replica ends
with the same bits, so the replicas' weights stay equal.

Quantization is symmetric, per chunk of `chunk_size` elements: scale =
max |x| / 127 and q = round(x / scale), so |q| <= 127. An element's
rounding error is at most scale / 2, 1/254 of its chunk's largest
magnitude. A non-finite element makes its chunk NaN, so the step's result
is not finite and Keras' `LossScaleOptimizer` (or gradient accumulation)
skips it.

TensorFlow's collectives do not carry int8: four codes travel as one
int32, and the chunk scales as their float32 bits, in the same buffer.
"""

import collections

import keras
import numpy as np
import tensorflow as tf

from tf_agn import packing
from tf_agn.compression.error_feedback import ErrorFeedbackCompressor
from tf_agn.compression.error_feedback import StateSpec
from tf_agn.compression.error_feedback import compiled

_LEVELS = 127.0


@keras.saving.register_keras_serializable(package="tf_agn")
class Int8(ErrorFeedbackCompressor):
    """8-bit integers with a scale per chunk, and error feedback.

    Args:
        chunk_size: the elements that share one float32 scale; a multiple
            of 4. Smaller chunks round finer and send more scales (4 bytes
            per chunk: 0.8% more bytes at the default 512).
        error_feedback: see `tf_agn.compression.ErrorFeedbackCompressor`.
        start_step: see `tf_agn.compression.ErrorFeedbackCompressor`.

    Raises:
        ValueError: for a `chunk_size` that is not a positive multiple of 4.
    """

    name = "int8"
    patterns = ("reduce_scatter", "all_gather")

    def __init__(self, chunk_size=512, error_feedback=True, start_step=0):
        super().__init__(error_feedback, start_step)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or (
            chunk_size <= 0 or chunk_size % 4
        ):
            raise ValueError(
                "chunk_size must be a positive multiple of 4 (four int8 codes "
                f"travel as one int32); received {chunk_size!r}."
            )
        self.chunk_size = chunk_size

    def state_spec(self, shape):
        if not self.error_feedback:
            return {}
        return {"residual": StateSpec(shape, "zeros", owed=True)}

    def wire_bytes(self, shape, dtype):
        """A code per element and a float32 scale per chunk: what `encode`
        sends for one value, and without the padding that `combine` gives
        its packs (`payload_bytes`)."""
        elements = shape.num_elements()
        return elements + 4 * -(-elements // self.chunk_size)

    def payload_bytes(self, shapes, num_replicas, bytes_per_pack):
        """What each replica puts in `combine`'s all-to-all: every pack's
        codes, padded so that each replica's part is whole chunks, and a
        float32 scale per chunk. (Its all-gather then sends its own part of
        each pack to every other replica: about as many bytes again, as a
        ring all-reduce sends its payload twice.)

        For example, one pack of 1000 values among 4 replicas, in chunks of
        512, is padded to 4 parts of 512 codes:

        ```python
        int8 = tf_agn.compression.Int8(chunk_size=512)
        int8.wire_bytes(tf.TensorShape([1000]), tf.float32)  # 1000 + 2 * 4
        int8.payload_bytes([tf.TensorShape([1000])], 4, 2**22)  # 2048 + 4 * 4
        ```
        """
        sizes = [(tf.float32, shape.num_elements()) for shape in shapes]
        return sum(
            layout.wire_bytes
            for _, layout in _plan(sizes, num_replicas, self.chunk_size, bytes_per_pack)
        )

    def get_config(self):
        return {"chunk_size": self.chunk_size, **super().get_config()}

    def encode(self, value, state):
        flat = tf.reshape(value, [-1])
        if self.error_feedback:
            flat += tf.reshape(state["residual"], [-1])
        length = flat.shape[0]
        padded = -(-length // self.chunk_size) * self.chunk_size
        flat = tf.pad(flat, [[0, padded - length]])
        codes, scales = quantize(tf.reshape(flat, [-1, self.chunk_size]))
        # The padding's codes are 0 and do not travel: `wire_bytes` is
        # what the payload holds.
        payload = (tf.reshape(codes, [-1])[:length], scales)
        if not self.error_feedback:
            return payload, {}
        error = flat - tf.reshape(dequantize(codes, scales), [-1])
        return payload, {"residual": tf.reshape(error[:length], value.shape)}

    def decode(self, payload, shape, dtype):
        codes, scales = payload
        length = shape.num_elements()
        padded = -(-length // self.chunk_size) * self.chunk_size
        codes = tf.reshape(tf.pad(codes, [[0, padded - length]]), [-1, self.chunk_size])
        flat = tf.reshape(dequantize(codes, scales), [-1])
        return tf.cast(tf.reshape(flat[:length], shape), dtype)

    def combine(self, transport, values, states, scales, bytes_per_pack, jit_compile):
        devices = transport.devices
        combined = [[None] * len(v) for v in values]
        new_states = [[{} for _ in v] for v in values]
        sizes = [(v.dtype, v.shape.num_elements()) for v in values[0]]
        for pack, layout in _plan(sizes, transport.size, self.chunk_size, bytes_per_pack):
            shapes = tuple(tuple(values[0][i].shape.as_list()) for i in pack)
            wires, worker_errors = [], []
            for r, device in enumerate(devices):
                residuals = [states[r][i]["residual"] for i in pack] if self.error_feedback else []
                with tf.device(device):
                    flat = compiled(_pack, jit_compile, device)(
                        [values[r][i] for i in pack], residuals, scales[r], layout
                    )
                    wire, error = self._quantized(flat, layout.parts, jit_compile, device)
                wires.append(wire)
                worker_errors.append(error)
            # The sum is never taken in int8: each replica dequantizes the
            # copies of its part it receives and sums them in float32.
            sum_part = compiled(_sum_part, jit_compile, devices[0])
            totals = transport.reduce_scatter(
                wires, sum_parts=lambda received: sum_part(received, layout)
            )
            rows, owner_errors = [], []
            for device, total in zip(devices, totals):
                with tf.device(device):
                    row, error = self._quantized(total, 1, jit_compile, device)
                rows.append(row)
                owner_errors.append(error)
            gathered = transport.all_gather(rows)
            for r, device in enumerate(devices):
                with tf.device(device):
                    # TensorFlow's own split hands out pieces of a buffer
                    # without copying them, where XLA's would copy.
                    flat = compiled(_dequantize_wire, jit_compile, device)(gathered[r], layout)
                    tensors = _split(flat, shapes)
                    if self.error_feedback:
                        error = compiled(_error, jit_compile, device)(
                            worker_errors[r], owner_errors[r], transport.rank(r), layout
                        )
                        residuals = _split(error, shapes)
                for position, index in enumerate(pack):
                    combined[r][index] = tensors[position]
                    if self.error_feedback:
                        new_states[r][index] = {"residual": residuals[position]}
        return combined, new_states

    def encode_rows(self, rows, residual_rows=None):
        """One replica's rows for a reduce-scatter, in replica context: row
        j, for replica j, plus its residual, quantized in chunks of its own.

        Args:
            rows: a float32 tensor [n, length].
            residual_rows: None, or this replica's residual, as `rows`.

        Returns:
            `(wire, error)`: an int32 buffer of n rows for an all-to-all,
            and what quantization dropped, as `rows` (None without error
            feedback).
        """
        layout = self.rows_layout(*rows.shape)
        if residual_rows is not None:
            rows += residual_rows
        padding = layout.part_length - rows.shape[1]
        flat = tf.reshape(tf.pad(rows, [[0, 0], [0, padding]]), [-1])
        codes, scales = _quantize_flat(flat, self.chunk_size)
        wire, error = _encode(flat, codes, scales, layout.parts, self.error_feedback)
        if error is not None:
            error = tf.reshape(error, [layout.parts, -1])[:, : rows.shape[1]]
        return wire, error

    def sum_rows(self, received, length):
        """The float32 sum of the n rows of `encode_rows` wires that one
        replica received: a tensor [length]."""
        layout = self.rows_layout(received.shape[0], length)
        return _sum_part(received, layout)[:length]

    def rows_layout(self, num_rows, length):
        """How `encode_rows` pads n rows of `length`: each to whole chunks.
        Its `wire_bytes` is what one replica sends."""
        padded = -(-length // self.chunk_size) * self.chunk_size
        return _Layout(num_rows * padded, num_rows, self.chunk_size)

    def _quantized(self, flat, rows, jit_compile, device):
        """`flat` quantized as an int32 buffer of `rows` rows, and what
        quantization dropped (None without error feedback)."""
        codes, scales = compiled(_quantize_flat, jit_compile, device)(flat, self.chunk_size)
        return compiled(_encode, jit_compile, device)(flat, codes, scales, rows, self.error_feedback)


class _Layout(collections.namedtuple("_Layout", ["length", "parts", "chunk_size"])):
    """How a pack of `length` elements is padded and split into `parts`."""

    @property
    def padded(self):
        unit = self.parts * self.chunk_size
        return -(-self.length // unit) * unit

    @property
    def part_length(self):
        return self.padded // self.parts

    @property
    def chunks_per_part(self):
        return self.part_length // self.chunk_size

    @property
    def wire_bytes(self):
        """The bytes of one replica's buffer: the padded codes, and a
        float32 scale per chunk (`_to_wire`)."""
        return self.padded + 4 * self.parts * self.chunks_per_part


def _plan(sizes, parts, chunk_size, bytes_per_pack):
    """The packs of values of `sizes` (`(dtype, num_elements)` pairs), each
    as its indices and its `_Layout` among `parts` replicas: its padded
    length is a multiple of every part's chunks."""
    return [
        (pack, _Layout(sum(sizes[i][1] for i in pack), parts, chunk_size))
        for pack in packing.plan_packs(sizes, bytes_per_pack)
    ]


def quantize(chunks):
    """Symmetric int8 codes (within ±127) and float32 scales of `chunks`
    ([n, chunk]); a scale is at least the smallest normal float32.

    A chunk with a non-finite element gets a NaN scale (and zero codes):
    a maximum may skip NaN, and a NaN cast to int8 is undefined, so without
    this a NaN gradient could arrive as a finite number.
    """
    # A non-finite element counts as an infinite magnitude, so that one
    # pass over the chunks finds both their scales and which are finite.
    magnitudes = tf.reduce_max(
        tf.where(tf.math.is_finite(chunks), tf.abs(chunks), float("inf")), axis=1
    )
    finite = tf.math.is_finite(magnitudes)
    # TensorFlow flushes subnormal floats to zero on CPUs: a step below the
    # smallest normal float would be 0, and its chunk's values lost.
    steps = tf.maximum(magnitudes / _LEVELS, np.finfo(np.float32).tiny)
    scales = tf.where(finite, steps, float("nan"))
    codes = tf.where(finite[:, None], tf.round(chunks / scales[:, None]), 0.0)
    # The cast to int8 wraps what exceeds it (a subnormal step, where
    # subnormals are kept, can give 128).
    return tf.cast(tf.clip_by_value(codes, -_LEVELS, _LEVELS), tf.int8), scales


def dequantize(codes, scales):
    """The float32 values of int8 `codes` ([n, chunk]) and their `scales`."""
    return tf.cast(codes, tf.float32) * scales[:, None]


def _to_wire(codes, scales, rows):
    """Codes and scales as one int32 buffer of `rows` rows."""
    code_words = tf.bitcast(tf.reshape(codes, [rows, -1, 4]), tf.int32)
    scale_words = tf.bitcast(tf.reshape(scales, [rows, -1]), tf.int32)
    return tf.concat([code_words, scale_words], axis=1)


def _from_wire(wire, layout):
    """The codes ([chunks, chunk_size]) and scales of a buffer's rows."""
    code_words = layout.part_length // 4
    codes = tf.bitcast(wire[:, :code_words], tf.int8)
    scales = tf.bitcast(wire[:, code_words:], tf.float32)
    return (
        tf.reshape(codes, [-1, layout.chunk_size]),
        tf.reshape(scales, [-1]),
    )


# Each step below is its own XLA call, although one call could hold them
# all: XLA's CPU fusion recomputes a fused concatenation, and a fused
# reduction, inside each of their consumers, which made one call about
# 1.5x slower than several (75 against 48 ms to encode a 24M-element pack).


def _pack(tensors, residuals, scale, layout):
    """One replica's pack, scaled, plus its residuals: flat and padded."""
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0) * scale
    if residuals:
        flat += tf.concat([tf.reshape(e, [-1]) for e in residuals], 0)
    return tf.pad(flat, [[0, layout.padded - layout.length]])


def _quantize_flat(flat, chunk_size):
    return quantize(tf.reshape(flat, [-1, chunk_size]))


def _encode(flat, codes, scales, rows, with_error):
    """Quantized `flat` as an int32 buffer of `rows` rows, and (if
    `with_error`) what quantization dropped, else None."""
    wire = _to_wire(codes, scales, rows)
    if not with_error:
        return wire, None
    return wire, flat - tf.reshape(dequantize(codes, scales), [-1])


def _sum_part(received, layout):
    """The replicas' copies of this replica's part, summed in float32."""
    codes, scales = _from_wire(received, layout)
    copies = tf.reshape(dequantize(codes, scales), [layout.parts, layout.part_length])
    return tf.reduce_sum(copies, axis=0)


def _dequantize_wire(gathered, layout):
    codes, scales = _from_wire(gathered, layout)
    return tf.reshape(dequantize(codes, scales), [-1])


def _error(worker_error, owner_error, rank, layout):
    """The new residuals, flat: what this replica's quantization dropped,
    plus what the second quantization dropped of the part it reduced."""
    # A select of one row rather than a pad at rank * part_length: the rank
    # is a tensor in replica context (`ReplicaTransport`), and XLA pads only
    # by constants. The other parts get +0, as from a pad.
    mine = tf.equal(tf.range(layout.parts), tf.cast(rank, tf.int32))[:, None]
    owner = tf.where(mine, owner_error[None, :], 0.0)
    return worker_error + tf.reshape(owner, [-1])


def _split(flat, shapes):
    sizes = [int(np.prod(shape)) for shape in shapes]
    pieces = tf.split(flat[: sum(sizes)], sizes)
    return [tf.reshape(p, shape) for p, shape in zip(pieces, shapes)]
