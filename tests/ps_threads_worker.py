"""Threads-mode parameter-server training, run by test_cluster.py in a
process of its own.

It is not a test module. Connecting a `ParameterServerStrategy` makes
the whole process a cluster's coordinator for good (TensorFlow cannot
disconnect it), and a stock `MirroredStrategy` fit started later in that
process hangs, so pytest's own process must never connect one.

In this one process, one after another, as a test suite would:

1. a cluster of 2 workers and 1 ps; a coordinator schedules 10 steps, each
   adding 1 to a variable on the ps and to a per-worker variable;
2. a second cluster, of 1 worker and 2 ps, with a second strategy and
   coordinator; a (1000, 64) variable split into 2 shards
   (`variable_partitioner=2`) gets 2 steps of `assign_add(1)`;
3. a third strategy on that cluster with `variable_partitioner="auto"`.

Usage: python ps_threads_worker.py  (prints one JSON line of results)
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tf_agn.strategies import LocalCluster  # noqa: E402
from tf_agn.strategies import parameter_server  # noqa: E402


def count_steps():
    cluster = LocalCluster(num_workers=2, num_ps=1).start()
    strategy = parameter_server(cluster)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        total = tf.Variable(0.0)
        per_worker = tf.Variable(0.0, per_worker_variable=True)

    @tf.function
    def step():
        total.assign_add(1.0)
        per_worker.assign_add(1.0)

    for _ in range(10):
        coordinator.schedule(step)
    coordinator.join()
    return {
        "total": float(total.numpy()),
        "total_device": total.device,
        "per_worker": [float(value) for value in per_worker.read_all()],
    }


def shard_across_two_ps():
    cluster = LocalCluster(num_workers=1, num_ps=2).start()
    strategy = parameter_server(cluster, variable_partitioner=2)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        embedding = tf.Variable(tf.zeros((1000, 64)))

    @tf.function
    def step():
        embedding.assign_add(tf.ones((1000, 64)))

    coordinator.schedule(step)
    coordinator.schedule(step)
    coordinator.join()

    auto = parameter_server(cluster, variable_partitioner="auto")
    with auto.scope():
        large = tf.Variable(tf.zeros((4096, 64)))  # 1 MiB
        small = tf.Variable(tf.zeros((10,)))
    return {
        "shard_shapes": [shard.shape.as_list() for shard in embedding.variables],
        "shard_devices": [shard.device for shard in embedding.variables],
        "values": sorted(set(tf.convert_to_tensor(embedding).numpy().ravel().tolist())),
        "auto_shards": {"large": num_shards(large), "small": num_shards(small)},
    }


def num_shards(variable):
    # A ShardedVariable lists its shards; an unsharded variable has none.
    return len(getattr(variable, "variables", [variable]))


if __name__ == "__main__":
    results = {"count": count_steps(), "shards": shard_across_two_ps()}
    print(json.dumps(results), flush=True)
