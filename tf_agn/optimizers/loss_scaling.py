"""Loss scaling under strategies: every replica agrees whether a step is
finite.

`install` (run when `tf_agn.optimizers` is imported) makes Keras'
`LossScaleOptimizer`, which `compile` puts around the optimizer under mixed
precision, ask a tf_agn optimizer through its `all_replicas_finite`: a
non-finite gradient on any replica then skips the step on every replica and
halves the loss scale, as Keras does without a strategy. It costs one
all-reduce of one float32 per step (micro-steps included), counted in the
optimizer's `communication_stats`. Other optimizers are unaffected.
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


def install():
    """Makes Keras' `LossScaleOptimizer` agree across replicas whether a step
    is finite, when it wraps an optimizer that can tell. Idempotent."""
    # The stock class is patched, not subclassed: `model.compile` creates it
    # by itself.
    _compat.replace_loss_scale_methods(check_finite=_check_finite)
