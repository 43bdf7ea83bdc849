"""`multi_worker_mirrored` and `KerasMultiWorkerMirroredStrategy`:
synchronous training across worker processes, in which Keras 3's
`model.fit` works. `python -m tf_agn.strategies.launch --multi_worker N --
COMMAND` runs N such workers on this machine.
"""

import atexit
import functools
import os
import signal
import sys
import threading

import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives import agreement
from tf_agn.collectives.cross_device_ops import AggregatingAllReduce
from tf_agn.strategies import heartbeat
from tf_agn.strategies import rendezvous
from tf_agn.strategies import membership
from tf_agn.strategies import tf_config


class KerasMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy`, with TensorFlow's own
    collectives, under which Keras 3's `fit` and `evaluate` run.

    Use it to train with stock Keras, or to compare tf_agn's aggregation
    with TensorFlow's own communication; `multi_worker_mirrored()` builds
    the strategy with tf_agn's ops.

    Args:
        cluster_resolver: as `tf.distribute.MultiWorkerMirroredStrategy`'s;
            None reads `TF_CONFIG`.
        communication_options: as `tf.distribute.MultiWorkerMirroredStrategy`'s.

    Example:

    ```python
    strategy = tf_agn.strategies.KerasMultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(dataset, epochs=2)
    ```
    """

    # Stock, `fit` fails twice under this strategy (keras-team/keras#20585,
    # tensorflow#72388): `_maybe_symbolic_build` reduces the first (x, y)
    # batch with one `strategy.reduce("MEAN", batch, axis=None)`, which
    # `MirroredStrategy` maps over the nest and this strategy does not
    # ("Attempt to convert a value (PerReplica...) with an unsupported type
    # to a Tensor"); and every per-replica log (the scalar loss) is reduced
    # with `axis=0`, which fails on a scalar ("Invalid reduction dimension
    # 0"). So `reduce` takes nests leaf by leaf and reduces a scalar across
    # replicas only, as Keras does under `MirroredStrategy`. Gradients do
    # not pass through `reduce`.
    def reduce(self, reduce_op, value, axis=None):
        return tf.nest.map_structure(
            lambda leaf: self._reduce_leaf(reduce_op, leaf, axis), value
        )

    def _reduce_leaf(self, reduce_op, value, axis):
        local = self.experimental_local_results(value)[0]
        if axis is not None and local.shape.rank == 0:
            axis = None
        # With an axis, `reduce` sums per replica and counts by itself.
        is_mean = tf.distribute.ReduceOp(reduce_op) == tf.distribute.ReduceOp.MEAN
        # The batch's integer labels: their MEAN is the float64 mean, as
        # TensorFlow's own reductions answer it (`MirroredStrategy` sends
        # int32 values to `ReductionToOneDevice`), which tf_agn's ops,
        # refusing an integer MEAN, would not give.
        if axis is None and is_mean and tf.as_dtype(local.dtype).is_integer:
            total = super().reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            return total / self.num_replicas_in_sync
        return super().reduce(reduce_op, value, axis=axis)


def multi_worker_mirrored(
    aggregation="mean",
    cluster_resolver=None,
    communication_options=None,
    connect_timeout_seconds=rendezvous.DEFAULT_CONNECT_TIMEOUT_SECONDS,
    min_workers=None,
    **ops_kwargs,
):
    """Returns a `MultiWorkerMirroredStrategy` that reduces with
    `AggregatingAllReduce` over TensorFlow's collectives.

    Every worker runs the same program with its own `TF_CONFIG` and calls
    this first, before any other TensorFlow op. Every aggregation method,
    packing, compression and Keras 3's `fit` work across workers. Creating
    the strategy waits for the other workers (Ctrl-C and SIGTERM interrupt
    it), connects them, and checks that all built their ops alike.

    Args:
        aggregation: the default `AggregationMethod` for tf_agn optimizers
            created in this strategy's scope without a method of their own.
        cluster_resolver: where the workers are and which one this process
            is; by default read from `TF_CONFIG` (without one, this process
            is a single worker).
        communication_options: a
            `tf.distribute.experimental.CommunicationOptions` for the
            strategy: its fields override the ops' own (`timeout_seconds`
            turns a lost worker into an error instead of a hang).
        connect_timeout_seconds: how long to wait for the other workers at
            creation, and for their settings check; default 600.
        min_workers: the fewest workers the job goes on with. Workers that
            have not come within `connect_timeout_seconds` are left out,
            and the others train as a smaller cluster, renumbered in
            order (this process's `TF_CONFIG` is rewritten to it); a
            worker left out rejoins when the job next restarts. Default:
            the `TF_AGN_MIN_WORKERS` environment variable, else every
            worker. Needs `TF_CONFIG`'s cluster of "worker" tasks; every
            worker must pass the same value.
        **ops_kwargs: further `AggregatingAllReduce` arguments
            (`bytes_per_pack`, `compression`, `timeout_seconds`, ...). The
            transport is always "collective".

    Returns:
        A `KerasMultiWorkerMirroredStrategy`.

    Raises:
        ValueError: for an unknown aggregation or a bad ops argument, a
            `min_workers` that is not between 1 and the cluster's workers,
            a `TF_CONFIG` that is not valid JSON, a task that is not one of
            the cluster's workers (or its chief), or if the workers'
            settings disagree (naming the field and each worker's value).
            All but the last are raised before anything connects.
        TimeoutError: naming the workers that did not answer within
            `connect_timeout_seconds` (fewer than `min_workers` with it),
            or, with `min_workers`, if the job runs without this worker.
        RuntimeError: if the workers have different numbers of devices.

    Example, run on host0 with `TF_CONFIG` `{"cluster": {"worker":
    ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}`
    and on host1 with index 1:

    ```python
    strategy = tf_agn.strategies.multi_worker_mirrored(aggregation="mean")
    with strategy.scope():
        model = tf_agn.models.mlp((784,), 10)
        model.compile(optimizer=tf_agn.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=256, epochs=2)
    ```
    """
    # First: a supervisor that watches heartbeats sees this worker alive
    # through the waits below and every long step after.
    heartbeat.start_from_environment()
    if ops_kwargs.get("transport", "collective") != "collective":
        raise ValueError(
            'multi_worker_mirrored reduces across workers: transport must be '
            f'"collective"; received {ops_kwargs["transport"]!r}.'
        )
    if cluster_resolver is None:
        tf_config.load()  # A clear error for a malformed TF_CONFIG.
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        source = "TF_CONFIG"
    else:
        source = "cluster_resolver"
    num_workers, worker_index = _worker_count_and_index(cluster_resolver, source)
    min_workers = membership.min_workers(min_workers, cluster_resolver, source, num_workers)
    # Each pack is one collective all-reduce over all replicas of all
    # workers (NCCL between GPUs, a ring between CPUs and machines).
    ops_kwargs["transport"] = "collective"
    # Built first, so that a bad argument fails before any waiting. Its
    # collective group and instance keys derive from the group of devices,
    # not from how many tf_agn objects a process made, so workers that build
    # different numbers of ops or strategies still agree. A lost peer fails
    # the survivors' step through TensorFlow's health check;
    # `timeout_seconds` (default None; its cost:
    # `tf_agn.transports.DEFAULT_TIMEOUT_SECONDS`) also turns collectives
    # called in another order into an error.
    make_ops = functools.partial(AggregatingAllReduce, aggregation=aggregation, **ops_kwargs)
    ops = make_ops(num_workers=num_workers, worker_index=worker_index)
    # TensorFlow connects the workers in the strategy's constructor, where
    # waiting is neither bounded nor interruptible: meet the peers first.
    if min_workers < num_workers:
        # The workers that came may be fewer, and this one renumbered.
        cluster_resolver = membership.meet_in_tf_config(min_workers, connect_timeout_seconds)
        num_workers, worker_index = _worker_count_and_index(cluster_resolver, source)
        ops = make_ops(num_workers=num_workers, worker_index=worker_index)
    else:
        rendezvous.wait_for_peers(cluster_resolver, connect_timeout_seconds)
    # TensorFlow catches SIGTERM while it connects (for its own preemption
    # notices); Python's handler is put back, so that a supervisor's SIGTERM
    # still stops the worker.
    with _sigterm_kept():
        strategy = KerasMultiWorkerMirroredStrategy(
            cluster_resolver=cluster_resolver,
            communication_options=communication_options,
        )
    local_replicas = len(strategy.extended.worker_devices)
    if local_replicas * num_workers != strategy.num_replicas_in_sync:
        raise RuntimeError(
            f"{num_workers} workers of {local_replicas} replicas do not make "
            f"the strategy's {strategy.num_replicas_in_sync}: every worker "
            "must have the same number of devices."
        )
    _compat.replace_cross_device_ops(strategy.extended, ops)
    if num_workers > 1:
        # Aggregation, `bytes_per_pack`, compression, transport,
        # implementation, local replicas and tf_agn version must agree.
        agreement.check_agreement(
            ops, strategy.extended.worker_devices, connect_timeout_seconds
        )
    # Connected: a supervisor that lost a peer may now make this worker
    # stop waiting for it (before, it is killed like any other).
    heartbeat.answer_aborts(_abort_collectives)
    if num_workers > 1:
        atexit.unregister(_exit_without_teardown_after_an_op_error)  # once a process
        atexit.register(_exit_without_teardown_after_an_op_error)
    return strategy


def _exit_without_teardown_after_an_op_error():
    """At exit after an uncaught TensorFlow op error (a lost peer failed a
    collective), ends the process at once, with the code Python gives an
    uncaught error (1), skipping the `atexit` handlers registered before
    this one and TensorFlow's teardown. That teardown (its servers,
    collectives and coordination service, with a peer gone) took 3 to 10 s
    here, and the launcher restarts the job only once every survivor has
    exited. The handlers registered after, such as `BackupAndRestore`'s
    rescue, have run."""
    if isinstance(getattr(sys, "last_value", None), tf.errors.OpError):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class _sigterm_kept:
    """Puts back, on exit, the SIGTERM handler the main thread had on entry."""

    def __enter__(self):
        self._is_main = threading.current_thread() is threading.main_thread()
        self._handler = signal.getsignal(signal.SIGTERM) if self._is_main else None

    def __exit__(self, *exc_info):
        if self._is_main and self._handler is not None:
            signal.signal(signal.SIGTERM, self._handler)


def _abort_collectives():
    _compat.abort_collectives("a peer of this worker was lost (its supervisor says so)")


def _worker_count_and_index(resolver, source):
    """`(num_workers, worker_index)` of `resolver`'s cluster and task.

    Raises a ValueError, naming `source` ("TF_CONFIG"), if the task is not
    a worker or chief of the cluster.
    """
    jobs = resolver.cluster_spec().as_dict()
    chiefs = len(jobs.get("chief", []))
    workers = chiefs + len(jobs.get("worker", []))
    if not workers:
        return 1, 0
    task_type = resolver.task_type
    allowed_types = [job for job in ("chief", "worker") if jobs.get(job)]
    if task_type not in allowed_types:
        raise ValueError(
            f"{source}'s task type must be one of {allowed_types}, the "
            f"cluster's jobs of replicas; received {task_type!r}."
        )
    # A missing index means 0, as TF_CONFIG's readers take it.
    task_id = resolver.task_id or 0
    tasks = len(jobs[task_type])
    if not 0 <= task_id < tasks:
        raise ValueError(
            f"{source}'s task index must be in range({tasks}), for the "
            f"cluster's {tasks} {task_type!r} task(s); received {task_id!r}."
        )
    # Numbered as `MultiWorkerMirroredStrategy` numbers replicas: the chief
    # first, then the workers in order.
    if task_type == "chief":
        return workers, 0
    return workers, chiefs + task_id
