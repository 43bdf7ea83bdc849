"""Stateless compressors: casts that act on each element alone.

A `Compressor` runs inside the packed, XLA-compiled path of
`AggregatingAllReduce`: on the sending replica's device each tensor of a
pack is scaled, then compressed and concatenated in one compiled call, and
the buffers travel. The collective transport sums them in `wire_dtype`,
then one compiled call splits the sum and decompresses each tensor; the
local transport decompresses each replica's buffer and sums in full
precision, in one compiled call. So a compressor must commute with
summation up to rounding: a cast, or a scaling every replica shares.

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
```

The compiled functions take the compressor as a Python value and trace
once per compressor object, so keep the default identity-based `__eq__`
and `__hash__`, and build one per strategy or optimizer. Compressors that
keep state between steps (error feedback) are
`tf_agn.compression.ErrorFeedbackCompressor`s.
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
        patterns: the transport patterns its values travel by: a cast
            wraps an all-reduce.
    """

    name = None
    patterns = ("all_reduce",)

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

    def wire_bytes(self, shape, dtype):
        """The bytes one replica sends for a value of `shape` and `dtype`.

        Args:
            shape: a fully defined `tf.TensorShape`.
            dtype: the value's `tf.DType`.

        Returns:
            An int.
        """
        return shape.num_elements() * self.wire_dtype(dtype).size

    def encode(self, value, state):
        """Compresses one value for a trip to a single receiver (an
        asynchronous commit to a parameter server).

        Args:
            value: a tensor this compressor acts on.
            state: the value's state; casts have none ({}).

        Returns:
            `(payload, new_state)`: the tensors that travel, and {}.
        """
        del state
        return (self.compress(value),), {}

    def decode(self, payload, shape, dtype):
        """The value `encode` made `payload` of, on the receiver.

        Args:
            payload: what `encode` returned.
            shape: the value's static shape.
            dtype: the value's dtype.

        Returns:
            A tensor of `shape` and `dtype`.
        """
        del shape
        return self.decompress(payload[0], dtype)

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
