"""Combining values across replicas from inside a replica: what tf_agn's
optimizers call instead of Keras' all-reduce."""

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn.aggregation import AggregationMethod
from tf_agn.aggregation import replica_weight
from tf_agn.aggregation import scale_value
from tf_agn.communication import payload_bytes
from tf_agn.cross_device_ops import AggregatingAllReduce


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


def default_compression(strategy):
    """The compressor an optimizer without its own uses under `strategy`:
    the `compression` of its `AggregatingAllReduce`, or None."""
    ops = tf_agn_ops(strategy)
    return None if ops is None else ops.compressor


def aggregate_gradients(gradients, method, counter=None, value_scale=1, when=None, **compression):
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
        **compression: `compressor`, `state` and `step`, as `aggregate`
            takes them.

    Returns:
        The combined gradients, as `aggregate` returns them.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = 1 if context is None else context.num_replicas_in_sync
    return aggregate(
        gradients, method, num_replicas * value_scale, counter, when, **compression
    )


def aggregate(
    values,
    method,
    value_scale=1,
    counter=None,
    when=None,
    compressor=None,
    state=None,
    step=None,
):
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
        compressor: None, or the `tf_agn.compression` compressor the values
            travel in; it needs tf_agn's `AggregatingAllReduce` wherever
            there are several replicas.
        state: for an `ErrorFeedbackCompressor`: one dict per value, from
            each name of its `state_spec` to this replica's variable,
            which is read, and assigned the new state.
        step: for an `ErrorFeedbackCompressor` with a `start_step`: the
            optimizer's step.

    Returns:
        The combined values, in the same structure. With NONE they are this
        replica's own (scaled), and nothing is communicated.

    Raises:
        ValueError: for a compressor under other cross-device ops.
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
    if compressor is not None and ops is None:
        raise ValueError(
            f"compression={compression.name_of(compressor)!r} needs tf_agn's "
            "AggregatingAllReduce (tf_agn.strategies.mirrored or "
            "multi_worker_mirrored); this strategy's ops are "
            f"{type(_compat.cross_device_ops(context.strategy.extended, required=False)).__name__}."
        )
    if counter is not None and method is not AggregationMethod.NONE:
        counter.record(
            payload_bytes(
                tensors,
                compressor,
                step,
                context.num_replicas_in_sync,
                # Only a stateful compressor's packs depend on it, and any
                # compressor needs tf_agn's ops.
                None if ops is None else ops.bytes_per_pack,
            ),
            when,
        )
    if method is AggregationMethod.NONE:
        combined = [scale_value(v, value_scale) for v in tensors]
        if when is not None:
            combined = _select(when, combined, tensors)
    elif ops is None:
        combined = _all_reduce_weighted(method, context, tensors, value_scale, when)
    else:
        variables = None if state is None else [state[i] for i in present]
        combined = _aggregate_with_ops(
            ops, method, context, tensors, value_scale, when, compressor, variables, step
        )
    result = list(values)
    for index, value in zip(present, combined):
        result[index] = value
    return result


def _select(when, if_true, if_false):
    """`if_true` where `when`, else `if_false` (lists of tensors)."""
    return tf.cond(when, lambda: list(if_true), lambda: list(if_false))


def _aggregate_with_ops(
    ops, method, context, tensors, value_scale, when, compressor, variables, step
):
    """`aggregate` through `ops.aggregate`, in one `merge_call`.

    With `when`, every replica still enters the `merge_call` on every step,
    which is allowed; the `tf.cond` is taken inside it, in cross-replica
    context, so that the reduction's ops (and any collective among them)
    run on no replica, or on all. A stateful compressor's state travels
    into the `merge_call` as this replica's values, and its new values are
    assigned to this replica's variables after.
    """
    stateful = compression.is_stateful(compressor)
    state_values = []
    if stateful:
        state_values = tf.nest.map_structure(tf.convert_to_tensor, variables)
        step = None if step is None else tf.convert_to_tensor(step)
    count = len(tensors)

    def combine(strategy, when, step, *args):
        local = strategy.experimental_local_results
        to_combine = list(args[:count])
        states = tf.nest.pack_sequence_as(state_values, list(args[count:]))

        def communicate():
            results = ops.aggregate(
                method, to_combine, value_scale, compressor=compressor,
                **({"states": states, "step": step} if stateful else {}),
            )
            combined, new_states = results if stateful else (results, states)
            return [list(local(c)) for c in combined], [
                list(local(s)) for s in tf.nest.flatten(new_states)
            ]

        def keep():
            return [list(local(v)) for v in to_combine], [
                list(local(s)) for s in tf.nest.flatten(states)
            ]

        if when is None:
            parts, state_parts = communicate()
        else:
            parts, state_parts = tf.cond(local(when)[0], communicate, keep)
        return _regroup_each(parts), _regroup_each(state_parts)

    combined, new_states = context.merge_call(
        combine, args=(when, step, *tensors, *tf.nest.flatten(state_values))
    )
    if stateful:
        for variable, value in zip(tf.nest.flatten(variables), new_states):
            variable.assign(value)
    return combined


def _all_reduce_weighted(method, context, tensors, value_scale, when):
    """`aggregate` under other cross-device ops: an all-reduce (SUM) of
    each replica's values weighted by `replica_weight`."""
    weight = replica_weight(
        method, context.num_replicas_in_sync, context.replica_id_in_sync_group, value_scale
    )
    weighted = [scale_value(v, weight) for v in tensors]
    if when is None:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, weighted)

    def combine(strategy, when, *args):
        local = strategy.experimental_local_results
        count = len(tensors)
        to_combine, given = args[:count], args[count:]

        def communicate():
            combined = strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, v) for v in to_combine]
            )
            return [list(local(c)) for c in combined]

        def keep():
            return [list(local(v)) for v in given]

        return _regroup_each(tf.cond(local(when)[0], communicate, keep))

    return context.merge_call(combine, args=(when, *weighted, *tensors))


def _regroup_each(parts):
    """One distributed value per list of per-replica tensors."""
    return [_compat.regroup(tuple(replicas)) for replicas in parts]
