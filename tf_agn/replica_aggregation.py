"""`aggregate`: combining this replica's values with the other replicas',
from inside a replica; what tf_agn's optimizers call instead of Keras'
all-reduce."""

import functools
import warnings

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn.aggregation import AggregationMethod
from tf_agn.aggregation import replica_weights
from tf_agn.aggregation import scale_value
from tf_agn.combining import combine_replicas
from tf_agn.communication import gathers
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
    transport, all local replicas at once; under any other strategy
    (`TPUStrategy` among them) each replica sends its own through the
    strategy's replica-context `all_reduce` and `all_gather`
    (`tf_agn.transports.ReplicaTransport`). Either way they are compressed
    by `compressor`.

    Args:
        values: this replica's tensors or `tf.IndexedSlices`; None entries
            pass through.
        method: a `tf_agn.AggregationMethod` or its name.
        value_scale: a Python number every value is multiplied by first
            (`gradient_scale()` for gradients; 1/k for the mean of k
            accumulated steps).
        compressor: None, or the `tf_agn.compression` compressor the values
            travel in.
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
        ValueError: for an unknown method.

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
        # Under other cross-device ops, each replica by itself.
        transport = ReplicaTransport(context) if ops is None else None
        if counter is not None:
            count = functools.partial(
                payload_bytes, tensors, compressor, step, context.num_replicas_in_sync,
                (ops or transport).bytes_per_pack,
            )
            counter.record("all_reduce", count(), when, count(gathered=ops is None))
        if ops is None:
            _warn_if_gathering_costs_more(context, compressor, tensors, transport)
        variables = None
        if compression.is_stateful(compressor):
            variables = [state[i] for i in present]
        else:
            step = None
        if ops is None:
            combined = _aggregate_in_replica(
                transport, method, tensors, value_scale, compressor, variables, step, when
            )
        else:
            # All local replicas at once, in one `merge_call`. A stateful
            # compressor's state travels into it as this replica's values;
            # its new values are assigned to this replica's variables after.
            states = _read(variables)
            step = None if step is None else tf.convert_to_tensor(step)
            combined, new_states = context.merge_call(
                functools.partial(_combine_merged, ops, method, value_scale, compressor),
                args=(when, step, tensors, states),
            )
            _assign(variables, new_states)
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


def reduce_scatter(tensors, method, value_scale=1, when=None):
    """This replica's row of every replica's tensors, combined with `method`.

    Call it in replica context under tf_agn's `AggregatingAllReduce`
    (`tf_agn.strategies.mirrored`, `multi_worker_mirrored`): what sharded
    optimizer state (`shard_optimizer_state=True`) sends its gradients by.
    With a ring it moves half an all-reduce's volume.

    Args:
        tensors: this replica's tensors, each with a first dimension of n,
            the replicas in sync: row r is for replica r.
        method: SUM or MEAN, or their names.
        value_scale: a Python number every value is multiplied by first.
        when: None, or a scalar boolean tensor with the same value on every
            replica: where it is false nothing travels, and the results
            are not the combination (see `aggregate`).

    Returns:
        For each tensor, this replica's row of the combination.

    Raises:
        ValueError: for another method, or under other cross-device ops.
    """
    method = AggregationMethod.parse(method)
    if method not in (AggregationMethod.SUM, AggregationMethod.MEAN):
        raise ValueError(f"reduce_scatter combines by SUM or MEAN; received {method.name}.")
    return _pattern(
        "reduce_scatter", tensors, lambda t: scale_value(t[0], value_scale), when,
        method, value_scale,
    )


def all_gather(tensors, when=None):
    """Every replica's tensors, concatenated along their first axis in
    replica order, as `reduce_scatter` asks (its counterpart).

    Args:
        tensors: this replica's tensors, of the same shape on every replica.
        when: as `reduce_scatter` takes it.

    Returns:
        For each tensor, the concatenation.

    Raises:
        ValueError: under other cross-device ops.
    """
    return _pattern("all_gather", tensors, lambda t: t, when)


def all_to_all(tensors, when=None):
    """Row j of this replica's tensors to replica j: for each tensor, the n
    rows the replicas sent this replica, in replica order (what int8
    reduce-scatters by).

    Args:
        tensors: this replica's tensors, each with a first dimension of n.
        when: as `reduce_scatter` takes it.

    Returns:
        For each tensor, a tensor of its shape: row j from replica j.

    Raises:
        ValueError: under other cross-device ops.
    """
    return _pattern("all_to_all", tensors, lambda t: t, when)


