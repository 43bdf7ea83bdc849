"""The `Communicating` mixin: what every tf_agn optimizer that sends values
between replicas answers about what it sends."""

from tf_agn import _compat
from tf_agn.communication import communication_stats
from tf_agn.optimizers.loss_scaling import all_replicas_finite
from tf_agn.replica_aggregation import default_compression


class Communicating:
    """The compressor in force, the counts of what was sent, the finite
    agreement, and the error-feedback state of an optimizer that combines
    gradients (`Aggregating`) or commits (`WindowedOptimizer`).

    The class using it sets `compression` in its constructor and, when
    built, `_communication` (a `tf_agn.CommunicationCounter`) and
    `_compression_state` (a dict of compressor variables per trainable
    variable, as `add_compression_state` makes them).
    """

    @property
    def resolved_compression(self):
        """The compressor in force: `compression`, or the strategy's
        `tf_agn.AggregatingAllReduce`'s, if any."""
        if self.compression is not None:
            return self.compression
        return default_compression(_compat.creation_strategy(self))

    def communication_stats(self):
        """What this optimizer sent so far, as `tf_agn.CommunicationCounter`
        counts it.

        Returns:
            `{"all_reduce_calls": int, "reduce_scatter_calls": int,
            "all_gather_calls": int, "all_to_all_calls": int,
            "bytes_sent": int, "bytes_received": int}`, zeros before it
            is built.
        """
        return communication_stats(self)

    def all_replicas_finite(self, grads):
        """Whether every replica's `grads` are finite: a scalar boolean
        tensor, the same on every replica, which Keras's `LossScaleOptimizer`
        asks before a step (`tf_agn.optimizers.loss_scaling`)."""
        return all_replicas_finite(grads, self._communication)

    def error_feedback_state(self):
        """The compressor, and its state for each trainable variable that
        has any (a dict of variables, as its `state_spec` names them), or
        None without such state."""
        states = [state for state in self._compression_state if state]
        return (self.resolved_compression, states) if states else None
