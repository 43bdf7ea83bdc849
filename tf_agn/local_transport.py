"""The local transport: each pack is combined on one reduce device.

Every replica's part of a pack goes to the reduce device, where one
`tf.function(jit_compile=True)` call sums and scales it, and the result is
sent to the destinations. Where devices have memory of their own (GPUs),
each replica first concatenates its part into one flat buffer, so that a
pack crosses devices as one transfer; logical CPU devices share host memory
and are read in place, unless a pack holds many small tensors, where one
buffer saves the per-tensor costs. `AggregatingAllReduce` explains when it
takes this transport.
"""

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn import packing
from tf_agn import placement
from tf_agn.aggregation import contributes
from tf_agn.aggregation import method_scale


class LocalCommunicator:
    """The collectives a stateful compressor uses
    (`tf_agn.compression.ErrorFeedbackCompressor`), among the replicas of
    one process: each takes one tensor per replica and returns one per
    replica, on its device. Sums are taken on `reduce_device`.

    Args:
        devices: the replicas' devices.
        reduce_device: where sums are taken.
    """

    def __init__(self, devices, reduce_device):
        self.devices = tuple(devices)
        self.size = len(self.devices)
        self.reduce_device = reduce_device

    def rank(self, replica):
        return replica

    def all_reduce(self, tensors):
        with tf.device(self.reduce_device):
            total = tf.add_n(tensors)
        return [placement.on(device, total) for device in self.devices]

    def all_to_all(self, tensors):
        return [
            self._on(device, lambda j=j: tf.stack([t[j] for t in tensors]))
            for j, device in enumerate(self.devices)
        ]

    def all_gather(self, tensors):
        return [self._on(device, lambda: tf.concat(tensors, 0)) for device in self.devices]

    def _on(self, device, make):
        with tf.device(device):
            return make()


class LocalTransport:
    """Combines per-replica values of one process on one device.

    Args:
        reduce_to_device: the device that reduces; by default the first
            destination device.
        flatten_packs: "auto", True or False: whether each replica's part
            of a pack is concatenated into one flat buffer before it
            travels.
        jit_compile: whether to compile the packing and reduction with XLA.
    """

    def __init__(self, reduce_to_device, flatten_packs, jit_compile):
        self.reduce_to_device = reduce_to_device
        self.flatten_packs = flatten_packs
        self.jit_compile = jit_compile

    def aggregate(
        self, method, values, sources, devices, value_scale, bytes_per_pack, compressor
    ):
        """Combines `values` with `method` (anything but NONE).

        Args:
            method: an `AggregationMethod`.
            values: a list of `PerReplica` values, replica r's on
                `sources[r]`.
            sources: the replicas' devices.
            devices: for each value, the devices its result goes to.
            value_scale: a Python float every value is multiplied by.
            bytes_per_pack: the most bytes one pack may hold.
            compressor: a `tf_agn.compression.Compressor`, or None.

        Returns:
            One `Mirrored` value per value.
        """
        results = [None] * len(values)
        sparse, packs = packing.split_packs([v.values[0] for v in values], bytes_per_pack)
        for index in sparse:
            results[index] = self._gather_slices(
                method, values[index], devices[index], value_scale
            )
        for pack in packs:
            per_device = self._combine_pack(
                method,
                [values[i] for i in pack],
                sources,
                devices[pack[0]],
                value_scale,
                compressor,
            )
            for position, index in enumerate(pack):
                copies = tuple(tensors[position] for tensors in per_device)
                results[index] = _compat.regroup(copies, wrap_class=_compat.Mirrored)
        return results

    def _combine_pack(
        self, method, values, sources, destinations, value_scale, compressor
    ):
        """Reduces one pack of same-dtype dense values on one device.

        Each replica's part travels compressed by `compressor` (if it acts
        on the pack's dtype) and is decompressed before the sum, which is
        taken in full precision.

        Returns:
            One list of the pack's results per destination, on it.
        """
        dtype = values[0].values[0].dtype
        num_replicas = len(values[0].values)
        scale = method_scale(method, dtype, num_replicas, value_scale)
        replicas = [r for r in range(num_replicas) if contributes(method, r)]
        if len(replicas) < num_replicas:
            device = sources[0]  # Only replica 0's tensors travel: no copy.
        else:
            device = self.reduce_to_device or destinations[0]
        like = [v.values[0] for v in values]
        flatten = self._flatten_packs(destinations, like)
        compressor = compression.acting_on(compressor, dtype)
        parts = [
            self._send([v.values[r] for v in values], sources[r], flatten, compressor)
            for r in replicas
        ]
        jit = self._jit(device)
        with tf.device(device):
            reduced = packing.combine_fn(jit)(parts, scale, dtype, compressor)
        if not flatten:
            return [[placement.on(d, t) for t in reduced] for d in destinations]
        # The one buffer travels; each destination splits its own copy, so
        # every result is made on its device without a copy per tensor.
        unpacked = []
        for destination in destinations:
            with tf.device(destination):
                unpacked.append(
                    packing.unflatten(
                        reduced[0], like, jit_compile=self._jit(destination)
                    )
                )
        return unpacked

    def _send(self, tensors, device, flatten, compressor):
        """Prepares one replica's part of a pack for the trip: compressed
        and, where that saves work, flattened into one buffer."""
        with tf.device(device):
            # A variable (a sync-on-read variable's component) is read here,
            # on its own device: the compiled combine on the reduce device
            # cannot read another device's resource.
            tensors = [tf.convert_to_tensor(t) for t in tensors]
            if not flatten:
                if compressor is None:
                    return tensors
                return [compressor.compress(t) for t in tensors]
            return [
                packing.flatten(
                    tensors, compressor=compressor, jit_compile=self._jit(device)
                )
            ]

    def _jit(self, device):
        return packing.use_xla(self.jit_compile, device)

    def _flatten_packs(self, devices, tensors):
        """Whether to flatten a pack of `tensors` for `devices`: where
        transfers are real copies (not logical CPUs), or where the pack
        holds so many small tensors that per-tensor costs outweigh a pass
        over its bytes."""
        if self.flatten_packs != "auto":
            return self.flatten_packs
        if any(tf.DeviceSpec.from_string(d).device_type != "CPU" for d in devices):
            return True
        sizes = [t.shape.num_elements() or 1 for t in tensors]
        mean_bytes = sum(sizes) * tensors[0].dtype.size / len(tensors)
        return len(tensors) > 1 and mean_bytes < packing.SMALL_TENSOR_BYTES

    def _gather_slices(self, method, value, devices, value_scale):
        slices = value.values
        slices = [s for r, s in enumerate(slices) if contributes(method, r)]
        scale = method_scale(method, slices[0].dtype, len(value.values), value_scale)
        with tf.device(self.reduce_to_device or devices[0]):
            gathered = tf.IndexedSlices(
                tf.concat([s.values for s in slices], 0)
                * tf.constant(scale, slices[0].dtype),
                tf.concat([s.indices for s in slices], 0),
                slices[0].dense_shape,
            )
        return placement.mirror(gathered, devices)
