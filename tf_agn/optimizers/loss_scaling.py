"""Loss scaling under strategies: every replica agrees whether a step is
finite.

Under mixed precision, `keras.Model.compile` wraps the optimizer in Keras'
`LossScaleOptimizer`, which skips a step and halves the loss scale when a
gradient is not finite. It decides from `check_finite(grads)`, called on
each replica's own gradients before any all-reduce; under a
`MirroredStrategy` the step follows replica 0's answer. When only another
replica overflows, every replica applies, the all-reduce carries that
replica's inf into every copy of the weights, and the scale is not lowered.

tf_agn makes the decision an agreed one: the stock `LossScaleOptimizer`'s
`check_finite` asks the optimizer it wraps, when that optimizer has an
`all_replicas_finite(grads)` method (tf_agn's do), and the answer is the
all-reduced count of replicas holding a non-finite gradient. So a non-finite
gradient on any replica skips the step on every replica, and the scale drops
(halved, its growth counter reset) exactly as Keras does without a strategy.
The stock class is patched once, at import (`install`), because
`model.compile` creates it by itself; with any other inner optimizer it
behaves as before.

The agreement costs one all-reduce of one float32 per step, micro-step
included under `gradient_accumulation_steps`, through the strategy's
cross-device ops (tf_agn's transports when the strategy has them), and it is
counted in the optimizer's `communication_stats`.
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
    (replicas_non_finite,) = aggregate([non_finite], AggregationMethod.SUM, counter=counter)
    return tf.equal(replicas_non_finite, 0.0)


def _check_finite(loss_scale_optimizer, grads):
    """`LossScaleOptimizer.check_finite`, asking its inner optimizer first."""
    inner = loss_scale_optimizer.inner_optimizer
    if hasattr(inner, "all_replicas_finite"):
        return inner.all_replicas_finite(grads)
    return _compat.stock_loss_scale_check_finite(loss_scale_optimizer, grads)


def install():
    """Makes Keras' `LossScaleOptimizer` agree across replicas whether a step
    is finite, when it wraps an optimizer that can tell (see the module
    docstring). Idempotent."""
    _compat.replace_loss_scale_check_finite(_check_finite)
