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
from tf_agn.aggregation import AggregationMethod
from tf_agn.finite import all_finite
from tf_agn.optimizers.loss_scaling import loss_scaled
from tf_agn.optimizers.sharded_step import apply_sharded
from tf_agn.replica_aggregation import aggregate
from tf_agn.replica_aggregation import keras_loss_divisor

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


def accumulate_and_apply(optimizer, grads, variables, apply_accumulated):
    """One micro-step of gradient accumulation, in replica context.

    `apply_accumulated(grads, variables)` applies the combined sum locally
    (unused where the state is sharded: `apply_sharded` does all).
    """
    # Keras' own accumulation calls `merge_call` inside a `tf.cond`, which
    # tf.distribute rejects (keras-team/keras#20582).
    steps = optimizer.gradient_accumulation_steps
    is_last = tf.equal((_compat.micro_step(optimizer) + 1) % steps, 0)
    accumulators = [_compat.accumulator_of(optimizer, v) for v in variables]
    accumulated = [
        tf.convert_to_tensor(g) + a.value for g, a in zip(grads, accumulators)
    ]
    scale = 1 / steps if optimizer.accumulation_reduction == "mean" else 1

    def accumulate():
        for accumulator, total in zip(accumulators, accumulated):
            accumulator.assign(total)

    def reset():
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))

    if optimizer.shards is not None:
        apply_sharded(optimizer, accumulated, variables, scale, is_last)
        tf.cond(is_last, reset, accumulate)
        return
    wire_scale = optimizer.wire_loss_scale()
    combined = aggregate(
        loss_scaled(accumulated, wire_scale),
        optimizer.aggregation,
        value_scale=keras_loss_divisor() * scale,
        counter=optimizer._communication,
        when=is_last,
        **optimizer.compression_arguments(variables),
    )
    combined = loss_scaled(combined, wire_scale, inverse=True)
    # An accumulated sum that overflowed anywhere, or on the wire, is skipped whole.
    finite = all_finite(combined)
    optimizer._combined_finite = tf.logical_or(tf.logical_not(is_last), finite)

    def apply():
        tf.cond(finite, lambda: apply_accumulated(combined, variables), lambda: None)
        reset()

    tf.cond(is_last, apply, accumulate)
