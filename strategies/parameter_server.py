"""`parameter_server`: a `ParameterServerStrategy` whose coordinator is this
process, which first checks that every task can be reached."""

import numbers

import tensorflow as tf

from tf_agn.strategies.cluster import LocalCluster
from tf_agn.strategies.ports import unreachable
from tf_agn.strategies.server import example_tf_config
from tf_agn.strategies.server import read_tf_config

# "auto" partitioning splits a variable into shards of at least this size:
# smaller variables stay whole, since every shard costs its own RPC.
AUTO_MIN_SHARD_BYTES = 256 << 10


def parameter_server(cluster=None, variable_partitioner=None, connect_timeout=30.0):
    """Returns a `ParameterServerStrategy` whose coordinator is this process.

    The process stays connected to the cluster for as long as it lives:
    train with other strategies in other processes.

    Args:
        cluster: where the workers and ps are. One of
            - None: read from the `TF_CONFIG` environment variable, whose task
              must be the coordinator ("chief"), e.g.
              `{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"],
              "ps": ["host2:2222"]}, "task": {"type": "chief", "index": 0}}`;
            - a started `LocalCluster`;
            - a dict `{"worker": [...], "ps": [...]}` of "host:port" lists or
              a `tf.train.ClusterSpec`; without a "chief" job TensorFlow
              picks a local port for the coordinator;
            - a `tf.distribute.cluster_resolver.ClusterResolver`.
        variable_partitioner: how variables created in the strategy's scope
            are split across the ps (large embeddings should be):
            - None: not at all;
            - "auto": into shards of at least 256 KiB, at most one per ps
              (`MinSizePartitioner`);
            - an int n: every variable into n shards along its first axis
              (`FixedShardsPartitioner`);
            - any `tf.distribute.experimental.partitioners.Partitioner` or
              callable TensorFlow accepts.
        connect_timeout: seconds to wait for every worker and ps to accept
            a TCP connection before giving up (a number > 0).

    Returns:
        A `tf.distribute.experimental.ParameterServerStrategy`.

    Raises:
        ValueError: if `TF_CONFIG` is malformed, the cluster lacks a worker
            or ps, `variable_partitioner` is not one of the above, or
            `connect_timeout` is not a number > 0.
        TypeError: if `cluster` is none of the above.
        ConnectionError: if a worker or ps does not accept connections
            within `connect_timeout`; it names each such address.

    Example, in the coordinator, whose `TF_CONFIG` task is the "chief"
    (see `tf_agn.strategies.LocalCluster` for a cluster on this machine):

    ```python
    strategy = tf_agn.strategies.parameter_server(variable_partitioner="auto")
    with strategy.scope():
        model = make_model()  # large variables are sharded across the ps
    ```
    """
    if (
        isinstance(connect_timeout, bool)
        or not isinstance(connect_timeout, numbers.Real)
        or not connect_timeout > 0
    ):
        raise ValueError(
            "connect_timeout must be a number of seconds > 0; received "
            f"{connect_timeout!r}."
        )
    resolver = _cluster_resolver(cluster)
    jobs = resolver.cluster_spec().as_dict()
    for job in ("worker", "ps"):
        if not jobs.get(job):
            raise ValueError(
                f'The cluster has no "{job}" task: {jobs}. A parameter-server '
                "cluster needs at least one worker and one ps, e.g. "
                f"{example_tf_config('chief')['cluster']}."
            )
    tasks = _task_addresses(jobs)
    # The strategy connects to every task when created and retries for ever
    # while one cannot be reached: check first, and name the missing ones.
    missing = unreachable(tasks, connect_timeout)
    if missing:
        raise ConnectionError(
            "No connection within "
            f"{connect_timeout} s to "
            + ", ".join(f"{tasks[address]} at {address}" for address in missing)
            + ". Is its server running (python -m tf_agn.strategies.server), "
            "and is the address right?"
        )
    # This connects the whole process, as the coordinator, for as long as it
    # lives: TensorFlow cannot disconnect. Later strategies may connect it
    # to other clusters, but a stock `MirroredStrategy` fit afterwards in
    # the same process hangs, so tests that train with a
    # `ParameterServerStrategy` run in processes of their own.
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver,
        variable_partitioner=_partitioner(variable_partitioner, len(jobs["ps"])),
    )


def _cluster_resolver(cluster):
    """The `ClusterResolver` of `parameter_server`'s `cluster` argument."""
    if cluster is None:
        read_tf_config(("chief",))  # Clear errors for a malformed TF_CONFIG.
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if isinstance(cluster, LocalCluster):
        return cluster.cluster_resolver
    if isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        return cluster
    if isinstance(cluster, (dict, tf.train.ClusterSpec)):
        spec = tf.train.ClusterSpec(cluster)
        # This process is the chief if the spec has one; otherwise
        # TensorFlow adds a "chief" job on a free local port.
        task_type = "chief" if "chief" in spec.jobs else None
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, rpc_layer="grpc", task_type=task_type, task_id=0
        )
    raise TypeError(
        "cluster must be None (read TF_CONFIG), a LocalCluster, a dict or "
        "tf.train.ClusterSpec of job -> addresses, or a ClusterResolver; "
        f"received {cluster!r}."
    )


def _task_addresses(jobs):
    """Address -> "worker 0"-style task name, for every worker and ps."""
    return {
        address: f"{job} {index}"
        for job in ("worker", "ps")
        for index, address in enumerate(jobs[job])
    }


def _partitioner(variable_partitioner, num_ps):
    """The partitioner `variable_partitioner` names, for `num_ps` ps."""
    partitioners = tf.distribute.experimental.partitioners
    if variable_partitioner is None or callable(variable_partitioner):
        return variable_partitioner
    if variable_partitioner == "auto":
        return partitioners.MinSizePartitioner(
            min_shard_bytes=AUTO_MIN_SHARD_BYTES, max_shards=num_ps
        )
    if (
        isinstance(variable_partitioner, int)
        and not isinstance(variable_partitioner, bool)
        and variable_partitioner >= 1
    ):
        return partitioners.FixedShardsPartitioner(variable_partitioner)
    raise ValueError(
        'variable_partitioner must be None, "auto", an int >= 1 (number of '
        f"shards) or a Partitioner; received {variable_partitioner!r}."
    )
