"""Combining values across replicas from inside a replica: what tf_agn's
optimizers call instead of Keras' all-reduce."""

import tensorflow as tf

from tf_agn import _compat
from tf_agn.aggregation import AggregationMethod
from tf_agn.cross_device_ops import AggregatingAllReduce
from tf_agn.cross_device_ops import scale_value


def tf_agn_ops(strategy):
    """Returns `strategy`'s `AggregatingAllReduce`, or None if it has other ops."""
    ops = _compat.cross_device_ops(strategy.extended, required=False)
    return ops if isinstance(ops, AggregatingAllReduce) else None


def default_aggregation(strategy):
    """The method an optimizer without its own uses under `strategy`.

    It is the `aggregation` of the strategy's `AggregatingAllReduce` (see
    `tf_agn.strategies.mirrored`), and MEAN, stock Keras' behaviour, under
    any other strategy.
    """
    ops = tf_agn_ops(strategy)
    return ops.aggregation if ops is not None else AggregationMethod.MEAN


def aggregate_gradients(gradients, method, counter=None, value_scale=1, when=None):
    """Combines this replica's gradients with the other replicas'.

    Call it in replica context, from inside `strategy.run` (Keras'
    `train_step` is). Keras divides every replica's loss by the number of
    replicas n (`keras.src.losses.loss.scale_loss_for_distribution`), so each
    replica's gradient arrives as g_r / n. This function undoes that, so
    that MEAN is the mean of the per-replica gradients g_r and SUM their sum.

    Args:
        gradients: this replica's gradients; None entries pass through.
        method: an `AggregationMethod` or its name.
        counter: an optional `tf_agn.CommunicationCounter` to record in.
        value_scale: a further Python number to multiply by, inside the
            same compiled pass (1/k for the mean of k accumulated steps).
        when: an optional scalar boolean tensor; see `aggregate`.

    Returns:
        The combined gradients, as `aggregate` returns them.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = 1 if context is None else context.num_replicas_in_sync
    return aggregate(gradients, method, num_replicas * value_scale, counter, when)


def aggregate(values, method, value_scale=1, counter=None, when=None):
    """Combines this replica's values with the other replicas'.

    Call it in replica context. Every value is multiplied by `value_scale`
    first. Under tf_agn's `AggregatingAllReduce` the combination is one
    packed, compiled reduction, with the scale folded in. Under any other
    cross-device ops (for example `MultiWorkerMirroredStrategy`'s
    collectives) it is an all-reduce (SUM) of weighted values;
    ONLY_FIRST_REPLICA weighs replica 0 by `value_scale` and the others by 0.

    Args:
        values: this replica's tensors or `tf.IndexedSlices`; None entries
            pass through.
        method: an `AggregationMethod` or its name.
        value_scale: a Python number every value is multiplied by.
        counter: an optional `tf_agn.CommunicationCounter` to record in.
        when: None to always combine, or a scalar boolean tensor with the
            same value on every replica: the values are combined (and
            counted) only where it is true, and come back as given where it
            is false. tf.distribute cannot synchronize replicas inside a
            `tf.cond` taken in replica context, so the condition is taken
            here, across replicas, around the communication alone.

    Returns:
        The combined values, in the same structure. With NONE they are this
        replica's own (scaled), and nothing is communicated.
    """
    method = AggregationMethod.parse(method)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        if value_scale == 1:
            return list(values)
        scaled = [v if v is None else scale_value(v, value_scale) for v in values]
        if when is None:
            return scaled
        return _select(when, scaled, values)
    present = [i for i, v in enumerate(values) if v is not None]
    tensors = [values[i] for i in present]
    ops = tf_agn_ops(context.strategy)
    if counter is not None:
        counter.record(tensors, method, ops, when)
    if method is AggregationMethod.NONE:
        combined = [scale_value(v, value_scale) for v in tensors]
        if when is not None:
            combined = _select(when, combined, tensors)
    elif when is not None:
        combined = _combine_when(when, method, context, tensors, value_scale, ops)
    elif ops is not None:
        combined = context.merge_call(
            lambda _, *vs: ops.aggregate(method, vs, value_scale=value_scale),
            args=tuple(tensors),
        )
    else:
        weight = _replica_weight(method, context, value_scale)
        combined = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [scale_value(v, weight) for v in tensors]
        )
    result = list(values)
    for index, value in zip(present, combined):
        result[index] = value
    return result


def _select(when, if_true, if_false):
    """`if_true` where `when`, else `if_false` (lists of tensors)."""
    return tf.cond(when, lambda: list(if_true), lambda: list(if_false))


def _combine_when(when, method, context, tensors, value_scale, ops):
    """`aggregate`'s combination, run only where `when` is true.

    Every replica enters one `merge_call` on every step, which is allowed;
    the `tf.cond` is taken inside it, in cross-replica context, so that the
    reduction's ops (and any collective among them) run on no replica, or
    on all.
    """
    count = len(tensors)
    if ops is None:
        weight = _replica_weight(method, context, value_scale)
        args = [scale_value(v, weight) for v in tensors] + tensors
    else:
        args = tensors

    def combine(strategy, when, *args):
        local = strategy.experimental_local_results
        to_combine, given = args[:count], args[-count:]

        def communicate():
            if ops is not None:
                combined = ops.aggregate(method, to_combine, value_scale=value_scale)
            else:
                combined = strategy.extended.batch_reduce_to(
                    tf.distribute.ReduceOp.SUM, [(v, v) for v in to_combine]
                )
            return [list(local(c)) for c in combined]

        def keep():
            return [list(local(v)) for v in given]

        parts = tf.cond(local(when)[0], communicate, keep)
        return [_compat.regroup(tuple(replicas)) for replicas in parts]

    return context.merge_call(combine, args=(when, *args))


def _replica_weight(method, context, value_scale):
    """This replica's weight in a SUM that realizes `method`."""
    num_replicas = context.num_replicas_in_sync
    if method is AggregationMethod.SUM:
        return value_scale
    if method is AggregationMethod.MEAN:
        return value_scale / num_replicas
    is_first = tf.equal(context.replica_id_in_sync_group, 0)
    return tf.cast(is_first, tf.float32) * value_scale
