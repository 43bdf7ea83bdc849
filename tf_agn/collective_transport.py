"""The collective transport, one replica's part: pack, all-reduce, unpack.

Every replica scales, compresses and concatenates its own part of each
pack in one XLA-compiled call on its own device; one TensorFlow collective
all-reduce per pack (`tf_agn.collective`) sums the buffers of all replicas
of all workers; every replica splits the result in one XLA-compiled call.
`AggregatingAllReduce` launches every local replica's part and explains
when it takes this transport.
"""

import tensorflow as tf

from tf_agn import compression
from tf_agn import packing
from tf_agn.aggregation import contributes
from tf_agn.aggregation import method_scale


def combine_replica(
    method, replica, tensors, group, value_scale, options, compressor, jit_compile
):
    """Replica `replica`'s part of combining `tensors` across `group`.

    Packs travel, and are summed, compressed by `compressor` where it
    acts on their dtype.

    Args:
        method: an `AggregationMethod` (anything but NONE).
        replica: this replica's index among `group`'s local devices.
        tensors: this replica's tensors and `tf.IndexedSlices`.
        group: the `tf_agn.collective.CollectiveGroup` of every replica.
        value_scale: a Python float every value is multiplied by.
        options: `CommunicationOptions`, every field resolved.
        compressor: a `tf_agn.compression.Compressor`, or None.
        jit_compile: whether to compile the packing with XLA.

    Returns:
        The combined tensors, on this replica's device.
    """
    device = group.devices[replica]
    jit = packing.use_xla(jit_compile, device)
    sparse, packs = packing.split_packs(tensors, options.bytes_per_pack)
    results = [None] * len(tensors)
    sends = contributes(method, group.first_replica + replica)
    for index in sparse:
        slices = tensors[index]
        scale = method_scale(method, slices.dtype, group.size, value_scale)
        with tf.device(device):
            rows = slices.values * tf.constant(scale, slices.dtype)
            indices = slices.indices
            if not sends:
                rows, indices = rows[:0], indices[:0]
            results[index] = group.all_gather_slices(
                replica,
                tf.IndexedSlices(rows, indices, slices.dense_shape),
                options,
            )
    for pack in packs:
        like = [tensors[i] for i in pack]
        dtype = like[0].dtype
        scale = method_scale(method, dtype, group.size, value_scale)
        wire_dtype = dtype if compressor is None else compressor.wire_dtype(dtype)
        pack_compressor = compression.acting_on(compressor, dtype)
        with tf.device(device):
            if not sends:
                # Replica 0's pack travels as an all-reduce to which the
                # others add zeros: TensorFlow's broadcast ops take no
                # ordering token, and unordered collectives can deadlock
                # NCCL. x + 0 is exact, inf and NaN included.
                flat = tf.zeros([_num_elements(like)], wire_dtype)
            else:
                flat = packing.flatten(like, scale, pack_compressor, jit_compile=jit)
            flat = group.all_reduce(replica, flat, options)
            combined = packing.unflatten(flat, like, pack_compressor, jit_compile=jit)
        for index, tensor in zip(pack, combined):
            results[index] = tensor
    return results


class CollectiveCommunicator:
    """The collectives a stateful compressor uses
    (`tf_agn.compression.ErrorFeedbackCompressor`), over `group`: each
    takes one tensor per local replica and returns one per local replica.

    Args:
        group: the `tf_agn.collective.CollectiveGroup` of every replica.
        options: `CommunicationOptions`, every field resolved.
    """

    def __init__(self, group, options):
        self.group = group
        self.options = options
        self.devices = group.devices
        self.size = group.size

    def rank(self, replica):
        """Local replica `replica`'s index among all replicas."""
        return self.group.first_replica + replica

    def all_reduce(self, tensors):
        return self._each(self.group.all_reduce, tensors)

    def all_to_all(self, tensors):
        return self._each(self.group.all_to_all, tensors)

    def all_gather(self, tensors):
        return self._each(self.group.all_gather, tensors)

    def _each(self, collective, tensors):
        return [
            collective(replica, tensor, self.options)
            for replica, tensor in enumerate(tensors)
        ]


def gather_along(group, replica, tensor, axis, options):
    """Replica `replica`'s all-gather of `tensor` along `axis`: every
    replica's slices, which may differ in length along `axis`."""
    with tf.device(group.devices[replica]):
        rank = tensor.shape.rank
        axis = axis % rank
        perm = [axis] + [d for d in range(rank) if d != axis]
        rows = tf.transpose(tensor, perm) if axis else tensor
    (gathered,) = group.all_gather_rows(replica, [rows], options)
    if not axis:
        return gathered
    with tf.device(group.devices[replica]):
        return tf.transpose(gathered, [perm.index(d) for d in range(rank)])


def _num_elements(tensors):
    """How many elements `tensors` hold together, as a scalar tensor."""
    return tf.add_n([tf.size(t) for t in tensors])
