"""Grouping many tensors into a few packs per dtype, and the compiled combine."""

import functools

import numpy as np
import tensorflow as tf

from tf_agn.utils import devices as devices_lib

XLA_DEVICE_TYPES = ("CPU", "GPU", "TPU")

# A few MiB amortize a call's fixed cost yet let TensorFlow run packs in
# parallel; on CPU, freeing tens of MiB at once makes malloc return the pages
# to the OS and fault them in again next step.
DEFAULT_BYTES_PER_PACK = 4 * 2**20

# Below this mean tensor size, per-tensor overhead costs more than a copy:
# the local transport flattens even between logical CPUs.
SMALL_TENSOR_BYTES = 16 * 2**10


def plan_packs(dtypes_and_sizes, bytes_per_pack):
    """Lists of indices into `dtypes_and_sizes` (`(dtype, num_elements)`
    pairs), one dtype each, in order, of at most `bytes_per_pack` bytes
    (a larger tensor alone)."""
    open_packs = {}
    packs = []
    for index, (dtype, size) in enumerate(dtypes_and_sizes):
        nbytes = size * dtype.size
        pack = open_packs.get(dtype)
        if pack is None or pack["bytes"] + nbytes > bytes_per_pack:
            pack = {"indices": [], "bytes": 0}
            open_packs[dtype] = pack
            packs.append(pack["indices"])
        pack["indices"].append(index)
        pack["bytes"] += nbytes
    return packs


def split_packs(tensors, bytes_per_pack):
    """`(sparse indices, packs of dense indices)` of one replica's `tensors`."""
    sparse, dense = [], []
    for index, tensor in enumerate(tensors):
        is_sparse = isinstance(tensor, tf.IndexedSlices)
        (sparse if is_sparse else dense).append(index)
    # A shape not fully known while tracing counts as one element.
    sizes = [(tensors[i].dtype, tensors[i].shape.num_elements() or 1) for i in dense]
    packs = plan_packs(sizes, bytes_per_pack)
    return sparse, [[dense[i] for i in pack] for pack in packs]


def all_reduce_packs(transport, values, weights_of, cast=None):
    """Every local replica's dense `values` (a list per replica), all-reduced
    on `transport` in packs of one dtype, each weighted by
    `weights_of(dtype)` and carried by `cast` (a `tf_agn.compression.Cast`)
    if given; returns them laid out like `values`."""
    _, packs = split_packs(values[0], transport.bytes_per_pack)
    combined = [list(replica) for replica in values]
    # Backward order: the last layers' gradients exist first, so their packs
    # travel while the backward pass computes the earlier layers'.
    for pack in reversed(packs):
        weights = weights_of(values[0][pack[0]].dtype)
        summed = transport.all_reduce([[replica[i] for i in pack] for replica in values], weights, cast)
        for replica, tensors in zip(combined, summed):
            for index, tensor in zip(pack, tensors):
                replica[index] = tensor
    return combined


def accumulation_dtype(dtype):
    """The dtype sums are taken in: at least float32 for floats."""
    if dtype in (tf.float16, tf.bfloat16):
        return tf.float32
    return dtype


def _combine(per_replica_tensors, scale, output_dtype, compressor=None):
    """`scale * sum_r per_replica_tensors[r]` per position, summed in
    `accumulation_dtype`; XLA fuses decompression, sum and scale."""
    dtype = accumulation_dtype(output_dtype)
    combined = []
    for i in range(len(per_replica_tensors[0])):
        total = tf.add_n(
            [_restore(t[i], dtype, compressor) for t in per_replica_tensors]
        )
        if scale != 1:
            total = total * tf.constant(scale, dtype)
        combined.append(tf.cast(total, output_dtype))
    return combined


def _restore(tensor, dtype, compressor):
    """`tensor` as `dtype`, decompressed if `compressor` compressed it."""
    if compressor is None:
        return tf.cast(tensor, dtype)
    return compressor.decompress(tensor, dtype)


def _flatten(tensors, scale=1, compressor=None):
    """Concatenates `scale * tensors`, compressed, into one flat buffer."""
    pieces = []
    for tensor in tensors:
        tensor = scaled(tensor, scale)
        if compressor is not None:
            tensor = compressor.compress(tensor)
        pieces.append(tf.reshape(tensor, [-1]))
    return tf.concat(pieces, 0)


def scaled(tensor, scale):
    """`tensor` times a Python number, multiplied in `accumulation_dtype`."""
    # Every path scales before compressing: float16 must not overflow first.
    if scale == 1:
        return tensor
    wide = accumulation_dtype(tensor.dtype)
    return tf.cast(tf.cast(tensor, wide) * tf.constant(scale, wide), tensor.dtype)


def _unflatten(flat, shapes, dtype, compressor=None):
    """Splits `flat` into tensors of `shapes` (tuples for XLA, or shape
    tensors) and `dtype`."""
    sizes = [
        int(np.prod(s)) if isinstance(s, tuple) else tf.reduce_prod(s)
        for s in shapes
    ]
    pieces = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
    return [
        _restore(tf.reshape(p, s), dtype, compressor) for p, s in zip(pieces, shapes)
    ]


# GPUs get a flat pack to move as one transfer; logical CPUs share memory
# and read tensors in place (but see SMALL_TENSOR_BYTES).
def flatten(tensors, scale=1, compressor=None, jit_compile=False):
    """`scale * tensors` of one pack, compressed, as one 1-D tensor."""
    # Only a scale or compression needs the fused `flatten_fn`.
    if scale == 1 and compressor is None:
        pieces = [tf.reshape(t, [-1]) for t in tensors]
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)
    return flatten_fn(jit_compile)(tensors, scale, compressor)


def unflatten(flat, like, compressor=None, jit_compile=False):
    """Splits `flat` back into tensors shaped like `like`, of its dtype."""
    dtype = like[0].dtype
    static = all(t.shape.is_fully_defined() for t in like)
    # XLA needs constant split sizes; TF's split on CPU copies nothing.
    if compressor is not None and static:
        shapes = tuple(tuple(t.shape.as_list()) for t in like)
        return unflatten_fn(jit_compile)(flat, shapes, dtype, compressor)
    shapes = [tuple(t.shape.as_list()) if static else tf.shape(t) for t in like]
    return _unflatten(flat, shapes, dtype, compressor)


@functools.cache
def weighted_sum_fn(jit_compile):
    return tf.function(_combine, jit_compile=jit_compile, autograph=False)


@functools.cache
def flatten_fn(jit_compile):
    return tf.function(_flatten, jit_compile=jit_compile, autograph=False)


@functools.cache
def unflatten_fn(jit_compile):
    return tf.function(_unflatten, jit_compile=jit_compile, autograph=False)


def supports_xla(device):
    return devices_lib.device_type(device) in XLA_DEVICE_TYPES


def use_xla(jit_compile, device):
    return jit_compile and supports_xla(device)
