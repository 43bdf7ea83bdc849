"""`LocalTransport`: the patterns among the replicas of one process, each
sum taken on one reduce device."""

import tensorflow as tf

from tf_agn import devices as devices_lib
from tf_agn import packing
from tf_agn import placement


class LocalTransport:
    """The collective patterns among one process's replicas.

    Every replica's part of a pack goes to the reduce device, where one
    `tf.function(jit_compile=True)` call decompresses, sums and scales it,
    and the result goes back to every replica. Where devices have memory
    of their own (GPUs), each replica first concatenates its part into one
    flat buffer, so that a pack crosses devices as one transfer.

    Args:
        devices: the replicas' devices, in replica order.
        reduce_device: where sums are taken; by default the first replica's.
        flatten_packs: "auto", True or False: whether each replica's part
            of a pack is concatenated into one flat buffer before it
            travels. "auto" does so where transfers are copies (not
            logical CPUs), or where the pack holds many small tensors.
        jit_compile: whether the packing and sums are XLA-compiled.
        bytes_per_pack: the most bytes one pack may hold.
    """

    def __init__(self, devices, reduce_device, flatten_packs, jit_compile, bytes_per_pack):
        self.devices = tuple(devices)
        self.size = len(self.devices)
        self.reduce_device = reduce_device or self.devices[0]
        self.flatten_packs = flatten_packs
        self.jit_compile = jit_compile
        self.bytes_per_pack = bytes_per_pack

    def rank(self, replica):
        return replica

    def eager(self, key, function):
        """`function` itself: nothing here blocks on another replica."""
        del key
        return function

    def all_reduce(self, packs, weights=None, cast=None):
        """Every replica's pack, weighted and summed, tensor by tensor; see
        `tf_agn.transports.CollectiveTransport.all_reduce`. The replicas
        that add something share one weight, applied before a cast and
        otherwise after the sum, which is taken in at least float32
        (compressed values are decompressed first)."""
        weights = weights or [1] * len(packs)
        replicas = [r for r, weight in enumerate(weights) if weight != 0]
        scale = weights[replicas[0]]
        # Only replica 0's tensors travel: no copy.
        device = self.devices[0] if len(replicas) < self.size else self.reduce_device
        like = packs[0]
        dtype = like[0].dtype
        flatten = self._flatten(like)
        # A cast travels weighted, as on every transport: multiplied in
        # float32 before it is cast (`packing.scaled`). Uncompressed values
        # are weighted after their sum.
        sent, summed = (1, scale) if cast is None else (scale, 1)
        parts = [self._send(packs[r], self.devices[r], flatten, cast, sent) for r in replicas]
        with tf.device(device):
            reduced = packing.combine_fn(self._jit(device))(parts, summed, dtype, cast)
        if not flatten:
            return [[placement.on(d, t) for t in reduced] for d in self.devices]
        # The one buffer travels; each replica splits its own copy, so every
        # result is made on its device without a copy per tensor.
        results = []
        for device in self.devices:
            with tf.device(device):
                results.append(
                    packing.unflatten(reduced[0], like, jit_compile=self._jit(device))
                )
        return results

    def reduce_scatter(self, tensors, sum_parts=None):
        """Row r of every replica's tensor, summed, for replica r; see
        `tf_agn.transports.CollectiveTransport.reduce_scatter`."""
        reduced = []
        for device, rows in zip(self.devices, self.all_to_all(tensors)):
            with tf.device(device):
                reduced.append(tf.reduce_sum(rows, 0) if sum_parts is None else sum_parts(rows))
        return reduced

    def all_gather(self, tensors):
        """Every replica's tensor, concatenated along the first axis in
        replica order, on every replica."""
        gathered = []
        for device in self.devices:
            with tf.device(device):
                gathered.append(tf.concat(tensors, 0))
        return gathered

    def all_to_all(self, tensors):
        """Row j of each tensor to replica j, which receives every
        replica's row for it, in replica order."""
        received = []
        for j, device in enumerate(self.devices):
            with tf.device(device):
                received.append(tf.stack([t[j] for t in tensors]))
        return received

    def all_gather_rows(self, tensors):
        """Every replica's rows of each tensor, concatenated in replica
        order; replicas may hold different numbers of rows.

        Args:
            tensors: for each replica, a list of tensors.

        Returns:
            For each replica, the list of gathered tensors.
        """
        with tf.device(self.reduce_device):
            gathered = [tf.concat(list(position), 0) for position in zip(*tensors)]
        return [[placement.on(device, t) for t in gathered] for device in self.devices]

    def all_gather_slices(self, slices, weights):
        """Every replica's `tf.IndexedSlices`, weighted: their rows and
        indices concatenated on the reduce device; see
        `tf_agn.transports.CollectiveTransport.all_gather_slices`."""
        replicas = [r for r, weight in enumerate(weights) if weight != 0]
        first = slices[0]
        with tf.device(self.reduce_device):
            gathered = tf.IndexedSlices(
                tf.concat([slices[r].values for r in replicas], 0)
                * tf.constant(weights[replicas[0]], first.dtype),
                tf.concat([slices[r].indices for r in replicas], 0),
                first.dense_shape,
            )
        return [placement.on(device, gathered) for device in self.devices]

    def _send(self, tensors, device, flatten, cast, weight):
        """One replica's part of a pack, ready for the trip: weighted,
        compressed and, where that saves work, flattened into one buffer."""
        with tf.device(device):
            # A variable (a sync-on-read variable's component) is read here,
            # on its own device: the compiled sum on the reduce device cannot
            # read another device's resource.
            tensors = [tf.convert_to_tensor(t) for t in tensors]
            if not flatten:
                if cast is None:
                    return tensors
                return [cast.compress(packing.scaled(t, weight)) for t in tensors]
            return [packing.flatten(tensors, weight, cast, jit_compile=self._jit(device))]

    def _flatten(self, tensors):
        """Whether to flatten a pack of `tensors`."""
        if self.flatten_packs != "auto":
            return self.flatten_packs
        if any(devices_lib.device_type(d) != "CPU" for d in self.devices):
            return True
        # Two thousand 1 KiB tensors cost more in per-tensor work (an
        # argument, an output and a copy per device each) than one pass
        # over their 2 MiB does.
        sizes = [t.shape.num_elements() or 1 for t in tensors]
        mean_bytes = sum(sizes) * tensors[0].dtype.size / len(tensors)
        return len(tensors) > 1 and mean_bytes < packing.SMALL_TENSOR_BYTES

    def _jit(self, device):
        return packing.use_xla(self.jit_compile, device)
