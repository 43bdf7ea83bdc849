"""Gradient accumulation on every replica: k micro-steps, one exchange.

With `gradient_accumulation_steps=k`, a tf_agn optimizer adds each
micro-step's gradient to this replica's accumulators, sending nothing, and
on the k-th combines the window across replicas once (1/k of the bytes) and
applies it; a window that is not finite is skipped. The window is the mean
of the k micro-steps (`accumulation_reduction="mean"`, the default: with
MEAN, one step on a k times larger batch) or their sum ("sum": divide the
learning rate by k for the same step size).

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
from tf_agn.aggregation import AggregationMethod
from tf_agn.finite import all_finite
from tf_agn.optimizers.loss_scaling import loss_scaled
from tf_agn.optimizers.sharded_step import apply_sharded
from tf_agn.replica_aggregation import aggregate
from tf_agn.replica_aggregation import gradient_scale

ACCUMULATION_REDUCTIONS = ("mean", "sum")


def check_accumulation_steps(steps):
    """Validates `gradient_accumulation_steps`.

    Args:
        steps: None, or an int >= 1.

    Returns:
        `steps`, with 1 (apply every step) given as None, Keras' spelling.

    Raises:
        ValueError: if `steps` is not None nor an int >= 1.
    """
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "`gradient_accumulation_steps` must be None or an int >= 1 (the "
            f"micro-steps per applied step); received {steps!r}."
        )
    return None if steps == 1 else steps


def check_accumulation_reduction(reduction):
    """Validates `accumulation_reduction`.

    Returns:
        `reduction`, lower-cased.

    Raises:
        ValueError: if it is not "mean" or "sum".
    """
    name = reduction.lower() if isinstance(reduction, str) else reduction
    if name not in ACCUMULATION_REDUCTIONS:
        raise ValueError(
            f"Unknown accumulation_reduction {reduction!r}. Allowed: "
            f"{', '.join(ACCUMULATION_REDUCTIONS)}."
        )
    return name


def add_accumulator(optimizer, reference_variable, method):
    """A replica-local, zero-initialized accumulator for `reference_variable`.

    Args:
        optimizer: the Keras optimizer that owns it.
        reference_variable: the model variable it accumulates for.
        method: the optimizer's `AggregationMethod`.

    Returns:
        A `keras.Variable`.
    """
    # Each replica sums its own micro-batches (`on_read`). Read across
    # replicas, as when a model is saved, they give the mean (replica 0's
    # under ONLY_FIRST_REPLICA and NONE), which is all the combined window
    # depends on: training resumed from a `.keras` file mid-window applies
    # the same step as uninterrupted training.
    if method in (AggregationMethod.SUM, AggregationMethod.MEAN):
        aggregation = "mean"
    else:
        aggregation = "only_first_replica"
    # Named as Keras names its own, so that the optimizer's variables line
    # up with those of Keras' optimizer of the same class.
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


def accumulate_and_apply(optimizer, grads, variables, apply_window):
    """One micro-step of gradient accumulation, in replica context.

    Args:
        optimizer: a `tf_agn.optimizers.Aggregating` optimizer with
            `gradient_accumulation_steps` set.
        grads: this replica's gradients for `variables`.
        variables: the trainable variables.
        apply_window: `apply_window(grads, variables)` decays, clips and
            updates with the combined window gradient, locally (where the
            optimizer's state is sharded, `apply_sharded` does all).
    """
    # Keras' own accumulation fails under a strategy (keras-team/keras#20582):
    # it all-reduces every micro-step and updates the accumulators through
    # `merge_call` inside a `tf.cond`, which tf.distribute does not allow.
    # Here everything runs in replica context and only the window travels.
    steps = optimizer.gradient_accumulation_steps
    is_last = tf.equal((_compat.micro_step(optimizer) + 1) % steps, 0)
    accumulators = [_compat.accumulator_of(optimizer, v) for v in variables]
    window = [
        tf.convert_to_tensor(g) + a.value for g, a in zip(grads, accumulators)
    ]
    scale = 1 / steps if optimizer.accumulation_reduction == "mean" else 1

    def accumulate():
        for accumulator, total in zip(accumulators, window):
            accumulator.assign(total)

    def reset():
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))

    if optimizer.sharded_state is not None:
        apply_sharded(optimizer, window, variables, scale, is_last)
        tf.cond(is_last, reset, accumulate)
        return
    # Sends only on the k-th micro-step (`when`).
    wire_scale = optimizer.wire_loss_scale()
    combined = aggregate(
        loss_scaled(window, wire_scale),
        optimizer.resolved_aggregation,
        value_scale=gradient_scale() * scale,
        counter=optimizer._communication,
        when=is_last,
        **optimizer.compression_arguments(variables),
    )
    combined = loss_scaled(combined, wire_scale, inverse=True)
    # Not finite: some replica's gradient overflowed in some micro-step, or
    # their sum on the wire; the whole window is skipped. (Under mixed
    # precision Keras's LossScaleOptimizer already drops a micro-step that
    # overflows on some replica, see `tf_agn.optimizers.loss_scaling`.)
    finite = all_finite(combined)
    optimizer._combined_finite = tf.logical_or(tf.logical_not(is_last), finite)

    def apply():
        tf.cond(finite, lambda: apply_window(combined, variables), lambda: None)
        reset()

    tf.cond(is_last, apply, accumulate)
