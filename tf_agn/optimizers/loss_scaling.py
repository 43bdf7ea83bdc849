"""Loss scaling under strategies: every replica agrees whether a step is
finite.

`install` makes Keras' `LossScaleOptimizer` ask a tf_agn optimizer's
`all_replicas_finite` (one float32 all-reduce per step): a non-finite
gradient on any replica, or on the wire, skips the step everywhere and
halves the loss scale.
"""

import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.finite import all_finite
from tf_agn.collectives.routing import aggregate


def all_replicas_finite(grads, counter=None):
    """Whether every replica's `grads` are finite; call it on every replica.

    `counter`, a `tf_agn.CommunicationCounter`, records the all-reduce.
    """
    non_finite = tf.cast(tf.logical_not(all_finite(grads)), tf.float32)
    (replicas_non_finite,) = aggregate([non_finite], AggregationMethod.SUM, counter=counter)
    return tf.equal(replicas_non_finite, 0.0)


def loss_scaled(values, scale, inverse=False):
    """Dense `values` multiplied (or with `inverse`, divided) by `scale`."""
    if scale is None:
        return list(values)
    function = tf.divide if inverse else tf.multiply
    return [
        v if v is None or isinstance(v, tf.IndexedSlices) else function(v, tf.cast(scale, v.dtype))
        for v in values
    ]


def not_counted(optimizer, finite):
    """Takes a step skipped where `finite` is false off `optimizer`'s count."""
    # Not in a `tf.cond`: assigning the mirrored count is a `merge_call`.
    _compat.micro_step(optimizer).assign_sub(tf.cast(tf.logical_not(finite), tf.int64))


def _check_finite(loss_scale_optimizer, grads):
    """`LossScaleOptimizer.check_finite`, asking its inner optimizer first."""
    # Keras' check is per replica and the step follows replica 0's answer,
    # so another replica's overflow reaches every weight copy.
    inner = loss_scale_optimizer.inner_optimizer
    if hasattr(inner, "all_replicas_finite"):
        return inner.all_replicas_finite(grads)
    return _compat.stock_loss_scale_method("check_finite")(loss_scale_optimizer, grads)


def _handle_finite_grads(loss_scale_optimizer, grads, trainable_variables):
    """`LossScaleOptimizer._stateful_handle_finite_grads`, also lowering the
    scale where the combined gradients overflowed on the wire."""
    stock = _compat.stock_loss_scale_method("_stateful_handle_finite_grads")
    inner = loss_scale_optimizer.inner_optimizer
    if not hasattr(inner, "apply_loss_scaled"):
        return stock(loss_scale_optimizer, grads, trainable_variables)
    scale = tf.convert_to_tensor(loss_scale_optimizer.dynamic_scale)
    finite = inner.apply_loss_scaled(
        lambda: stock(loss_scale_optimizer, grads, trainable_variables), scale
    )

    def lower():
        # From this step's scale: the stock method may have just grown it.
        loss_scale_optimizer.step_counter.assign(0)
        loss_scale_optimizer.dynamic_scale.assign(scale * 0.5)

    tf.cond(finite, lambda: None, lower)


def install():
    """Makes Keras' `LossScaleOptimizer` agree across replicas whether a step
    is finite. Idempotent."""
    # Patched, not subclassed: `model.compile` creates it by itself.
    _compat.replace_loss_scale_methods(
        check_finite=_check_finite, _stateful_handle_finite_grads=_handle_finite_grads
    )