def _pattern(pattern, tensors, alone, when, method=None, value_scale=1):
    """`pattern` of `tensors` on the transport of the strategy's ops, in one
    `merge_call`; `alone(tensor)` where this replica is the only one."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return [alone(t) for t in tensors]
    ops = tf_agn_ops(context.strategy)
    if ops is None:
        raise ValueError(
            f"{pattern} needs tf_agn's AggregatingAllReduce (tf_agn.strategies."
            f"mirrored or multi_worker_mirrored); this strategy is "
            f"{type(context.strategy).__name__}."
        )
    return context.merge_call(
        functools.partial(_pattern_merged, ops, pattern, method, value_scale),
        args=(when, tensors),
    )


def _pattern_merged(ops, pattern, method, value_scale, strategy, when, tensors):
    """The cross-replica half of `_pattern`."""
    local = strategy.experimental_local_results
    per_replica = [list(replica) for replica in zip(*[local(t) for t in tensors])]
    transport = ops.transport_for(tensors[0])
    launch = functools.partial(
        transport.eager((pattern, method, value_scale), functools.partial(
            _launch_each, transport, pattern, method, value_scale
        )),
        per_replica,
    )
    if when is None:
        results = launch()
    else:
        # As `_combine_merged`: the condition in cross-replica context. Where
        # it is false, tensors of the results' shapes stand in.
        n = transport.size

        def stand_in():
            return [
                [_stand_in(pattern, t, n) for t in replica]
                for replica in per_replica
            ]

        results = tf.cond(local(when)[0], launch, stand_in)
    return _regroup_each(zip(*results))


def _stand_in(pattern, tensor, n):
    """A tensor of the shape `pattern` gives for `tensor` among n replicas."""
    if pattern == "reduce_scatter":
        return tensor[0]
    return tensor if pattern == "all_to_all" else tf.concat([tensor] * n, 0)


def _launch_each(transport, pattern, method, value_scale, per_replica):
    """One `pattern` per position of the local replicas' lists, weighted
    for `method` before a reduce-scatter."""
    results = [[] for _ in per_replica]
    for position in range(len(per_replica[0])):
        tensors = [replica[position] for replica in per_replica]
        if pattern == "reduce_scatter":
            weights = replica_weights(method, tensors[0].dtype, transport, value_scale)
            for r, (device, weight) in enumerate(zip(transport.devices, weights)):
                if weight != 1:
                    with tf.device(device):
                        tensors[r] = scale_value(tensors[r], weight)
            combined = transport.reduce_scatter(tensors)
        elif pattern == "all_to_all":
            combined = transport.all_to_all(tensors)
        else:
            combined = transport.all_gather(tensors)
        for replica, tensor in zip(results, combined):
            replica.append(tensor)
    return results


def _aggregate_in_replica(
    transport, method, values, value_scale, compressor, variables, step, when
):
    """`aggregate` under other cross-device ops, on this replica's own
    `ReplicaTransport`."""
    if when is None:
        states = None if variables is None else [_read(variables)]
        (combined,), new_states = combine_replicas(
            transport, method, [values], value_scale, compressor, states, step
        )
        _assign(variables, None if new_states is None else new_states[0])
        return combined

    # A strategy cannot synchronize replicas inside a `tf.cond` taken in
    # replica context; in cross-replica context, inside a `merge_call`, it
    # can start them again for the branch.
    def combine_if(strategy, when, values):
        local = strategy.experimental_local_results

        def communicate():
            combined = strategy.extended.call_for_each_replica(
                functools.partial(
                    aggregate, method=method, value_scale=value_scale,
                    compressor=compressor, state=variables, step=step,
                ),
                args=(values,),
            )
            return [list(local(c)) for c in combined]

        parts = tf.cond(local(when)[0], communicate, lambda: [list(local(v)) for v in values])
        return _regroup_each(parts)

    return transport.context.merge_call(combine_if, args=(when, values))


def _warn_if_gathering_costs_more(context, compressor, values, transport):
    """Warns, while tracing, where `compressor` under a strategy without
    tf_agn's ops receives more than an uncompressed ring all-reduce would:
    its reduce-scatter is an all-gather, so each of n replicas receives
    n - 1 payloads, where a float32 ring receives 2 (n - 1) / n values'
    worth (int8: from about 8 replicas)."""
    if not compression.is_stateful(compressor) or not gathers(compressor):
        return
    shapes = [
        v.shape for v in values
        if not isinstance(v, tf.IndexedSlices) and compressor.acts_on(v.dtype)
    ]
    n = transport.size
    payload = compressor.payload_bytes(shapes, n, transport.bytes_per_pack)
    float32 = 4 * sum(shape.num_elements() for shape in shapes)
    if shapes and n * payload > 2 * float32:
        warnings.warn(
            f"compression={compressor.name!r} under "
            f"{type(context.strategy).__name__}, which has no tf_agn ops: each of "
            f"{n} replicas receives {n - 1} compressed payloads ({(n - 1) * payload} "
            f"bytes), more than an uncompressed float32 ring all-reduce "
            f"({2 * (n - 1) * float32 // n} bytes). Use fp16, bf16 or PowerSGD "
            "here, or tf_agn.strategies.mirrored / multi_worker_mirrored.",
            stacklevel=2,
        )


def _read(variables):
    """This replica's values of `variables` (any structure), or None."""
    return None if variables is None else tf.nest.map_structure(tf.convert_to_tensor, variables)


def _assign(variables, values):
    """Assigns each of `values` to its variable, where there are any."""
    if variables is not None:
        for variable, value in zip(tf.nest.flatten(variables), tf.nest.flatten(values)):
            variable.assign(value)


def _scaled(values, value_scale, when):
    """`values` times `value_scale`, where `when` (if given) is true."""
    if value_scale == 1:
        return list(values)
    scaled = [scale_value(v, value_scale) for v in values]
    if when is None:
        return scaled
    return tf.cond(when, lambda: scaled, lambda: list(values))


def _regroup_each(parts):
    """One distributed value per list of per-replica tensors."""
    return [_compat.regroup(tuple(replicas)) for replicas in parts]
