"""Independent references for optimizer tests: per-replica gradients from
separate `tf.GradientTape` runs on plain tensors, combined in numpy."""

import numpy as np
import tensorflow as tf

from tf_agn.collectives.aggregation_method import AggregationMethod


def mlp_forward(params, x):
    """The test MLP, Dense(tanh) then Dense, written with raw ops."""
    kernel1, bias1, kernel2, bias2 = params
    return tf.tanh(x @ kernel1 + bias1) @ kernel2 + bias2


def mse_gradients(params, x, y):
    """Gradients of the mean squared error on one replica's shard."""
    variables = [tf.Variable(p, dtype=tf.float64) for p in params]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(mlp_forward(variables, x) - y))
    return [g.numpy() for g in tape.gradient(loss, variables)]


def combine(method, per_replica):
    """Combines per-replica gradient lists in numpy."""
    method = AggregationMethod.parse(method)
    if method is AggregationMethod.NONE:
        return per_replica
    stacked = [np.stack(parts) for parts in zip(*per_replica)]
    if method is AggregationMethod.SUM:
        combined = [s.sum(0) for s in stacked]
    elif method is AggregationMethod.MEAN:
        combined = [s.mean(0) for s in stacked]
    else:
        combined = [s[0] for s in stacked]
    return [combined] * len(per_replica)


def clip_by_global_norm(grads, clip):
    norm = np.sqrt(sum(np.sum(g * g) for g in grads))
    return [g * min(1.0, clip / norm) for g in grads]


def sgd_trajectory(
    params, x, y, method, num_replicas, batch_size, learning_rate,
    global_clipnorm=None, accumulation_steps=1, accumulation_reduction="mean",
):
    """Per-replica weights after plain SGD over consecutive global batches.

    Each global batch is split into `num_replicas` consecutive shards, as
    `MirroredStrategy` distributes it. With `accumulation_steps` k, each
    replica first averages (or sums) its gradients over k consecutive
    batches, and one combined step is taken per k batches.

    Returns:
        A list, one entry per replica, of lists of numpy arrays.
    """
    replicas = [[np.array(p, np.float64) for p in params]] * num_replicas
    shard = batch_size // num_replicas
    window = batch_size * accumulation_steps
    for window_start in range(0, len(x), window):
        grads = []
        for r in range(num_replicas):
            micro = []
            for start in range(window_start, window_start + window, batch_size):
                rows = slice(start + r * shard, start + (r + 1) * shard)
                micro.append(mse_gradients(replicas[r], x[rows], y[rows]))
            reduce = np.mean if accumulation_reduction == "mean" else np.sum
            grads.append([reduce(parts, axis=0) for parts in zip(*micro)])
        combined = combine(method, grads)
        if global_clipnorm is not None:
            combined = [clip_by_global_norm(g, global_clipnorm) for g in combined]
        replicas = [
            [p - learning_rate * g for p, g in zip(weights, step)]
            for weights, step in zip(replicas, combined)
        ]
    return replicas
