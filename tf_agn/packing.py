"""Grouping many tensors into a few packs, and the compiled combine.

`plan_packs` and `split_packs` group tensors, per dtype, into packs of at
most `bytes_per_pack` bytes; `flatten` and `unflatten` turn a pack into one
buffer and back; `combine_fn` reduces a pack in one compiled call.
"""

import functools

import numpy as np
import tensorflow as tf

from tf_agn import devices as devices_lib

# Devices on which XLA can compile our combine function. Elsewhere the same
# function runs as an ordinary graph function.
XLA_DEVICE_TYPES = ("CPU", "GPU", "TPU")

# Reducing 200 small gradient tensors one by one pays a call's fixed cost
# 200 times; a pack pays it once. Packs of a few MiB are large enough that
# the fixed cost of a call is small next to its work, and small enough that
# TensorFlow runs several at once (XLA also splits one large loop across
# threads). On CPU they also keep each call's outputs small: a call that
# allocates and then frees tens of MiB at once has malloc hand the pages
# back to the OS and fault them in again on the next step, which costs more
# than the sum itself.
DEFAULT_BYTES_PER_PACK = 4 * 2**20

# Below this mean tensor size, the local transport flattens a pack even
# between logical CPUs: two thousand 1 KiB tensors cost more in per-tensor
# work (an argument, an output and a copy per device each) than one pass
# over their 2 MiB does.
SMALL_TENSOR_BYTES = 16 * 2**10


def plan_packs(dtypes_and_sizes, bytes_per_pack):
    """Groups tensor indices into packs of one dtype and bounded size.

    Tensors keep their order within a dtype. A tensor larger than
    `bytes_per_pack` gets a pack of its own.

    Args:
        dtypes_and_sizes: a list of `(tf.DType, num_elements)` pairs.
        bytes_per_pack: the most bytes one pack may hold.

    Returns:
        A list of packs, each a list of indices into `dtypes_and_sizes`.
    """
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
    """Splits one replica's `tensors` into the indices of the sparse ones
    and packs of indices of the dense ones.

    Args:
        tensors: tensors and `tf.IndexedSlices`.
        bytes_per_pack: the most bytes one pack may hold.

    Returns:
        `(sparse, packs)`: a list of indices, and a list of packs, each a
        list of indices of dense tensors of one dtype (`plan_packs`).
    """
    sparse, dense = [], []
    for index, tensor in enumerate(tensors):
        is_sparse = isinstance(tensor, tf.IndexedSlices)
        (sparse if is_sparse else dense).append(index)
    # A shape not fully known while tracing counts as one element.
    sizes = [(tensors[i].dtype, tensors[i].shape.num_elements() or 1) for i in dense]
    packs = plan_packs(sizes, bytes_per_pack)
    return sparse, [[dense[i] for i in pack] for pack in packs]


def accumulation_dtype(dtype):
    """The dtype sums are taken in: at least float32 for floats."""
    if dtype in (tf.float16, tf.bfloat16):
        return tf.float32
    return dtype


def _combine(per_replica_tensors, scale, output_dtype, compressor=None):
    """Returns `scale * sum_r per_replica_tensors[r]`, tensor by tensor.

    Sums are taken in `accumulation_dtype(output_dtype)` and cast to
    `output_dtype`.

    Args:
        per_replica_tensors: one list of tensors per replica, all lists
            alike in length and shapes.
        scale: a Python number.
        output_dtype: the dtype of the results.
        compressor: the `tf_agn.compression.Compressor` that compressed the
            tensors, or None if they travelled as they are.

    Returns:
        A list of tensors, one per position in the replicas' lists.
    """
    # XLA fuses the decompression or casts, the sum and the scaling into one
    # pass over each tensor.
    dtype = accumulation_dtype(output_dtype)
    combined = []
    for i in range(len(per_replica_tensors[0])):
        total = tf.add_n(
            [_restore(t[i], dtype, compressor) for t in per_replica_tensors]
        )
        # `scale` is a constant of the traced function: a scale of 1 costs
        # nothing, even without XLA.
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
    """`tensor` times a Python number, multiplied in `accumulation_dtype`
    and returned in `tensor`'s dtype: how every path weights a value
    before it compresses it.

    Args:
        tensor: a tensor.
        scale: a Python number.

    Returns:
        A tensor of `tensor`'s dtype and shape.
    """
    # Scaled before compression, so that a MEAN's 1/n or a window's 1/k
    # shrinks float32 values before they are cast to float16, not after
    # they may have overflowed, and the scale itself is not rounded to the
    # wire dtype.
    if scale == 1:
        return tensor
    wide = accumulation_dtype(tensor.dtype)
    return tf.cast(tf.cast(tensor, wide) * tf.constant(scale, wide), tensor.dtype)


