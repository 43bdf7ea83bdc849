"""Gradient compression: what values become on their way between replicas.

`AggregatingAllReduce(compression=...)` compresses only what tf_agn's
optimizers send through `AggregatingAllReduce.aggregate`: gradients, and
the windowed optimizers' commits. TensorFlow's own entry points
(`strategy.reduce`, `batch_reduce_to`, Keras's loss and metric logs,
on-read variables, `replica_context.all_reduce`, and so Keras's own
optimizers) stay exact whatever the setting: a metric total past 65504 or
a count past 2048 would not survive float16.

A compressor runs inside the packed, XLA-compiled path: on the sending
replica's device each tensor of a pack is scaled, then compressed and
concatenated in one compiled call, and the buffers travel. The
collective transport sums them in `wire_dtype`, then one compiled call
splits the sum and decompresses each tensor; the local transport
decompresses each replica's buffer and sums in full precision, in one
compiled call. So a compressor must commute with summation up to
rounding: a cast, or a scaling every replica shares.

To write one, subclass `Compressor` and implement its three methods:

```python
class Float16Scaled(tf_agn.compression.Compressor):
    name = "fp16_scaled"  # what `tf_agn.agreement` compares across workers

    def wire_dtype(self, dtype):
        return tf.float16 if dtype == tf.float32 else dtype

    def compress(self, tensor):
        return tf.cast(tensor * 2.0**-8, tf.float16)

    def decompress(self, tensor, dtype):
        return tf.cast(tensor, dtype) * 2.0**8

ops = tf_agn.AggregatingAllReduce(compression=Float16Scaled())
```

Every worker must use a compressor of the same `name`. The compiled
functions take the compressor as a Python value and trace once per
compressor object, so keep the default identity-based `__eq__` and
`__hash__`, and build one per strategy.

Stateful compressors with error feedback (int8 with a residual, PowerSGD)
are not here yet. Their state is per replica (each replica's residual of
what compression lost), so it will live with the optimizer's state, in
per-replica optimizer variables like the windowed optimizers' inner state
(which `tf_agn.callbacks.BackupAndRestore` keeps for every replica); the
optimizer will hand each replica's state to `compress` and take the new
state back, and the compressor itself stays a stateless description like
the casts below.
"""

import tensorflow as tf


class Compressor:
    """How a tensor travels between replicas: its dtype on the wire and
    the functions that map it there and back.

    A compressor acts on exactly the dtypes `wire_dtype` maps to another
    dtype; values of other dtypes travel unchanged. Subclasses set `name`
    and implement `wire_dtype`, `compress` and `decompress`; see the module
    docstring for an example.

    Attributes:
        name: a short string naming the compressor; every worker's
            compressor must have the same one.
    """

    name = None

    def wire_dtype(self, dtype):
        """The dtype values of `dtype` travel, and are summed, in.

        Args:
            dtype: a `tf.DType`.

        Returns:
            A `tf.DType`: `dtype` itself for values left alone.
        """
        raise NotImplementedError

    def compress(self, tensor):
        """Maps one tensor to what travels.

        Called while tracing the compiled packing function, on the sending
        replica's device, after the tensor was scaled.

        Args:
            tensor: a tensor whose dtype this compressor acts on.

        Returns:
            A tensor of `wire_dtype(tensor.dtype)` and `tensor`'s shape.
        """
        raise NotImplementedError

    def decompress(self, tensor, dtype):
        """Maps a received tensor back.

        Called while tracing a compiled function: on the collective
        transport after the sum, on each tensor of the pack; on the local
        transport before the sum (taken in full precision), on each
        replica's part, which may be its whole pack flattened into one
        buffer. So it must act element by element.

        Args:
            tensor: a tensor of the wire dtype.
            dtype: the dtype to return: the values' own dtype, or the
                wider one the local transport sums it in (float32 for
                float16).

        Returns:
            A tensor of `dtype` and `tensor`'s shape.
        """
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"


class Cast(Compressor):
    """Casts float32 and float64 values to a smaller float dtype.

    Args:
        name: the compressor's name.
        dtype: the dtype values travel in.
    """

    def __init__(self, name, dtype):
        self.name = name
        self.dtype = dtype

    def wire_dtype(self, dtype):
        return self.dtype if dtype in (tf.float32, tf.float64) else dtype

    def compress(self, tensor):
        return tf.cast(tensor, self.dtype)

    def decompress(self, tensor, dtype):
        return tf.cast(tensor, dtype)


# float16 keeps 11 significant bits up to 65504; bfloat16 keeps float32's
# range with 8 significant bits.
FP16 = Cast("fp16", tf.float16)
BF16 = Cast("bf16", tf.bfloat16)

# The compressions `get` accepts by name.
BY_NAME = {compressor.name: compressor for compressor in (FP16, BF16)}


def get(identifier):
    """The compressor `identifier` names.

    Args:
        identifier: None (no compression), "fp16", "bf16" or a
            `Compressor`.

    Returns:
        A `Compressor`, or None for no compression.

    Raises:
        ValueError: for anything else, naming it and the allowed values.
    """
    if identifier is None or isinstance(identifier, Compressor):
        return identifier
    if isinstance(identifier, str) and identifier in BY_NAME:
        return BY_NAME[identifier]
    allowed = ", ".join(repr(name) for name in BY_NAME)
    raise ValueError(
        f"Unknown compression {identifier!r}. Allowed: None, {allowed}, or a "
        "tf_agn.compression.Compressor."
    )


def acting_on(compressor, dtype):
    """`compressor` if it compresses `dtype` values, else None."""
    if compressor is None or compressor.wire_dtype(dtype) == dtype:
        return None
    return compressor


def name_of(compressor):
    """`compressor`'s name, or None for no compression."""
    return None if compressor is None else compressor.name
