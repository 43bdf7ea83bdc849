"""How values reach a transport's collective patterns: `aggregate`,
`reduce_scatter`, `all_gather` and `all_to_all` from replica context, and
`combine_replicas`, which routes every local replica's values at once."""

import functools
import warnings

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
# cross_device_ops imports this module too: both import the other by module.
from tf_agn.collectives import cross_device_ops
from tf_agn.collectives import packing
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.aggregation_method import scale_value
from tf_agn.collectives.aggregation_method import sum_weights
from tf_agn.collectives.communication import gathers
from tf_agn.collectives.communication import payload_bytes
from tf_agn.transports import ReplicaTransport


def keras_loss_divisor():
    """The factor that undoes Keras's division of each replica's loss by n
    (`scale_loss_for_distribution`)."""
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

    Call it in replica context (inside `strategy.run`). Under tf_agn's
    `AggregatingAllReduce` the values travel by its transport; under any
    other strategy by the replica context's own collectives.

    Args:
        values: this replica's tensors or `tf.IndexedSlices`; None entries
            pass through.
        method: a `tf_agn.AggregationMethod` or its name.
        value_scale: a Python number every value is multiplied by first.
        compressor: None, or the `tf_agn.compression` compressor the values
            travel in.
        state: for a compressor with state: one dict per value from its
            `state_spec` names to this replica's variables.
        step: for a compressor with a `start_step`: the optimizer's step.
        counter: an optional `tf_agn.CommunicationCounter` to record in.
        when: None, or a scalar boolean tensor alike on every replica:
            where false, the values come back as given, uncounted.

    Returns:
        The combined values, laid out like `values`; with NONE or one
        replica, this replica's own, scaled.

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
        ops = cross_device_ops.tf_agn_ops(context.strategy)
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
        if state is not None and tf.nest.flatten(state):
            variables = [state[i] for i in present]
        if compressor is None or not compressor.start_step:
            step = None
        if ops is None:
            combined = _aggregate_in_replica(
                transport, method, tensors, value_scale, compressor, variables, step, when
            )
        else:
            # All local replicas in one `merge_call`, state in and out.
            states = _read(variables)
            step = None if step is None else tf.convert_to_tensor(step)
            combined, new_states = context.merge_call(
                functools.partial(_merged, ops, "all_reduce", method, value_scale, compressor),
                args=(when, step, tensors, states),
            )
            _assign(variables, new_states)
    result = list(values)
    for index, value in zip(present, combined):
        result[index] = value
    return result


def _merged(ops, pattern, method, value_scale, compressor, strategy, when, step, values, states):
    """The cross-replica half of `aggregate` and the other patterns:
    `(combined, new_states)`."""
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
        ops.combine_function(transport, method, value_scale, compressor, pattern),
        per_replica, states=per_replica_states, step=step,
    )
    if when is None:
        combined, new_states = combine()
    else:
        # Taken in cross-replica context, so collectives run on all replicas
        # or none; where false, tensors of the shapes `pattern` gives.
        def stand_in():
            combined = [[_stand_in(pattern, t, transport.size) for t in replica] for replica in per_replica]
            return combined, per_replica_states

        combined, new_states = tf.cond(local(when)[0], combine, stand_in)
    if new_states is not None:
        flat = _regroup_each(zip(*[tf.nest.flatten(s) for s in new_states]))
        new_states = tf.nest.pack_sequence_as(states, flat)
    return _regroup_each(zip(*combined)), new_states


def reduce_scatter(
    tensors, method, value_scale=1, when=None, compressor=None, states=None, step=None
):
    """This replica's row of the SUM or MEAN of every replica's `tensors`,
    in replica context under `AggregatingAllReduce`.

    Args:
        tensors: this replica's tensors, each of n rows (the replicas in
            sync), row r for replica r.
        method: SUM or MEAN, or its name.
        value_scale: a Python number every tensor is multiplied by first.
        when: None, or a scalar boolean tensor alike on every replica:
            where false, nothing travels and the rows are placeholders.
        compressor: None, or the compressor the tensors travel in; its
            `patterns` carry "reduce_scatter".
        states: for a compressor with state: one dict per tensor from its
            `state_spec` names to this replica's state tensors.
        step: for a compressor with a `start_step`: the optimizer's step.

    Returns:
        `(rows, new_states)`: this replica's row of each tensor, and its
        `states` after sending them (as given with one replica).

    Raises:
        ValueError: for a method other than SUM or MEAN, or a strategy
            without tf_agn's ops.

    Example:

    ```python
    def step(rows):  # in strategy.run; rows: [n, length]
        (mine,), _ = tf_agn.collectives.routing.reduce_scatter([rows], "sum")
        return mine
    ```
    """
    method = AggregationMethod.parse(method)
    if method not in (AggregationMethod.SUM, AggregationMethod.MEAN):
        raise ValueError(f"reduce_scatter combines by SUM or MEAN; received {method.name}.")
    step = None if compressor is None or not compressor.start_step else tf.convert_to_tensor(step)
    return _pattern(
        "reduce_scatter", tensors, lambda t: scale_value(t[0], value_scale), when,
        method, value_scale, compressor, states, step,
    )


