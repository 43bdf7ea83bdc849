"""`LocalTransport`: the patterns among the replicas of one process, each
sum taken on one reduce device."""

import tensorflow as tf

from tf_agn.collectives import packing
from tf_agn.collectives import placement
from tf_agn.collectives.aggregation_method import weighted
from tf_agn.utils import devices as devices_lib


class LocalTransport:
    """The collective patterns among one process's replicas.

    Each pack is summed on the reduce device in one XLA-compiled call and
    sent back to every replica.

    Args:
        devices: the replicas' devices, in replica order.
        reduce_device: where sums are taken; by default the first replica's.
        flatten_packs: "auto", True or False: whether each replica's part
            of a pack travels as one flat buffer. "auto": where transfers
            are copies (not logical CPUs), or for many small tensors.
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

    def all_reduce(self, tensors, weights=None, cast=None):
        """As `CollectiveTransport.all_reduce`; the replicas that add
        something share one weight, and the sum is in at least float32."""
        weights = weights or [1] * len(tensors)
        replicas = [r for r, weight in enumerate(weights) if weight != 0]
        scale = weights[replicas[0]]
        # Only replica 0's tensors travel: no copy.
        device = self.devices[0] if len(replicas) < self.size else self.reduce_device
        like = tensors[0]
        dtype = like[0].dtype
        flatten = self._flatten(like)
        # A cast travels weighted, as on every transport; other values are
        # weighted after the sum.
        sent, summed = (1, scale) if cast is None else (scale, 1)
        parts = [self._send(tensors[r], self.devices[r], flatten, cast, sent) for r in replicas]
        with tf.device(device):
            reduced = packing.weighted_sum_fn(self._jit(device))(parts, summed, dtype, cast)
        if not flatten:
            return [[placement.on(d, t) for t in reduced] for d in self.devices]
        # Each replica splits its own copy: no copy per tensor.
        results = []
        for device in self.devices:
            with tf.device(device):
                results.append(
                    packing.unflatten(reduced[0], like, jit_compile=self._jit(device))
                )
        return results

    def reduce_scatter(self, tensors, weights=None, sum_parts=None):
        """As `CollectiveTransport.reduce_scatter`."""
        reduced = []
        received = self.all_to_all(weighted(tensors, weights, self.devices))
        for device, rows in zip(self.devices, received):
            with tf.device(device):
                reduced.append(tf.reduce_sum(rows, 0) if sum_parts is None else sum_parts(rows))
        return reduced

    def all_gather(self, tensors):
        """Every replica's tensor, concatenated in replica order."""
        gathered = []
        for device in self.devices:
            with tf.device(device):
                gathered.append(tf.concat(tensors, 0))
        return gathered

    def all_to_all(self, tensors):
        """Row j of each tensor to replica j, in replica order."""
        received = []
        for j, device in enumerate(self.devices):
            with tf.device(device):
                received.append(tf.stack([t[j] for t in tensors]))
        return received

    def all_gather_rows(self, tensors):
        """As `CollectiveTransport.all_gather_rows`."""
        with tf.device(self.reduce_device):
            gathered = [tf.concat(list(position), 0) for position in zip(*tensors)]
        return [[placement.on(device, t) for t in gathered] for device in self.devices]

    def all_gather_slices(self, slices, weights):
        """As `CollectiveTransport.all_gather_slices`, on the reduce device."""
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
        """One replica's part of a pack: weighted, compressed, maybe flattened."""
        with tf.device(device):
            # Read variables here: the compiled sum cannot read another
            # device's resource.
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
        # Many small tensors cost more per tensor than one pass over them all.
        sizes = [t.shape.num_elements() or 1 for t in tensors]
        mean_bytes = sum(sizes) * tensors[0].dtype.size / len(tensors)
        return len(tensors) > 1 and mean_bytes < packing.SMALL_TENSOR_BYTES

    def _jit(self, device):
        return packing.use_xla(self.jit_compile, device)
