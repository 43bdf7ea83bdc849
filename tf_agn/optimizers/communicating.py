"""The `Communicating` mixin: what an optimizer sends between replicas."""

from tf_agn import _compat
from tf_agn.collectives.communication import communication_stats
from tf_agn.collectives.cross_device_ops import default_compression
from tf_agn.optimizers.loss_scaling import all_replicas_finite


class Communicating:
    """Compressor, traffic counts and finite agreement of an optimizer.

    Its class sets `compression` and, when built, `_communication` (a
    `tf_agn.CommunicationCounter`) and `_compression_state`, which its step
    uses.
    """

    @property
    def compressor(self):
        """`compression`, or the strategy's `tf_agn.AggregatingAllReduce`'s."""
        if self.compression is not None:
            return self.compression
        return default_compression(_compat.creation_strategy(self))

    def communication_stats(self):
        """What this optimizer sent so far, as `tf_agn.CommunicationCounter`
        counts it (zeros before it is built)."""
        return communication_stats(self)

    def all_replicas_finite(self, grads):
        """Whether every replica's `grads` are finite (a boolean tensor)."""
        return all_replicas_finite(grads, self._communication)

    def compressor_state(self):
        """(compressor, its per-variable state dicts), or None without state."""
        states = [state for state in self._compression_state if state]
        return (self.compressor, states) if states else None
