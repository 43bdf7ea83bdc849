"""`Cast`: values travel as a smaller float dtype, element by element.

A cast runs inside the transports' packed, XLA-compiled all-reduce, so it
must commute with summation up to rounding: a cast, or a scaling every
replica shares. Example:

```python
class Float16Scaled(tf_agn.compression.Cast):
    def __init__(self):
        super().__init__("fp16_scaled", tf.float16)

    def compress(self, tensor):
        return tf.cast(tensor * 2.0**-8, tf.float16)

    def decompress(self, tensor, dtype):
        return tf.cast(tensor, dtype) * 2.0**8
```

Compiled functions trace once per compressor object: keep the default
`__eq__` and `__hash__`.
"""

import tensorflow as tf

from tf_agn.collectives import packing
from tf_agn.collectives.aggregation_method import weighted
from tf_agn.compression.compressor import Compressor
from tf_agn.compression.compressor import each_finite
from tf_agn.compression.compressor import num_elements


class Cast(Compressor):
    """Casts float32 and float64 values to a smaller float dtype.

    Args:
        name: the compressor's name.
        dtype: the dtype values travel, and are summed, in.
    """

    patterns = {"all_reduce": ("all_reduce",), "reduce_scatter": ("reduce_scatter",)}
    travels_loss_scaled = True

    def __init__(self, name, dtype):
        self.name = name
        self.dtype = dtype

    def wire_dtype(self, dtype):
        """The dtype values of `dtype` travel in."""
        return self.dtype if dtype in (tf.float32, tf.float64) else dtype

    def compress(self, tensor):
        """Maps one (weighted) tensor to what travels: `wire_dtype`, same shape."""
        return tf.cast(tensor, self.dtype)

    def decompress(self, tensor, dtype):
        """Maps a received tensor back to `dtype`, element by element.

        The local transport calls it before summing, on a whole pack
        flattened into one buffer, with `dtype` possibly wider (float32 for
        float16).
        """
        return tf.cast(tensor, dtype)

    def acts_on(self, value):
        if isinstance(value, tf.IndexedSlices):
            return False
        dtype = tf.as_dtype(value.dtype)
        return self.wire_dtype(dtype) != dtype

    def wire_bytes(self, values, num_replicas=1, bytes_per_pack=None):
        del num_replicas, bytes_per_pack  # Nothing is padded.
        return sum(num_elements(v) * self.wire_dtype(tf.as_dtype(v.dtype)).size for v in values)

    def combine(self, transport, values, states, weights, pattern="all_reduce"):
        if pattern == "all_reduce":
            combined = packing.all_reduce_packs(transport, values, lambda dtype: weights, self)
            return combined, states, each_finite(transport.devices, combined)
        combined = [[] for _ in values]
        for position in range(len(values[0])):
            tensors = weighted([replica[position] for replica in values], weights, transport.devices)
            wires = []
            for device, tensor in zip(transport.devices, tensors):
                with tf.device(device):
                    wires.append(self.compress(tensor))
            dtype = values[0][position].dtype
            for device, replica, row in zip(transport.devices, combined, transport.reduce_scatter(wires)):
                with tf.device(device):
                    replica.append(self.decompress(row, dtype))
        return combined, states, each_finite(transport.devices, combined)

    def encode(self, value, state):
        del state  # A cast keeps none.
        return (self.compress(value),), {}

    def decode(self, payload, shape, dtype):
        del shape
        return self.decompress(payload[0], dtype)

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"


# float16: 11 significant bits up to 65504; bfloat16: float32's range, 8 bits.
FP16 = Cast("fp16", tf.float16)
BF16 = Cast("bf16", tf.bfloat16)
