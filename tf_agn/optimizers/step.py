"""`Step`: one step of a tf_agn optimizer, from this replica's gradients to
its updated weights.

An `Aggregating` optimizer chooses its step when it is built: a `Step`
(`ShardedStep` where its state is sharded), with an `Accumulation` for
`gradient_accumulation_steps`. Keras's `apply` reaches it through the
optimizer; the step combines the gradients across replicas, then decays,
clips and updates, so that clipping sees what is applied.
"""

import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives.finite import all_finite
from tf_agn.collectives.routing import aggregate
from tf_agn.collectives.routing import keras_loss_divisor
from tf_agn.optimizers.compressor_state import check_gradients
from tf_agn.optimizers.loss_scaling import loss_scaled
from tf_agn.optimizers.loss_scaling import not_counted


class Step:
    """Combines whole gradients across replicas, then updates every
    replica's copy of the weights with them.

    Args:
        optimizer: the built `tf_agn.optimizers.Aggregating` optimizer whose
            update rule, weight decay and clipping the step runs.
        method: the `AggregationMethod` in force.
        compressor: the optimizer's compressor, or None.
        compressor_state: one dict per built variable, from a state's name
            to its variable (`add_compressor_state`).
        counter: the `tf_agn.CommunicationCounter` traffic is recorded in.
        accumulation: an `Accumulation`, or None to apply every call.

    Example:

    ```python
    step = Step(optimizer, AggregationMethod.SUM, None, [{}] * 2, counter)
    step.apply(grads, variables)  # in replica context, variables as built
    ```
    """

    def __init__(self, optimizer, method, compressor, compressor_state, counter, accumulation=None):
        self.optimizer = optimizer
        self.method = method
        self.compressor = compressor
        self.compressor_state = compressor_state
        self.counter = counter
        self.accumulation = accumulation
        # Set while a `LossScaleOptimizer` steps (`loss_scaled`).
        self.loss_scale = None
        self.finite = None

    def apply(self, grads, variables):
        """Combines `grads` and updates `variables` (in the order built)."""
        if self.accumulation is None:
            check_gradients(grads, variables, self.states_of(variables), self.optimizer.sparse_gradients)
            combined = self.combined(grads, variables)
            if not self.checks_finite():
                self.update(combined, variables)
                return
            self.finite = all_finite(combined)
            tf.cond(self.finite, lambda: self.update(combined, variables), lambda: None)
            not_counted(self.optimizer, self.finite)
            return
        micro_step = self.accumulation.micro_step(grads, variables)
        combined = self.combined(
            micro_step.sums, variables, self.accumulation.scale, micro_step.is_last
        )
        # An accumulated sum that overflowed anywhere, or on the wire, is skipped whole.
        finite = all_finite(combined)
        self.finite = tf.logical_or(tf.logical_not(micro_step.is_last), finite)

        def apply():
            tf.cond(finite, lambda: self.update(combined, variables), lambda: None)
            micro_step.reset()

        tf.cond(micro_step.is_last, apply, micro_step.store)

    def combined(self, grads, variables, value_scale=1, when=None):
        """Every replica's `grads` combined, Keras's 1/n loss scaling undone."""
        wire_scale = self.wire_loss_scale()
        combined = aggregate(
            loss_scaled(grads, wire_scale),
            self.method,
            value_scale=keras_loss_divisor() * value_scale,
            compressor=self.compressor,
            state=self.states_of(variables),
            step=self.optimizer.iterations,
            counter=self.counter,
            when=when,
        )
        return loss_scaled(combined, wire_scale, inverse=True)

    def update(self, grads, variables):
        """Decays `variables`, clips the combined `grads` and updates."""
        optimizer = self.optimizer
        _compat.apply_weight_decay(optimizer, variables)
        clipped = _compat.clip_gradients_in_place(optimizer, grads)
        _compat.update_step(optimizer, clipped, variables, optimizer.learning_rate)

    def states_of(self, variables):
        """The compressor state of `variables`, in their order."""
        return [self.compressor_state[_compat.variable_index(self.optimizer, v)] for v in variables]

    def checks_finite(self):
        """Whether a step whose combined gradients are not finite is skipped:
        with a cast (it can overflow on the wire) or under loss scaling."""
        return self.loss_scale is not None or self._travels_loss_scaled()

    def wire_loss_scale(self):
        """The loss scale a cast sends the gradients multiplied by, or None."""
        return self.loss_scale if self._travels_loss_scaled() else None

    def _travels_loss_scaled(self):
        return self.compressor is not None and self.compressor.travels_loss_scaled

    def loss_scaled(self, apply, loss_scale):
        """Runs `apply()`, a `LossScaleOptimizer`'s step, under `loss_scale`;
        returns whether the combined gradients were finite (a scalar
        boolean tensor, the same on every replica)."""
        self.loss_scale, self.finite = loss_scale, tf.constant(True)
        try:
            apply()
            return self.finite
        finally:
            self.loss_scale = None
