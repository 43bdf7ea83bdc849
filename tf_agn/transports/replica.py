"""`ReplicaTransport`: the patterns any strategy offers in replica context."""

import tensorflow as tf

from tf_agn.collectives.aggregation_method import scale_value
from tf_agn.collectives.aggregation_method import weighted

# The strategy's own cross-device ops pack what they reduce.
_ONE_PACK_PER_DTYPE = 2**62


class ReplicaTransport:
    """The collective patterns of a strategy's replica context, built from
    its `all_reduce` and `all_gather`, for the calling replica (`devices`
    is `("",)`, `rank(0)` a scalar tensor), under any strategy.

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

    def all_reduce(self, tensors, weights=None, cast=None):
        """As `CollectiveTransport.all_reduce`; `weights[0]` may be a tensor."""
        (replica_tensors,) = tensors
        weight = 1 if weights is None else weights[0]
        values = [scale_value(tensor, weight) for tensor in replica_tensors]
        if cast is not None:
            values = [cast.compress(tensor) for tensor in values]
        summed = self.context.all_reduce(tf.distribute.ReduceOp.SUM, values)
        if cast is not None:
            summed = [cast.decompress(t, like.dtype) for t, like in zip(summed, replica_tensors)]
        return [summed]

    def reduce_scatter(self, tensors, weights=None, sum_parts=None):
        """As `CollectiveTransport.reduce_scatter`, from an all-gather."""
        (rows,) = self.all_to_all(weighted(tensors, weights, self.devices))
        return [tf.reduce_sum(rows, 0) if sum_parts is None else sum_parts(rows)]

    def all_gather(self, tensors):
        """Every replica's tensor, concatenated in replica order."""
        return [self.context.all_gather(tensors[0], axis=0)]

    def all_to_all(self, tensors):
        """As `CollectiveTransport.all_to_all`, from an all-gather."""
        gathered = self.context.all_gather(tensors[0][None], axis=0)
        return [tf.gather(gathered, self.rank(0), axis=1)]

    def all_gather_slices(self, slices, weights):
        """Every replica's `tf.IndexedSlices`, weighted: the strategy's
        `all_reduce` concatenates them."""
        ((value,), (weight,)) = slices, weights
        (gathered,) = self.context.all_reduce(
            tf.distribute.ReduceOp.SUM, [scale_value(value, weight)]
        )
        return [gathered]
