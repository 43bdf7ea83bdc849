"""`aggregate`: combining this replica's values with the other replicas',
from inside a replica; what tf_agn's optimizers call instead of Keras'
all-reduce."""

import functools

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn.aggregation import AggregationMethod
from tf_agn.aggregation import scale_value
from tf_agn.combining import combine_replicas
from tf_agn.communication import payload_bytes
from tf_agn.cross_device_ops import AggregatingAllReduce
from tf_agn.transports import ReplicaTransport


def tf_agn_ops(strategy):
    """Returns `strategy`'s `AggregatingAllReduce`, or None if it has other ops."""
    ops = _compat.cross_device_ops(strategy.extended, required=False)
    return ops if isinstance(ops, AggregatingAllReduce) else None


def default_aggregation(strategy):
    """The method an optimizer without its own uses under `strategy`: the
    `aggregation` of its `AggregatingAllReduce`, or MEAN (stock Keras')."""
    ops = tf_agn_ops(strategy)
    return ops.aggregation if ops is not None else AggregationMethod.MEAN


def default_compression(strategy):
    """The compressor an optimizer without its own uses under `strategy`:
    the `compression` of its `AggregatingAllReduce`, or None."""
    ops = tf_agn_ops(strategy)
    return None if ops is None else ops.compressor


def gradient_scale():
    """What undoes Keras' loss scaling in replica context: Keras divides
    every replica's loss by the number of replicas n
    (`keras.src.losses.loss.scale_loss_for_distribution`), so each
    gradient arrives as g_r / n; multiplied by this, it is g_r."""
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def aggregate(
    values,
    method,
    value_scale=1,
    compressor=None,
    state=None,
    step=None,
    counter=None,
    when=None,
):
    """Combines this replica's values with the other replicas'.

    Call it in replica context (inside `strategy.run`; Keras' `train_step`
    is). Under tf_agn's `AggregatingAllReduce` the values travel by its
    transport, packed and compressed; under any other strategy by its own
    `all_reduce`, uncompressed.

    Args:
        values: this replica's tensors or `tf.IndexedSlices`; None entries
            pass through.
        method: a `tf_agn.AggregationMethod` or its name.
        value_scale: a Python number every value is multiplied by first
            (`gradient_scale()` for gradients; 1/k for the mean of k
            accumulated steps).
        compressor: None, or the `tf_agn.compression` compressor the values
            travel in (it needs tf_agn's `AggregatingAllReduce` wherever
            there are several replicas).
        state: for an `ErrorFeedbackCompressor`: one dict per value, from
            each name of its `state_spec` to this replica's variable, which
            is read, and assigned the new state.
        step: for an `ErrorFeedbackCompressor` with a `start_step`: the
            optimizer's step.
        counter: an optional `tf_agn.CommunicationCounter` to record in.
        when: None to always combine, or a scalar boolean tensor with the
            same value on every replica: the values are combined (and
            counted) only where it is true, and come back as given where
            it is false.

    Returns:
        The combined values, in a list laid out like `values`. With NONE,
        or a single replica, they are this replica's own, scaled.

    Raises:
        ValueError: for an unknown method, or a compressor under other
            cross-device ops.

    Example:

    ```python
    def step(gradients):
        return tf_agn.aggregate(gradients, "sum")

    summed = strategy.run(step, args=(gradients,))
    ```
    """
    method = AggregationMethod.parse(method)
    context = tf.distribute.get_replica_context()
    present = [i for i, v in enumerate(values) if v is not None]
    tensors = [values[i] for i in present]
    if context is None or context.num_replicas_in_sync == 1 or method is AggregationMethod.NONE:
        combined = _scaled(tensors, value_scale, when)
    else:
        ops = tf_agn_ops(context.strategy)
        _check_compressor(context.strategy, ops, compressor)
        if counter is not None:
            counter.record(
                payload_bytes(
                    tensors, compressor, step, context.num_replicas_in_sync,
                    None if ops is None else ops.bytes_per_pack,
                ),
                when,
            )
        if ops is None:
            combined = _aggregate_in_replica(context, method, tensors, value_scale, when)
        else:
            # All local replicas at once, in one `merge_call`. A stateful
            # compressor's state travels into it as this replica's values;
            # its new values are assigned to this replica's variables after.
            variables = states = None
            if compression.is_stateful(compressor):
                variables = [state[i] for i in present]
                states = tf.nest.map_structure(tf.convert_to_tensor, variables)
            step = None if states is None or step is None else tf.convert_to_tensor(step)
            combined, new_states = context.merge_call(
                functools.partial(_combine_merged, ops, method, value_scale, compressor),
                args=(when, step, tensors, states),
            )
            if variables is not None:
                for variable, value in zip(tf.nest.flatten(variables), tf.nest.flatten(new_states)):
                    variable.assign(value)
    result = list(values)
    for index, value in zip(present, combined):
        result[index] = value
    return result