def all_gather(tensors, when=None):
    """Every replica's `tensors` concatenated in replica order
    (`reduce_scatter`'s counterpart)."""
    return _pattern("all_gather", tensors, lambda t: t, when)[0]


def all_to_all(tensors, when=None):
    """Sends row j of each tensor to replica j; returns row j from replica j."""
    return _pattern("all_to_all", tensors, lambda t: t, when)[0]


def _pattern(
    pattern, tensors, alone, when, method=None, value_scale=1, compressor=None, states=None,
    step=None,
):
    """`(results, new_states)` of `pattern` in one `merge_call`, or
    `alone(t)` of each tensor with one replica."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return [alone(t) for t in tensors], states
    ops = cross_device_ops.tf_agn_ops(context.strategy)
    if ops is None:
        raise ValueError(
            f"{pattern} needs tf_agn's AggregatingAllReduce (tf_agn.strategies."
            f"mirrored or multi_worker_mirrored); this strategy is "
            f"{type(context.strategy).__name__}."
        )
    return context.merge_call(
        functools.partial(_merged, ops, pattern, method, value_scale, compressor),
        args=(when, step, tensors, states),
    )


def _stand_in(pattern, tensor, n):
    """A tensor of the shape `pattern` gives for `tensor`."""
    if pattern == "reduce_scatter":
        return tensor[0]
    return tf.concat([tensor] * n, 0) if pattern == "all_gather" else tensor


def _aggregate_in_replica(
    transport, method, values, value_scale, compressor, variables, step, when
):
    """`aggregate` on this replica's own `ReplicaTransport`."""
    if when is None:
        states = None if variables is None else [_read(variables)]
        (combined,), new_states = combine_replicas(
            transport, method, [values], value_scale, compressor, states, step
        )
        _assign(variables, None if new_states is None else new_states[0])
        return combined

    # Replicas cannot synchronize inside a replica-context `tf.cond`; inside
    # a `merge_call` the strategy can start them again for the branch.
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
    """Warns where all-gathering n - 1 compressed payloads costs more than a
    float32 ring all-reduce (int8: from about 8 replicas)."""
    if compressor is None or not gathers(compressor):
        return
    compressed = [v for v in values if compressor.acts_on(v)]
    n = transport.size
    payload = compressor.wire_bytes(compressed, n, transport.bytes_per_pack)
    float32 = 4 * sum(v.shape.num_elements() for v in compressed)
    if compressed and n * payload > 2 * float32:
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
    return None if variables is None else tf.nest.map_structure(tf.convert_to_tensor, variables)


def _assign(variables, values):
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
    return [_compat.regroup(tuple(replicas)) for replicas in parts]


