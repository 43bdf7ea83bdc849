"""`ReplicaTransport`: the patterns any strategy offers in replica context."""

import tensorflow as tf

from tf_agn.aggregation import scale_value

# The strategy's own cross-device ops pack what they reduce, so all of one
# dtype goes to them at once.
_ONE_PACK_PER_DTYPE = 2**62


class ReplicaTransport:
    """The collective patterns of a strategy's replica context, for the
    replica that calls them, under any strategy: `TPUStrategy`, or a
    `MirroredStrategy` without tf_agn's cross-device ops.

    Every pattern is built from the two that every replica context offers,
    `all_reduce` (SUM) and `all_gather`, and runs inside the replica
    function, so that XLA can compile it with the step. Its one local
    replica is the calling one, on the device the strategy set (`devices`
    is `("",)`), and `rank(0)` is a scalar tensor.

    Args:
        context: the `tf.distribute.ReplicaContext` to communicate in.
        jit_compile: whether compressors compile their arithmetic with XLA.
    """

    def __init__(self, context, jit_compile=True):
        self.context = context
        self.devices = ("",)
        self.size = context.num_replicas_in_sync
        self.bytes_per_pack = _ONE_PACK_PER_DTYPE
        self.jit_compile = jit_compile

    def rank(self, replica):
        del replica  # Always 0: this replica.
        return self.context.replica_id_in_sync_group

    def all_reduce(self, packs, weights=None, cast=None):
        """This replica's pack, weighted, summed with every replica's by the
        strategy's `all_reduce`; see
        `tf_agn.transports.CollectiveTransport.all_reduce` (`weights[0]`
        may be a scalar tensor). With `cast`, the sum is taken in its wire
        dtype, as NCCL and TensorFlow's collectives take it."""
        (pack,) = packs
        weight = 1 if weights is None else weights[0]
        values = [scale_value(tensor, weight) for tensor in pack]
        if cast is not None:
            values = [cast.compress(tensor) for tensor in values]
        summed = self.context.all_reduce(tf.distribute.ReduceOp.SUM, values)
        if cast is not None:
            summed = [cast.decompress(t, like.dtype) for t, like in zip(summed, pack)]
        return [summed]

    def reduce_scatter(self, tensors, sum_parts=None):
        """Row `rank` of every replica's tensor, summed; see
        `tf_agn.transports.CollectiveTransport.reduce_scatter`. Built from
        an all-gather, each replica receives every replica's whole tensor."""
        (rows,) = self.all_to_all(tensors)
        return [tf.reduce_sum(rows, 0) if sum_parts is None else sum_parts(rows)]

    def all_gather(self, tensors):
        """Every replica's tensor, concatenated along the first axis in
        replica order."""
        return [self.context.all_gather(tensors[0], axis=0)]

    def all_to_all(self, tensors):
        """Row `rank` of every replica's tensor (whose first dimension is
        `size`), in replica order. Built from an all-gather: each replica
        receives every replica's whole tensor."""
        gathered = self.context.all_gather(tensors[0][None], axis=0)
        return [tf.gather(gathered, self.rank(0), axis=1)]

    def all_gather_slices(self, slices, weights):
        """This replica's `tf.IndexedSlices`, weighted, gathered with every
        replica's by the strategy's `all_reduce`, which concatenates them."""
        ((value,), (weight,)) = slices, weights
        (gathered,) = self.context.all_reduce(
            tf.distribute.ReduceOp.SUM, [scale_value(value, weight)]
        )
        return [gathered]
