"""`combine_replicas`: every local replica's values, routed to a
transport's patterns."""

import functools

import tensorflow as tf

from tf_agn import compression
from tf_agn.collectives import packing
from tf_agn.collectives.aggregation_method import sum_weights


def combine_replicas(
    transport, method, values, value_scale=1, compressor=None, states=None, step=None,
    pattern="all_reduce",
):
    """Combines every local replica's values with `method` by `pattern`.

    An all-reduce gathers sparse values (`tf.IndexedSlices`); dense values
    travel in packs of one dtype, each all-reduced; the values `compressor`
    acts on travel by its `combine`, with its state. The other patterns
    launch one collective per value.

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
        `(combined, new_states)`: `combined` laid out like `values`, the
        same sum on every replica; `new_states` laid out like `states`.
    """
    if pattern != "all_reduce":
        return _launch_each(transport, pattern, method, values, value_scale), states
    like = values[0]
    compressed = [i for i, value in enumerate(like) if compression.compresses(compressor, value)]
    exact = [i for i in range(len(like)) if i not in set(compressed)]
    combined = [list(replica) for replica in values]
    _place(combined, exact, _combine_exactly(
        transport, method, [[replica[i] for i in exact] for replica in values], value_scale
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
        _kept_where_finite, compressor, transport, compressed_values, compressed_states, weights
    )
    if compressor.start_step:
        # Before it, values travel exactly and the state waits.
        results, new_compressed_states = tf.cond(
            step < compressor.start_step,
            lambda: (transport.all_reduce(compressed_values, weights), compressed_states),
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


def _combine_exactly(transport, method, values, value_scale):
    """Every local replica's `values`: sparse ones gathered, dense ones
    all-reduced in packs."""
    if not values[0]:
        return values
    sparse, _ = packing.split_packs(values[0], transport.bytes_per_pack)
    dense = [i for i in range(len(values[0])) if i not in set(sparse)]

    def weights_of(dtype):
        return sum_weights(method, dtype, transport, value_scale)

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


def _launch_each(transport, pattern, method, values, value_scale):
    """One `pattern` per position of the local replicas' lists of `values`."""
    launch = getattr(transport, pattern)
    combined = [[] for _ in values]
    for position in range(len(values[0])):
        tensors = [replica[position] for replica in values]
        if pattern == "reduce_scatter":
            weights = sum_weights(method, tensors[0].dtype, transport, value_scale)
            results = launch(tensors, weights)
        elif pattern == "all_gather_rows":
            results = [rows for (rows,) in launch([[tensor] for tensor in tensors])]
        else:
            results = launch(tensors)
        for replica, tensor in zip(combined, results):
            replica.append(tensor)
    return combined


def _kept_where_finite(compressor, transport, values, states, weights):
    """`compressor.combine`, keeping each replica's old state where its
    combined values are not finite (a mixed precision overflow must not
    make every later residual NaN)."""
    combined, new_states, finite = compressor.combine(transport, values, states, weights)
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
