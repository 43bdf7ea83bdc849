"""`simulate`: asynchronous training, deterministically, in one process."""

import numpy as np
import tensorflow as tf

from tf_agn.strategies.commit_server import APPLIED
from tf_agn.strategies.commit_server import CommitServer
from tf_agn.strategies.evaluation import build_compiled_metrics
from tf_agn.strategies.staleness import Staleness
from tf_agn.strategies.training_checks import check_optimizer
from tf_agn.strategies.training_checks import dataset_from
from tf_agn.strategies.worker import Worker
from tf_agn.strategies.worker import window_function

ORDERS = ("round_robin", "random")


class Simulation:
    """What `simulate` did.

    Attributes:
        order: the worker index of every commit, in commit order.
        losses: each window's mean training loss, in commit order.
        outcomes: each commit's outcome (see
            `tf_agn.strategies.commit_server`).
        staleness: a `tf_agn.strategies.Staleness` over the applied commits.
        server: the `CommitServer`, whose counters can be read.
        workers: the virtual `Worker`s, whose weights can be read.
    """

    def __init__(self, server, workers):
        self.server = server
        self.workers = workers
        self.order = []
        self.losses = []
        self.outcomes = []
        self.staleness = Staleness()


def simulate(
    model,
    dataset_fn,
    num_workers,
    num_windows,
    order="round_robin",
    seed=0,
    callback=None,
):
    """Runs n virtual asynchronous workers in one process, in a given order.

    It runs `tf_agn.strategies.fit`'s worker and server programs, but the
    interleaving is chosen, not raced: every worker pulls at the start;
    then, for each of `num_windows` commits, the worker whose turn it is
    takes its λ local steps, commits, and pulls again. Use it to test the
    asynchronous update rules exactly, or to study staleness without a
    cluster.

    Args:
        model: a built Keras model compiled with a
            `tf_agn.optimizers.WindowedOptimizer`, without a distribution
            strategy. Its weights are the center and hold the result.
        dataset_fn: `fn(input_context) -> tf.data.Dataset` of `(x, y)`
            batches, long enough for that worker's windows. Virtual worker
            i is pipeline i of n (`input_context.input_pipeline_id`), so
            each can seed or shard its own data.
        num_workers: n, the number of virtual workers (an int >= 1).
        num_windows: the number of commits to simulate (an int >= 1).
        order: "round_robin" (every commit after the first round is exactly
            n − 1 stale, the AGN paper's model of n asynchronous workers),
            "random" (seeded by `seed`: the geometric-like staleness of
            workers of equal speed), or a sequence of `num_windows` worker
            indices.
        seed: the seed of the random order.
        callback: None, or `fn(window_index)` called after every commit
            (and the committing worker's pull), in commit order, when the
            model's weights are the center after that commit: it can
            evaluate the center over (simulated) time.

    Returns:
        A `Simulation`.

    Raises:
        TypeError: if `dataset_fn` returns something else than a
            `tf.data.Dataset`.
        ValueError: for a bad `num_workers` or `num_windows`, an unknown
            order, an order of the wrong length or with bad indices, a
            model not compiled with a windowed optimizer, or a dataset of
            single examples or too short for its worker's windows.

    Example:

    ```python
    model = tf_agn.models.mlp((784,), 10)
    model.compile(optimizer=tf_agn.optimizers.AGN(local_steps=4),
                  loss="sparse_categorical_crossentropy")
    simulation = tf_agn.strategies.simulate(
        model, lambda context: dataset.repeat().batch(32), num_workers=4,
        num_windows=20)
    print(simulation.staleness.histogram())
    ```
    """
    optimizer = check_optimizer(model)
    for name, value in (("num_workers", num_workers), ("num_windows", num_windows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; received {value!r}.")
    commit_order = _commit_order(order, num_workers, num_windows, seed)
    datasets = [
        dataset_from(
            dataset_fn,
            tf.distribute.InputContext(
                num_input_pipelines=num_workers,
                input_pipeline_id=index,
                num_replicas_in_sync=1,
            ),
            model,
        )
        for index in range(num_workers)
    ]
    build_compiled_metrics(model, datasets[0])
    strategy = tf.distribute.get_strategy()
    server = CommitServer(optimizer, model.trainable_variables, num_windows)
    workers = [Worker(model, optimizer, server, strategy) for _ in range(num_workers)]
    pulls = [tf.function(worker.pull) for worker in workers]
    windows = [
        window_function(worker, optimizer.local_steps, pull_first=False)
        for worker in workers
    ]
    iterators = [iter(dataset) for dataset in datasets]
    simulation = Simulation(server, workers)
    for pull in pulls:
        pull()
    for window_id, index in enumerate(commit_order):
        try:
            loss, staleness, outcome = windows[index](
                iterators[index], tf.constant(window_id, tf.int64)
            )
        except tf.errors.OutOfRangeError:
            raise _too_short(index, commit_order, optimizer.local_steps) from None
        pulls[index]()
        simulation.order.append(index)
        simulation.losses.append(float(loss))
        simulation.outcomes.append(int(outcome))
        if int(outcome) == APPLIED:
            simulation.staleness.record(staleness)
        if callback is not None:
            callback(window_id)
    return simulation


def _too_short(worker, commit_order, local_steps):
    """The error for worker `worker`'s dataset running out."""
    windows = commit_order.count(worker)
    return ValueError(
        f"dataset_fn must give worker {worker} at least {windows * local_steps} "
        f"batches, for its {windows} windows of local_steps={local_steps}; "
        "received a dataset that ran out before. Make it longer, e.g. with "
        ".repeat()."
    )


def _commit_order(order, num_workers, num_windows, seed):
    """The worker index of every commit, from `simulate`'s `order`."""
    if isinstance(order, str):
        if order == "round_robin":
            return [window % num_workers for window in range(num_windows)]
        if order == "random":
            rng = np.random.default_rng(seed)
            return [int(i) for i in rng.integers(0, num_workers, num_windows)]
        raise ValueError(
            f"Unknown order {order!r}; expected one of {ORDERS} or a "
            "sequence of worker indices."
        )
    order = [int(i) for i in order]
    if len(order) != num_windows or not all(0 <= i < num_workers for i in order):
        raise ValueError(
            f"An explicit order needs {num_windows} worker indices in "
            f"[0, {num_workers}); received {order!r}."
        )
    return order
