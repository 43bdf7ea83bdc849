"""Stateless compressors: casts that act on each element alone.

A `Compressor` runs inside `AggregatingAllReduce`'s packed, XLA-compiled
path, so it must commute with summation up to rounding: a cast, or a
scaling every replica shares. Example:

```python
class Float16Scaled(tf_agn.compression.Compressor):
    name = "fp16_scaled"

    def wire_dtype(self, dtype):
        return tf.float16 if dtype == tf.float32 else dtype

    def compress(self, tensor):
        return tf.cast(tensor * 2.0**-8, tf.float16)

    def decompress(self, tensor, dtype):
        return tf.cast(tensor, dtype) * 2.0**8
```

Compiled functions trace once per compressor object: keep the default
`__eq__` and `__hash__`.
"""

import tensorflow as tf


class Compressor:
    """Base class of stateless compressors: a tensor's dtype on the wire
    and the functions that map it there and back.

    Values of dtypes `wire_dtype` leaves unchanged travel unchanged.

    Attributes:
        name: a short string; every worker's compressor must have the same.
        patterns: the transport patterns its values travel by.
    """

    name = None
    patterns = ("all_reduce",)

    def wire_dtype(self, dtype):
        """The dtype values of `dtype` travel, and are summed, in."""
        raise NotImplementedError

    def compress(self, tensor):
        """Maps one (scaled) tensor to what travels: `wire_dtype`, same shape."""
        raise NotImplementedError

    def decompress(self, tensor, dtype):
        """Maps a received tensor back to `dtype`, element by element.

        The local transport calls it before summing, on a whole pack
        flattened into one buffer, with `dtype` possibly wider (float32 for
        float16).
        """
        raise NotImplementedError

    def wire_bytes(self, shape, dtype):
        """The bytes one replica sends for a value of `shape` and `dtype`."""
        return shape.num_elements() * self.wire_dtype(dtype).size

    def encode(self, value, state):
        """`(payload, new_state)` for a trip to a single receiver (an
        asynchronous commit to a parameter server); casts have no state."""
        del state
        return (self.compress(value),), {}

    def decode(self, payload, shape, dtype):
        """The value `encode` made `payload` of, on the receiver."""
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


# float16: 11 significant bits up to 65504; bfloat16: float32's range, 8 bits.
FP16 = Cast("fp16", tf.float16)
BF16 = Cast("bf16", tf.bfloat16)
