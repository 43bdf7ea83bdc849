"""Loss scaling under strategies: every replica agrees whether a step is
finite.

`install` (run when `tf_agn.optimizers` is imported) makes Keras'
`LossScaleOptimizer`, which `compile` puts around the optimizer under mixed
precision, ask a tf_agn optimizer through its `all_replicas_finite`: a
non-finite gradient on any replica then skips the step on every replica and
halves the loss scale, as Keras does without a strategy. It costs one
all-reduce of one float32 per step (micro-steps included), counted in the
optimizer's `communication_stats`. A step whose gradients become non-finite
only when combined (a float16 sum that overflows on the wire) is skipped
too, and halves the scale. With fp16 or bf16 compression the gradients
travel multiplied by the loss scale, and are divided by it once summed.
Other optimizers are unaffected.
"""

import tensorflow as tf

from tf_agn import _compat
from tf_agn.aggregation import AggregationMethod
from tf_agn.finite import all_finite
from tf_agn.replica_aggregation import aggregate


def all_replicas_finite(grads, counter=None):
    """Whether every replica's `grads` are finite; call it on every replica.

    Args:
        grads: this replica's gradients: tensors, `tf.IndexedSlices` or None.
        counter: an optional `tf_agn.CommunicationCounter` to record the
            all-reduce in.

    Returns:
        A scalar boolean tensor, the same on every replica: True if no
        replica's gradients hold an inf or NaN. Outside replica context, or
        with one replica, it is this process's own answer.
    """
    non_finite = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
    # Through the strategy's cross-device ops (tf_agn's transports where the
    # strategy has them).
    (replicas_non_finite,) = aggregate([non_finite], AggregationMethod.SUM, counter=counter)
    return tf.equal(replicas_non_finite, 0.0)


def loss_scaled(values, scale, inverse=False):
    """Dense `values` multiplied (or with `inverse`, divided) by `scale`, a
    tensor or None (none scaled)."""
    if scale is None:
        return list(values)
    function = tf.divide if inverse else tf.multiply
    return [
        v if v is None or isinstance(v, tf.IndexedSlices) else function(v, tf.cast(scale, v.dtype))
        for v in values
    ]


def not_counted(optimizer, finite):
    """Takes a step skipped where `finite` is false off `optimizer`'s count,
    which Keras adds to after `_backend_apply_gradients`."""
    # Unconditionally: the count is mirrored, and its assignment a
    # `merge_call`, which TensorFlow refuses inside a `tf.cond`.
    _compat.micro_step(optimizer).assign_sub(tf.cast(tf.logical_not(finite), tf.int64))


def _check_finite(loss_scale_optimizer, grads):
    """`LossScaleOptimizer.check_finite`, asking its inner optimizer first."""
    # Keras' own check runs on each replica's gradients before any
    # all-reduce, and under MirroredStrategy the step follows replica 0's
    # answer: when only another replica overflows, every replica applies,
    # the all-reduce carries its inf into every copy of the weights, and the
    # scale is not lowered. tf_agn's optimizers all-reduce the count of
    # replicas with a non-finite gradient instead.
    inner = loss_scale_optimizer.inner_optimizer
    if hasattr(inner, "all_replicas_finite"):
        return inner.all_replicas_finite(grads)
    return _compat.stock_loss_scale_method("check_finite")(loss_scale_optimizer, grads)


def _handle_finite_grads(loss_scale_optimizer, grads, trainable_variables):
    """`LossScaleOptimizer._stateful_handle_finite_grads`, which also lowers
    the scale where the inner optimizer skipped the step because the
    replicas' combined gradients were not finite (an overflow on the wire)."""
    stock = _compat.stock_loss_scale_method("_stateful_handle_finite_grads")
    inner = loss_scale_optimizer.inner_optimizer
    if not hasattr(inner, "apply_loss_scaled"):
        return stock(loss_scale_optimizer, grads, trainable_variables)
    scale = tf.convert_to_tensor(loss_scale_optimizer.dynamic_scale)
    finite = inner.apply_loss_scaled(
        lambda: stock(loss_scale_optimizer, grads, trainable_variables), scale
    )

    def lower():
        # What Keras does for a non-finite gradient, from this step's scale
        # (the stock method may have just grown it).
        loss_scale_optimizer.step_counter.assign(0)
        loss_scale_optimizer.dynamic_scale.assign(scale * 0.5)

    tf.cond(finite, lambda: None, lower)


def install():
    """Makes Keras' `LossScaleOptimizer` agree across replicas whether a step
    is finite, when it wraps an optimizer that can tell. Idempotent."""
    # The stock class is patched, not subclassed: `model.compile` creates it
    # by itself.
    _compat.replace_loss_scale_methods(
        check_finite=_check_finite, _stateful_handle_finite_grads=_handle_finite_grads
    )
