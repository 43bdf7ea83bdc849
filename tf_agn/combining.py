"""`combine_replicas`: every local replica's values, routed to a
transport's patterns."""

import functools

import tensorflow as tf

from tf_agn import compression
from tf_agn import packing
from tf_agn.aggregation import replica_weights
from tf_agn.compression import error_feedback


def combine_replicas(
    transport, method, values, value_scale=1, compressor=None, states=None, step=None
):
    """Combines every local replica's values with `method`.

    Sparse values (`tf.IndexedSlices`) are gathered. Dense values travel in
    packs of one dtype, each all-reduced (a cast compressor wraps the
    all-reduce). The values a stateful compressor acts on travel by its
    own patterns, with its state.

    Args:
        transport: a `tf_agn.transports` transport.
        method: an `AggregationMethod` other than NONE.
        values: for each local replica of `transport`, its list of tensors
            and `tf.IndexedSlices`, alike on every replica.
        value_scale: a Python number every value is multiplied by.
        compressor: None, or a `tf_agn.compression` compressor.
        states: for an `ErrorFeedbackCompressor`: for each local replica,
            one dict per value from a name of its `state_spec` to the
            replica's state.
        step: for an `ErrorFeedbackCompressor` with a `start_step`: the
            optimizer's step, a scalar integer tensor.

    Returns:
        `(combined, new_states)`: `combined` laid out like `values`, the
        same sum on every replica; `new_states` laid out like `states`.
    """
    like = values[0]
    stateful = compression.is_stateful(compressor)
    compressed = [
        i for i, value in enumerate(like)
        if stateful and not isinstance(value, tf.IndexedSlices) and compressor.acts_on(value.dtype)
    ]
    exact = [i for i in range(len(like)) if i not in set(compressed)]
    combined = [list(replica) for replica in values]
    sparse, packs = packing.split_packs([like[i] for i in exact], transport.bytes_per_pack)
    for position in sparse:
        index = exact[position]
        weights = replica_weights(method, like[index].dtype, transport, value_scale)
        gathered = transport.all_gather_slices([replica[index] for replica in values], weights)
        for replica, value in zip(combined, gathered):
            replica[index] = value
    for pack in packs:
        indices = [exact[position] for position in pack]
        dtype = like[indices[0]].dtype
        cast = None if stateful else compression.acting_on(compressor, dtype)
        weights = replica_weights(method, dtype, transport, value_scale)
        summed = transport.all_reduce([[replica[i] for i in indices] for replica in values], weights, cast)
        for replica, tensors in zip(combined, summed):
            for index, tensor in zip(indices, tensors):
                replica[index] = tensor
    if not compressed:
        return combined, states
    weights = replica_weights(method, tf.float32, transport, value_scale)
    compressed_values = [[replica[i] for i in compressed] for replica in values]
    compressed_states = [[replica[i] for i in compressed] for replica in states]
    compress = functools.partial(
        error_feedback.combine_kept_finite,
        compressor, transport, compressed_values, compressed_states, weights,
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
    new_states = [list(replica) for replica in states]
    for replica in range(len(values)):
        for position, index in enumerate(compressed):
            combined[replica][index] = results[replica][position]
            new_states[replica][index] = new_compressed_states[replica][position]
    return combined, new_states
