"""Combining values across replicas from inside a replica, and reading each
replica's copy of the weights."""

import keras
import tensorflow as tf

from tf_agn.aggregation import AggregationMethod
from tf_agn.cross_device_ops import AggregatingAllReduce
from tf_agn.cross_device_ops import scale_value


def tf_agn_ops(strategy):
    """Returns `strategy`'s `AggregatingAllReduce`, or None if it has other ops."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return ops if isinstance(ops, AggregatingAllReduce) else None


def default_aggregation(strategy):
    """The method an optimizer without its own uses under `strategy`.

    It is the `aggregation` of the strategy's `AggregatingAllReduce` (see
    `tf_agn.strategies.mirrored`), and MEAN, stock Keras' behaviour, under
    any other strategy.
    """
    ops = tf_agn_ops(strategy)
    return ops.aggregation if ops is not None else AggregationMethod.MEAN


def aggregate_gradients(gradients, method):
    """Combines this replica's gradients with the other replicas'.

    Call it in replica context, from inside `strategy.run` (Keras'
    `train_step` is). Keras divides every replica's loss by the number of
    replicas n (`keras.src.losses.loss.scale_loss_for_distribution`), so each
    replica's gradient arrives as g_r / n. This function undoes that, so
    that MEAN is the mean of the per-replica gradients g_r and SUM their sum.

    Under tf_agn's `AggregatingAllReduce` the combination is one packed,
    compiled reduction. Under any other cross-device ops (for example
    `MultiWorkerMirroredStrategy`'s collectives or a `TPUStrategy`) it is
    `replica_context.all_reduce(SUM)` of weighted gradients; ONLY_FIRST_REPLICA
    weighs replica 0 by n and the others by 0.

    Args:
        gradients: this replica's gradients; None entries pass through.
        method: an `AggregationMethod` or its name.

    Returns:
        The combined gradients, in the same structure. With NONE they are this
        replica's own, and nothing is communicated.
    """
    method = AggregationMethod.parse(method)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(gradients)
    num_replicas = context.num_replicas_in_sync
    present = [i for i, g in enumerate(gradients) if g is not None]
    values = [gradients[i] for i in present]
    ops = tf_agn_ops(context.strategy)
    if method is AggregationMethod.NONE:
        combined = [scale_value(g, num_replicas) for g in values]
    elif ops is not None:
        combined = context.merge_call(
            lambda _, *vs: ops.aggregate(method, vs, value_scale=num_replicas),
            args=tuple(values),
        )
    else:
        weight = _replica_weight(method, context, num_replicas)
        combined = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [scale_value(g, weight) for g in values]
        )
    result = list(gradients)
    for index, value in zip(present, combined):
        result[index] = value
    return result


def _replica_weight(method, context, num_replicas):
    """This replica's weight in a SUM that realizes `method`, given the
    Keras 1/n loss scaling."""
    if method is AggregationMethod.SUM:
        return num_replicas
    if method is AggregationMethod.MEAN:
        return 1
    is_first = tf.equal(context.replica_id_in_sync_group, 0)
    return tf.cast(is_first, tf.float32) * num_replicas


def replica_weights(model_or_variables):
    """Returns every replica's copy of the weights, as numpy arrays.

    Under MirroredStrategy each weight has one copy per device. They are
    equal unless an optimizer with aggregation NONE let them drift apart.

    Args:
        model_or_variables: a Keras model (its `weights` are read) or a list
            of Keras or TF variables.

    Returns:
        A list with one entry per replica, each a list of numpy arrays in
        the order of the variables.
    """
    variables = getattr(model_or_variables, "weights", model_or_variables)
    per_variable = []
    for variable in variables:
        if isinstance(variable, keras.Variable):
            variable = variable.value
        copies = getattr(variable, "values", None) or (variable,)
        per_variable.append([copy.numpy() for copy in copies])
    return [list(arrays) for arrays in zip(*per_variable)]