def combine_replicas(
    transport, method, values, value_scale=1, compressor=None, states=None, step=None,
    pattern="all_reduce",
):
    """Combines every local replica's values with `method` by `pattern`.

    The values `compressor` acts on travel by its `combine`, with its
    state, for an all-reduce or a reduce-scatter. Of the others, an
    all-reduce gathers sparse values (`tf.IndexedSlices`) and all-reduces
    dense ones in packs of one dtype; the other patterns launch one
    collective per value.

    Args:
        transport: a `tf_agn.transports` transport.
        method: an `AggregationMethod` other than NONE.
        values: for each local replica of `transport`, its list of tensors
            and `tf.IndexedSlices`, alike on every replica.
        value_scale: a Python number every value is multiplied by.
        compressor: None, or a `tf_agn.compression.Compressor`.
        states: for each local replica, one dict per value from a name of
            the compressor's `state_spec` to the replica's state; None for
            a compressor without state.
        step: for a compressor with a `start_step`: the optimizer's step, a
            scalar integer tensor.
        pattern: "all_reduce", or "reduce_scatter" (method SUM or MEAN),
            "all_gather", "all_gather_rows" or "all_to_all" (no method,
            uncompressed), as the transports define them.

    Returns:
        `(combined, new_states)`: `combined` laid out like `values`;
        `new_states` laid out like `states`.

    Raises:
        ValueError: for a compressor that acts on values but does not
            carry `pattern`.
    """
    like = values[0]
    compressed = [i for i, value in enumerate(like) if compression.compresses(compressor, value)]
    if compressed and pattern not in compressor.patterns:
        raise ValueError(
            f"compression={compressor.name!r} carries no {pattern}; it carries "
            f"{', '.join(compressor.patterns)}."
        )
    exact = [i for i in range(len(like)) if i not in set(compressed)]
    combined = [list(replica) for replica in values]
    _place(combined, exact, _combine_exactly(
        transport, pattern, method, [[replica[i] for i in exact] for replica in values], value_scale
    ))
    if not compressed:
        return combined, states
    weights = sum_weights(method, like[compressed[0]].dtype, transport, value_scale)
    compressed_values = [[replica[i] for i in compressed] for replica in values]
    compressed_states = [
        [replica[i] for i in compressed] if states else [{} for _ in compressed]
        for replica in (states or values)
    ]
    compress = functools.partial(
        _kept_where_finite, compressor, transport, pattern, compressed_values, compressed_states,
        weights,
    )
    if compressor.start_step:
        # Before it, values travel exactly and the state waits.
        results, new_compressed_states = tf.cond(
            step < compressor.start_step,
            lambda: (_launch(transport, pattern, compressed_values, lambda dtype: weights), compressed_states),
            compress,
        )
    else:
        results, new_compressed_states = compress()
    _place(combined, compressed, results)
    if states is None:
        return combined, None
    new_states = [list(replica) for replica in states]
    _place(new_states, compressed, new_compressed_states)
    return combined, new_states


def _combine_exactly(transport, pattern, method, values, value_scale):
    """Every local replica's `values` by `pattern`: an all-reduce's sparse
    ones gathered, its dense ones all-reduced in packs; the other patterns'
    one collective per value."""
    if not values[0]:
        return values

    def weights_of(dtype):
        return sum_weights(method, dtype, transport, value_scale)

    if pattern != "all_reduce":
        return _launch(transport, pattern, values, weights_of)
    sparse, _ = packing.split_packs(values[0], transport.bytes_per_pack)
    dense = [i for i in range(len(values[0])) if i not in set(sparse)]

    combined = [list(replica) for replica in values]
    _place(combined, dense, packing.all_reduce_packs(
        transport, [[replica[i] for i in dense] for replica in values], weights_of
    ))
    # After the dense packs, in backward order as they are (an embedding's
    # gradient, usually the first layer's, is the backward pass's last).
    for index in reversed(sparse):
        gathered = transport.all_gather_slices(
            [replica[index] for replica in values], weights_of(values[0][index].dtype)
        )
        _place(combined, [index], [[value] for value in gathered])
    return combined


def _launch(transport, pattern, values, weights_of):
    """`pattern` of every local replica's `values`, exactly, each replica
    weighted by `weights_of(dtype)` where the pattern sums: an all-reduce
    in one call, the other patterns one collective per value."""
    if pattern == "all_reduce":
        return transport.all_reduce(values, weights_of(values[0][0].dtype))
    launch = getattr(transport, pattern)
    combined = [[] for _ in values]
    for position in range(len(values[0])):
        tensors = [replica[position] for replica in values]
        if pattern == "reduce_scatter":
            results = launch(tensors, weights_of(tensors[0].dtype))
        elif pattern == "all_gather_rows":
            results = [rows for (rows,) in launch([[tensor] for tensor in tensors])]
        else:
            results = launch(tensors)
        for replica, tensor in zip(combined, results):
            replica.append(tensor)
    return combined


def _kept_where_finite(compressor, transport, pattern, values, states, weights):
    """`compressor.combine`, keeping each replica's old state where its
    combined values are not finite (a mixed precision overflow must not
    make every later residual NaN)."""
    combined, new_states, finite = compressor.combine(transport, values, states, weights, pattern)
    guarded = []
    for device, new, old, replica_finite in zip(transport.devices, new_states, states, finite):
        with tf.device(device):
            # A cond, not a select, which would read both states and copy.
            if tf.nest.flatten(new):
                new = tf.cond(replica_finite, lambda new=new: new, lambda old=old: old)
            guarded.append(new)
    return combined, guarded


def _place(per_replica, indices, values):
    """Writes each replica's `values` at `indices` of its list in `per_replica`."""
    for replica, replica_values in zip(per_replica, values):
        for index, value in zip(indices, replica_values):
            replica[index] = value
