"""`ReplicaTransport`: the patterns any strategy offers in replica context."""

import tensorflow as tf

from tf_agn.aggregation import scale_value

# The strategy's own cross-device ops pack what they reduce, so all of one
# dtype goes to them at once.
_ONE_PACK_PER_DTYPE = 2**62


class ReplicaTransport:
    """The collective patterns of a strategy's replica context, for the
    replica that calls them, under any strategy (its own cross-device ops
    do the work).

    Its one local replica is the calling one, on its own device (`devices`
    is `("",)`: the device scope the strategy set), and `rank(0)` is a
    scalar tensor.

    Args:
        context: the `tf.distribute.ReplicaContext` to communicate in.
        jit_compile: whether packing is XLA-compiled where it is done here.
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

    def all_reduce(self, packs, weights, cast=None):
        """This replica's pack, weighted, summed with every replica's by the
        strategy's `all_reduce`; see
        `tf_agn.transports.CollectiveTransport.all_reduce` (`weights[0]`
        may be a scalar tensor). Values travel exactly: `cast` must be None.
        """
        if cast is not None:
            raise NotImplementedError("ReplicaTransport does not compress yet.")
        ((pack,), (weight,)) = packs, weights
        weighted = [scale_value(tensor, weight) for tensor in pack]
        return [self.context.all_reduce(tf.distribute.ReduceOp.SUM, weighted)]

    def all_gather_slices(self, slices, weights):
        """This replica's `tf.IndexedSlices`, weighted, gathered with every
        replica's by the strategy's `all_reduce`, which concatenates them."""
        ((value,), (weight,)) = slices, weights
        (gathered,) = self.context.all_reduce(
            tf.distribute.ReduceOp.SUM, [scale_value(value, weight)]
        )
        return [gathered]