def _unflatten(flat, shapes, dtype, compressor=None):
    """Splits a flat buffer into tensors of `shapes` and `dtype`.

    Args:
        flat: a 1-D tensor.
        shapes: one shape per tensor: Python tuples (static, as XLA needs)
            or shape tensors.
        dtype: the dtype of the results.
        compressor: the `tf_agn.compression.Compressor` that made `flat`,
            or None.

    Returns:
        A list of tensors.
    """
    sizes = [
        int(np.prod(s)) if isinstance(s, tuple) else tf.reduce_prod(s)
        for s in shapes
    ]
    pieces = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
    return [
        _restore(tf.reshape(p, s), dtype, compressor) for p, s in zip(pieces, shapes)
    ]


# A pack that travels between devices with their own memory (GPUs) is
# flattened first, to move as one transfer. Devices that share host memory
# (logical CPUs) read the tensors in place, as a copy into a buffer would
# only add a pass over memory (but see SMALL_TENSOR_BYTES).
def flatten(tensors, scale=1, compressor=None, jit_compile=False):
    """`scale * tensors`, compressed, as one flat buffer.

    Args:
        tensors: the tensors of one pack, on one device.
        scale: a Python number.
        compressor: a `tf_agn.compression.Compressor` that acts on the
            pack's dtype, or None.
        jit_compile: whether `flatten_fn` is XLA-compiled.

    Returns:
        A 1-D tensor.
    """
    # Only a scale or a compression needs `flatten_fn`, which fuses them; a
    # bare concatenation is TensorFlow's own op, and a single tensor is only
    # reshaped, which copies nothing.
    if scale == 1 and compressor is None:
        pieces = [tf.reshape(t, [-1]) for t in tensors]
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)
    return flatten_fn(jit_compile)(tensors, scale, compressor)


def unflatten(flat, like, compressor=None, jit_compile=False):
    """Splits a flat buffer back into tensors shaped like `like`, of
    `like`'s dtype.

    Args:
        flat: a 1-D tensor.
        like: the tensors whose shapes and dtype to take.
        compressor: the `tf_agn.compression.Compressor` that made `flat`,
            or None.
        jit_compile: whether `unflatten_fn` is XLA-compiled.

    Returns:
        A list of tensors.
    """
    dtype = like[0].dtype
    static = all(t.shape.is_fully_defined() for t in like)
    # `unflatten_fn` fuses the decompression, but XLA needs the split sizes
    # as constants. Otherwise TensorFlow's own split, which on CPU hands out
    # pieces of the buffer without copying them.
    if compressor is not None and static:
        shapes = tuple(tuple(t.shape.as_list()) for t in like)
        return unflatten_fn(jit_compile)(flat, shapes, dtype, compressor)
    shapes = [tuple(t.shape.as_list()) if static else tf.shape(t) for t in like]
    return _unflatten(flat, shapes, dtype, compressor)


@functools.cache
def combine_fn(jit_compile):
    """The combine function, XLA-compiled or as a plain graph function."""
    return tf.function(_combine, jit_compile=jit_compile, autograph=False)


@functools.cache
def flatten_fn(jit_compile):
    """The flatten function, XLA-compiled or as a plain graph function."""
    return tf.function(_flatten, jit_compile=jit_compile, autograph=False)


@functools.cache
def unflatten_fn(jit_compile):
    """The unflatten function, XLA-compiled or as a plain graph function."""
    return tf.function(_unflatten, jit_compile=jit_compile, autograph=False)


def supports_xla(device):
    """Whether XLA can compile for `device` (a device string)."""
    return devices_lib.device_type(device) in XLA_DEVICE_TYPES


def use_xla(jit_compile, device):
    """Whether to compile for `device`: asked to, and XLA can."""
    return jit_compile and supports_xla(device)