def _combine_merged(ops, method, value_scale, compressor, strategy, when, step, values, states):
    """The cross-replica half of `aggregate` under `AggregatingAllReduce`.

    Returns:
        `(combined, new_states)`, as distributed values.
    """
    local = strategy.experimental_local_results
    per_replica = [list(replica) for replica in zip(*[local(v) for v in values])]
    per_replica_states = None
    if states is not None:
        per_replica_states = [
            tf.nest.pack_sequence_as(states, list(replica))
            for replica in zip(*[local(s) for s in tf.nest.flatten(states)])
        ]
    if step is not None:  # The same on every replica: replica 0's.
        step = local(step)[0]
    transport = ops.transport_for(values[0])
    combine = functools.partial(
        ops.combine_function(transport, method, value_scale, compressor),
        per_replica, states=per_replica_states, step=step,
    )
    if when is None:
        combined, new_states = combine()
    else:
        # Every replica enters the `merge_call` on every step, which is
        # allowed; the condition is taken here, in cross-replica context,
        # so that the transport's ops (any collective among them) run on
        # no replica, or on all.
        combined, new_states = tf.cond(
            local(when)[0], combine, lambda: (per_replica, per_replica_states)
        )
    if new_states is not None:
        flat = _regroup_each(zip(*[tf.nest.flatten(s) for s in new_states]))
        new_states = tf.nest.pack_sequence_as(states, flat)
    return _regroup_each(zip(*combined)), new_states


def _aggregate_in_replica(context, method, values, value_scale, when):
    """`aggregate` under other cross-device ops, through the strategy's own
    replica-context `all_reduce`."""
    if when is None:
        (combined,), _ = combine_replicas(ReplicaTransport(context), method, [values], value_scale)
        return combined

    # A strategy cannot synchronize replicas inside a `tf.cond` taken in
    # replica context; in cross-replica context, inside a `merge_call`, it
    # can start them again for the branch.
    def combine_if(strategy, when, values):
        local = strategy.experimental_local_results

        def communicate():
            combined = strategy.extended.call_for_each_replica(
                functools.partial(aggregate, method=method, value_scale=value_scale),
                args=(values,),
            )
            return [list(local(c)) for c in combined]

        parts = tf.cond(local(when)[0], communicate, lambda: [list(local(v)) for v in values])
        return _regroup_each(parts)

    return context.merge_call(combine_if, args=(when, values))


def _scaled(values, value_scale, when):
    """`values` times `value_scale`, where `when` (if given) is true."""
    if value_scale == 1:
        return list(values)
    scaled = [scale_value(v, value_scale) for v in values]
    if when is None:
        return scaled
    return tf.cond(when, lambda: scaled, lambda: list(values))


def _check_compressor(strategy, ops, compressor):
    if compressor is not None and ops is None:
        raise ValueError(
            f"compression={compression.name_of(compressor)!r} needs tf_agn's "
            "AggregatingAllReduce (tf_agn.strategies.mirrored or "
            "multi_worker_mirrored); this strategy's ops are "
            f"{type(_compat.cross_device_ops(strategy.extended, required=False)).__name__}."
        )


def _regroup_each(parts):
    """One distributed value per list of per-replica tensors."""
    return [_compat.regroup(tuple(replicas)) for replicas in parts]
