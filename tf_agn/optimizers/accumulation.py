"""Gradient accumulation on every replica: k micro-steps, one exchange.

With `gradient_accumulation_steps=k` each replica sums its micro-step
gradients locally and the k-th micro-step combines and applies their sum,
their mean (`accumulation_reduction="mean"`) or sum ("sum").

```python
model.compile(
    optimizer=tf_agn.optimizers.Adam(gradient_accumulation_steps=4),
    loss="mse",
)
```
"""

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives.aggregation_method import AggregationMethod

ACCUMULATION_REDUCTIONS = ("mean", "sum")


def check_accumulation_steps(steps):
    """`steps` (None or an int >= 1), with 1 as None, Keras' spelling."""
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "`gradient_accumulation_steps` must be None or an int >= 1 (the "
            f"micro-steps per applied step); received {steps!r}."
        )
    return None if steps == 1 else steps


def check_accumulation_reduction(reduction):
    """`reduction` ("mean" or "sum"), lower-cased."""
    name = reduction.lower() if isinstance(reduction, str) else reduction
    if name not in ACCUMULATION_REDUCTIONS:
        raise ValueError(
            f"Unknown accumulation_reduction {reduction!r}. Allowed: "
            f"{', '.join(ACCUMULATION_REDUCTIONS)}."
        )
    return name


def add_accumulator(optimizer, reference_variable, method):
    """A replica-local, zero-initialized accumulator for `reference_variable`."""
    # Read across replicas (as when saved) the accumulators give their mean,
    # all the combined sum depends on, so a resume between micro-steps is exact.
    if method in (AggregationMethod.SUM, AggregationMethod.MEAN):
        aggregation = "mean"
    else:
        aggregation = "only_first_replica"
    # Keras' own name, so the variables line up with Keras' optimizer's.
    name = _compat.reference_variable_name(
        reference_variable, _compat.KERAS_ACCUMULATOR_NAME
    )
    with keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(
            initializer="zeros",
            shape=reference_variable.shape,
            dtype=reference_variable.dtype,
            trainable=False,
            aggregation=aggregation,
            synchronization="on_read",
            name=name,
        )
    _compat.track_variable(optimizer, variable)
    return variable


class Accumulation:
    """Sums each replica's micro-step gradients in its accumulators, so that
    every `steps`-th micro-step applies their sum or mean.

    Args:
        optimizer: the optimizer whose accumulators (`add_accumulator`) and
            micro-step count are used.
        steps: the micro-steps per applied step, >= 2.
        reduction: "mean" or "sum" (`check_accumulation_reduction`).

    Example:

    ```python
    micro_step = accumulation.micro_step(grads, variables)
    # ... combine and apply `micro_step.sums` where `micro_step.is_last` ...
    tf.cond(micro_step.is_last, micro_step.reset, micro_step.store)
    ```
    """

    def __init__(self, optimizer, steps, reduction):
        self.optimizer = optimizer
        self.steps = steps
        # The Python number the summed gradients are multiplied by.
        self.scale = 1 / steps if reduction == "mean" else 1

    def micro_step(self, grads, variables):
        """This micro-step's `MicroStep` for `grads` of `variables`."""
        # Keras' own accumulation calls `merge_call` inside a `tf.cond`, which
        # tf.distribute rejects (keras-team/keras#20582).
        is_last = tf.equal((_compat.micro_step(self.optimizer) + 1) % self.steps, 0)
        accumulators = [_compat.accumulator_of(self.optimizer, v) for v in variables]
        return MicroStep(accumulators, grads, is_last)


class MicroStep:
    """One micro-step: the accumulated `sums` and whether it `is_last`."""

    def __init__(self, accumulators, grads, is_last):
        self.accumulators = accumulators
        self.sums = [tf.convert_to_tensor(g) + a.value for g, a in zip(grads, accumulators)]
        self.is_last = is_last

    def store(self):
        """Keeps the sums for the next micro-step."""
        for accumulator, total in zip(self.accumulators, self.sums):
            accumulator.assign(total)

    def reset(self):
        """Zeroes the accumulators, after the last micro-step."""
        for accumulator in self.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
