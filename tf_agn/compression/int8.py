"""`Int8` and `Int4`: values travel as 8- or 4-bit integers with a float32
scale per chunk.

The sum is never taken in integers (different scales; overflow past a few
replicas): each pack is reduced as a ring all-reduce is. Every replica
quantizes its pack plus residual and sends part j to replica j (an
all-to-all: TensorFlow's CPU collectives have no reduce-scatter); replica
j sums its n copies in float32 and quantizes the sum (that error joins its
residual); the quantized sums are all-gathered. Every replica ends with
the same bits.

Quantization is symmetric per chunk: scale = max |x| / L, with L = 127
for 8 bits and 7 for 4 (L = 2^(b-1) - 1). A non-finite element makes its
chunk NaN, so the step is skipped as non-finite. TensorFlow's collectives
do not carry int8: 32/b codes travel as one int32 (two 4-bit codes share a
byte).
"""

import collections

import keras
import numpy as np
import tensorflow as tf

from tf_agn.collectives import packing
from tf_agn.compression.compressor import StateSpec
from tf_agn.compression.compressor import each_finite
from tf_agn.compression.compressor import num_elements
from tf_agn.compression.error_feedback import ErrorFeedbackCompressor
from tf_agn.compression.error_feedback import compiled

@keras.saving.register_keras_serializable(package="tf_agn")
class Int8(ErrorFeedbackCompressor):
    """8-bit integers with a scale per chunk, and error feedback.

    Args:
        chunk_size: the elements that share one float32 scale; a multiple
            of 4. Smaller chunks round finer and send more scales.
        error_feedback: see `tf_agn.compression.ErrorFeedbackCompressor`.
        start_step: see `tf_agn.compression.ErrorFeedbackCompressor`.

    Raises:
        ValueError: for a `chunk_size` that is not a positive multiple of 4.
    """

    name = "int8"
    bits = 8  # per code
    patterns = {"all_reduce": ("reduce_scatter", "all_gather"), "reduce_scatter": ("all_to_all",)}

    def __init__(self, chunk_size=512, error_feedback=True, start_step=0):
        super().__init__(error_feedback, start_step)
        codes_per_word = 32 // self.bits
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or (
            chunk_size <= 0 or chunk_size % codes_per_word
        ):
            raise ValueError(
                f"chunk_size must be a positive multiple of {codes_per_word} "
                f"({codes_per_word} {self.name} codes travel as one int32); "
                f"received {chunk_size!r}."
            )
        self.chunk_size = chunk_size

    def state_spec(self, shape):
        if not self.error_feedback:
            return {}
        return {"residual": StateSpec(shape, "zeros", owed=True)}

    def wire_bytes(self, values, num_replicas=1, bytes_per_pack=None):
        """A code per element and a float32 scale per chunk; among replicas,
        each pack padded to whole chunks per replica's part.

        ```python
        int8 = tf_agn.compression.Int8(chunk_size=512)
        value = tf.TensorSpec([1000], tf.float32)
        int8.wire_bytes([value])  # 1000 + 2 * 4
        int8.wire_bytes([value], num_replicas=4)  # 2048 + 4 * 4
        ```
        """
        sizes = [(tf.float32, num_elements(v)) for v in values]
        return sum(
            layout.wire_bytes
            for _, layout in _plan(sizes, num_replicas, self.chunk_size, self.bits, bytes_per_pack)
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
        codes, scales = quantize(tf.reshape(flat, [-1, self.chunk_size]), self.bits)
        code_bytes = -(-length * self.bits // 8)
        payload = (_to_bytes(tf.reshape(codes, [-1]), self.bits)[:code_bytes], scales)
        if not self.error_feedback:
            return payload, {}
        error = flat - tf.reshape(dequantize(codes, scales), [-1])
        return payload, {"residual": tf.reshape(error[:length], value.shape)}

    def decode(self, payload, shape, dtype):
        codes, scales = payload
        length = shape.num_elements()
        padded = -(-length // self.chunk_size) * self.chunk_size
        code_bytes = -(-length * self.bits // 8)
        codes = _from_bytes(tf.pad(codes, [[0, padded * self.bits // 8 - code_bytes]]), self.bits)
        codes = tf.reshape(codes, [-1, self.chunk_size])
        flat = tf.reshape(dequantize(codes, scales), [-1])
        return tf.cast(tf.reshape(flat[:length], shape), dtype)

    def combine(self, transport, values, states, weights, pattern="all_reduce"):
        rows = pattern == "reduce_scatter"
        # A reduce-scatter's rows (sharded state) run as TensorFlow's kernels,
        # as they did before sharing this path: XLA on CPUs contracts
        # x - codes * scale into one FMA, which rounds the residual otherwise.
        devices, jit_compile = transport.devices, transport.jit_compile and not rows
        combined = [[None] * len(v) for v in values]
        new_states = [[{} for _ in v] for v in values]
        # Backward order, as `tf_agn.collectives.packing.all_reduce_packs` launches packs.
        for pack, layout in reversed(self._plan(values[0], transport, rows)):
            shapes = tuple(tuple(values[0][i].shape.as_list()) for i in pack)
            wires, worker_errors = [], []
            for r, device in enumerate(devices):
                residuals = [states[r][i]["residual"] for i in pack] if self.error_feedback else []
                with tf.device(device):
                    flat = compiled(_pack, jit_compile, device)(
                        [values[r][i] for i in pack], residuals, weights[r], layout, rows
                    )
                    wire, error = self._quantized(flat, layout.parts, jit_compile, device)
                wires.append(wire)
                worker_errors.append(error)
            sum_part = compiled(_sum_part, jit_compile, devices[0])
            totals = transport.reduce_scatter(
                wires, sum_parts=lambda received: sum_part(received, layout)
            )
            if rows:
                (index,) = pack
                (parts, length) = shapes[0]
                for r, device in enumerate(devices):
                    with tf.device(device):
                        combined[r][index] = totals[r][:length]
                        if self.error_feedback:
                            error = tf.reshape(worker_errors[r], [parts, -1])[:, :length]
                            new_states[r][index] = {"residual": error}
                continue
            gathered_rows, owner_errors = [], []
            for device, total in zip(devices, totals):
                with tf.device(device):
                    row, error = self._quantized(total, 1, jit_compile, device)
                gathered_rows.append(row)
                owner_errors.append(error)
            gathered = transport.all_gather(gathered_rows)
            for r, device in enumerate(devices):
                with tf.device(device):
                    # TensorFlow's split does not copy; XLA's would.
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
        return combined, new_states, each_finite(devices, combined)

    def _plan(self, like, transport, rows):
        """The packs of `like` (one replica's values), each as its indices
        and `_Layout`: an all-reduce's in packs of `bytes_per_pack`; a
        reduce-scatter's each value alone, its rows padded to whole chunks."""
        if not rows:
            sizes = [(v.dtype, v.shape.num_elements()) for v in like]
            return _plan(sizes, transport.size, self.chunk_size, self.bits, transport.bytes_per_pack)
        return [
            ([i], _rows_layout(*value.shape.as_list(), self.chunk_size, self.bits))
            for i, value in enumerate(like)
        ]

    def _quantized(self, flat, rows, jit_compile, device):
        """`flat` quantized as an int32 buffer of `rows` rows, and what
        quantization dropped (None without error feedback)."""
        codes, scales = compiled(_quantize_flat, jit_compile, device)(flat, self.chunk_size, self.bits)
        return compiled(_encode, jit_compile, device)(
            flat, codes, scales, rows, self.bits, self.error_feedback
        )


@keras.saving.register_keras_serializable(package="tf_agn")
class Int4(Int8):
    """4-bit integers (levels ±7) with a scale per chunk, and error feedback.

    `Int8` with codes of 4 bits, eight to an int32: half of int8's code
    bytes, with 18 times coarser steps. For values that tolerate coarse
    rounding, such as DiLoCo's and Streaming DiLoCo's outer gradients.

    ```python
    optimizer = tf_agn.optimizers.StreamingDiLoCo(
        keras.optimizers.AdamW(1e-3), local_steps=8, num_fragments=2,
        compression=tf_agn.compression.Int4(chunk_size=256),  # or "int4"
    )
    ```

    Args:
        chunk_size: the elements that share one float32 scale; a multiple
            of 8.
        error_feedback: see `tf_agn.compression.ErrorFeedbackCompressor`.
        start_step: see `tf_agn.compression.ErrorFeedbackCompressor`.

    Raises:
        ValueError: for a `chunk_size` that is not a positive multiple of 8.
    """

    name = "int4"
    bits = 4


class _Layout(collections.namedtuple("_Layout", ["length", "parts", "chunk_size", "bits"])):
    """How a pack of `length` elements is padded and split into `parts`,
    as codes of `bits` bits."""

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
        """The bytes of one replica's buffer: codes and scales; to a single
        receiver, the codes unpadded."""
        codes = self.length if self.parts == 1 else self.padded
        return -(-codes * self.bits // 8) + 4 * self.parts * self.chunks_per_part


def _plan(sizes, parts, chunk_size, bits, bytes_per_pack=None):
    """The packs of values of `sizes`, each as its indices and `_Layout`;
    with no `bytes_per_pack`, each value alone."""
    packs = [[i] for i in range(len(sizes))] if bytes_per_pack is None else (
        packing.plan_packs(sizes, bytes_per_pack)
    )
    return [
        (pack, _Layout(sum(sizes[i][1] for i in pack), parts, chunk_size, bits)) for pack in packs
    ]


def _rows_layout(num_rows, length, chunk_size, bits):
    """How a reduce-scatter pads n rows of `length`: each to whole chunks."""
    padded = -(-length // chunk_size) * chunk_size
    return _Layout(num_rows * padded, num_rows, chunk_size, bits)


def quantize(chunks, bits=8):
    """Symmetric codes of `bits` bits (within ±(2^(bits-1) - 1), as int8) and
    float32 scales of `chunks` ([n, chunk]); a chunk with a non-finite
    element gets a NaN scale."""
    levels = float(2 ** (bits - 1) - 1)
    # Non-finite counts as infinite: a maximum may skip NaN, and a NaN cast
    # to int8 is undefined, so a NaN could otherwise arrive finite.
    magnitudes = tf.reduce_max(
        tf.where(tf.math.is_finite(chunks), tf.abs(chunks), float("inf")), axis=1
    )
    finite = tf.math.is_finite(magnitudes)
    # TensorFlow flushes subnormal floats to zero on CPUs.
    steps = tf.maximum(magnitudes / levels, np.finfo(np.float32).tiny)
    scales = tf.where(finite, steps, float("nan"))
    codes = tf.where(finite[:, None], tf.round(chunks / scales[:, None]), 0.0)
    # The cast to int8 wraps (a kept subnormal step can give 128).
    return tf.cast(tf.clip_by_value(codes, -levels, levels), tf.int8), scales


def dequantize(codes, scales):
    """The float32 values of int8 `codes` ([n, chunk]) and their `scales`."""
    return tf.cast(codes, tf.float32) * scales[:, None]


def _to_bytes(codes, bits):
    """Flat int8 `codes` of `bits` bits, 8 / `bits` to a byte, the first in
    the lowest bits."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    fields = tf.reshape(tf.cast(codes, tf.int32), [-1, per_byte])
    # The lower fields' two's-complement bits, shifted by multiplying; the
    # top field keeps its sign, so that the byte lies within int8's range.
    shifts = tf.constant([2 ** (bits * k) for k in range(per_byte - 1)])
    lower = tf.bitwise.bitwise_and(fields[:, :-1], 2**bits - 1) * shifts
    top = fields[:, -1] * 2 ** (bits * (per_byte - 1))
    return tf.cast(tf.reduce_sum(lower, axis=1) + top, tf.int8)


def _from_bytes(packed, bits):
    """The flat int8 codes of `bits` bits that `_to_bytes` packed."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = tf.constant([bits * k for k in range(per_byte)])
    fields = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.cast(packed, tf.int32)[:, None], shifts), 2**bits - 1
    )
    # Two's complement: fields past the largest code are negative.
    codes = tf.where(fields >= 2 ** (bits - 1), fields - 2**bits, fields)
    return tf.cast(tf.reshape(codes, [-1]), tf.int8)


def _to_wire(codes, scales, rows, bits):
    """Codes of `bits` bits and scales as one int32 buffer of `rows` rows."""
    code_bytes = _to_bytes(tf.reshape(codes, [-1]), bits)
    code_words = tf.bitcast(tf.reshape(code_bytes, [rows, -1, 4]), tf.int32)
    scale_words = tf.bitcast(tf.reshape(scales, [rows, -1]), tf.int32)
    return tf.concat([code_words, scale_words], axis=1)


def _from_wire(wire, layout):
    """The codes ([chunks, chunk_size]) and scales of a buffer's rows."""
    code_words = layout.part_length * layout.bits // 32
    code_bytes = tf.bitcast(wire[:, :code_words], tf.int8)
    codes = _from_bytes(tf.reshape(code_bytes, [-1]), layout.bits)
    scales = tf.bitcast(wire[:, code_words:], tf.float32)
    return (
        tf.reshape(codes, [-1, layout.chunk_size]),
        tf.reshape(scales, [-1]),
    )


# Each step below is its own XLA call: XLA's CPU fusion recomputes a fused
# concatenation or reduction in each consumer (one call was 1.5x slower).


def _pack(tensors, residuals, scale, layout, rows):
    """One replica's pack, scaled, plus its residuals: flat and padded, as a
    whole, or (`rows`: one tensor of `layout.parts` rows) row by row."""
    if rows:
        (tensor,) = tensors
        scaled = tensor * scale
        if residuals:
            scaled += residuals[0]
        width = layout.part_length - tensor.shape[1]
        return tf.reshape(tf.pad(scaled, [[0, 0], [0, width]]), [-1])
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0) * scale
    if residuals:
        flat += tf.concat([tf.reshape(e, [-1]) for e in residuals], 0)
    return tf.pad(flat, [[0, layout.padded - layout.length]])


def _quantize_flat(flat, chunk_size, bits):
    return quantize(tf.reshape(flat, [-1, chunk_size]), bits)


def _encode(flat, codes, scales, rows, bits, with_error):
    """Quantized `flat` as an int32 buffer of `rows` rows, and (if
    `with_error`) what quantization dropped, else None."""
    wire = _to_wire(codes, scales, rows, bits)
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
    """The new residuals, flat: both quantizations' errors."""
    # A select, not a pad: the rank may be a tensor, and XLA pads by constants.
    mine = tf.equal(tf.range(layout.parts), tf.cast(rank, tf.int32))[:, None]
    owner = tf.where(mine, owner_error[None, :], 0.0)
    return worker_error + tf.reshape(owner, [-1])


def _split(flat, shapes):
    sizes = [int(np.prod(shape)) for shape in shapes]
    pieces = tf.split(flat[: sum(sizes)], sizes)
    return [tf.reshape(p, shape) for p, shape in zip(pieces, shapes)]
