"""`fit`: asynchronous parameter-server training of a Keras 3 model.

Its checks are in `training_checks`, the evaluation of the center in
`evaluation`, staleness in `staleness`, and how it survives failures in
`recovery`.
"""

import math

import numpy as np
import tensorflow as tf

from tf_agn.strategies.commit_server import APPLIED
from tf_agn.strategies.commit_server import REJECTED_NON_FINITE
from tf_agn.strategies.commit_server import CommitServer
from tf_agn.strategies.evaluation import build_compiled_metrics
from tf_agn.strategies.evaluation import evaluate
from tf_agn.strategies.recovery import checkpoint_manager
from tf_agn.strategies.recovery import fetch_window
from tf_agn.strategies.staleness import Staleness
from tf_agn.strategies.staleness import write_staleness_histogram
from tf_agn.strategies.training_checks import check_fit_arguments
from tf_agn.strategies.training_checks import check_model
from tf_agn.strategies.training_checks import dataset_from
from tf_agn.strategies.worker import Worker
from tf_agn.strategies.worker import window_function
from tf_agn.utils.training_loop import run_epochs


def fit(
    model,
    dataset_fn,
    epochs=1,
    steps_per_epoch=None,
    callbacks=None,
    validation_data=None,
    verbose="auto",
    checkpoint_dir=None,
    checkpoint_every=None,
    reject_non_finite=True,
):
    """Trains `model` asynchronously on a `ParameterServerStrategy` cluster.

    The asynchronous counterpart of `model.fit`, which Keras 3 does not run
    under `ParameterServerStrategy`. Build and compile the model under the
    strategy's scope with a `tf_agn.optimizers.WindowedOptimizer` (AGN,
    DOWNPOUR, DynSGD, AEASGD, EAMSGD). Each window runs on whichever worker
    is free: it pulls the center, takes λ = `local_steps` steps on the
    worker's own weights and optimizer state, and commits; the parameter
    servers apply commits as they arrive (see
    `tf_agn.strategies.commit_server.CommitServer`). Every window is applied
    exactly once, even when its worker dies; a commit holding NaN or Inf is
    rejected and counted (`rejected_commits` in the logs).

    Keras callbacks run as under `model.fit`, with one "batch" per window,
    and a progress bar shows with `verbose`. Training logs the workers'
    mean `loss`, `staleness` (the epoch's mean) and `commits`;
    `validation_data` is evaluated on the center at every epoch's end
    (`val_` logs, with the compiled metrics). A
    `keras.callbacks.TensorBoard` among the callbacks gets the staleness
    histogram.

    With `checkpoint_dir`, the center, the server's counters and the record
    of applied windows are saved every `checkpoint_every` windows and at
    every epoch's end; a run restarted with the same `checkpoint_dir` (after
    a parameter-server failure, say) resumes from the latest checkpoint,
    losing at most one interval.

    Args:
        model: a compiled Keras model, created under the strategy's scope.
        dataset_fn: `fn(input_context) -> tf.data.Dataset` of `(x, y)`
            batches, repeated: every worker builds its own. Every worker is
            pipeline 0 of 1, so shuffle unseeded, or the workers see the
            same order.
        epochs: the number of epochs.
        steps_per_epoch: local steps per epoch, over all workers; an epoch
            is `ceil(steps_per_epoch / local_steps)` windows.
        callbacks: Keras callbacks.
        validation_data: a `tf.data.Dataset` of `(x, y)` batches, or an
            `(x, y)` tuple, evaluated on the center.
        verbose: 0, 1, 2 or "auto" (1), as in `model.fit`.
        checkpoint_dir: where to checkpoint the center; None for no
            checkpoints.
        checkpoint_every: windows between checkpoints; None for epoch ends
            only.
        reject_non_finite: whether the server rejects commits holding NaN
            or Inf (the default).

    Returns:
        A `keras.callbacks.History`, with a `staleness` attribute (a
        `tf_agn.strategies.Staleness` over the run).

    Raises:
        ValueError: if the strategy, the optimizer or an argument does not
            fit asynchronous training.

    Example:

    ```python
    with tf_agn.strategies.LocalCluster(num_workers=2) as cluster:
        strategy = tf_agn.strategies.parameter_server(cluster)
        with strategy.scope():
            model = tf_agn.models.mlp((784,), 10)
            model.compile(optimizer=tf_agn.optimizers.AGN(local_steps=10),
                          loss="sparse_categorical_crossentropy")
        history = tf_agn.strategies.fit(
            model, lambda input_context: dataset.repeat().batch(32),
            epochs=2, steps_per_epoch=40)
    ```
    """
    strategy = model.distribute_strategy
    optimizer = check_model(model, strategy)
    check_fit_arguments(steps_per_epoch, checkpoint_every)
    windows_per_epoch = math.ceil(steps_per_epoch / optimizer.local_steps)
    runner = _WindowRunner(
        model,
        optimizer,
        dataset_fn,
        epochs=epochs,
        windows_per_epoch=windows_per_epoch,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        reject_non_finite=reject_non_finite,
    )
    # The callback, progress-bar and `History` skeleton it shares with ADL.
    history = run_epochs(
        model,
        epochs,
        windows_per_epoch,
        runner.run_epoch,
        callbacks=callbacks,
        verbose=verbose,
        validate=None if validation_data is None else lambda: evaluate(model, validation_data),
        skip_epoch=runner.epoch_restored,
    )
    history.staleness = runner.staleness
    history.server = runner.server
    return history


class _WindowRunner:
    """Runs `fit`'s windows on a `ClusterCoordinator`, epoch by epoch,
    resuming from the latest checkpoint in `checkpoint_dir`.

    Its arguments are `fit`'s, with the model's `WindowedOptimizer` and the
    number of windows per epoch. `server` is the `CommitServer`;
    `staleness` the `Staleness` of every commit applied so far.
    """

    def __init__(
        self,
        model,
        optimizer,
        dataset_fn,
        epochs,
        windows_per_epoch,
        checkpoint_dir,
        checkpoint_every,
        reject_non_finite,
    ):
        self._windows_per_epoch = windows_per_epoch
        self._checkpoint_every = checkpoint_every
        strategy = model.distribute_strategy
        self._coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            self.server = CommitServer(
                optimizer,
                model.trainable_variables,
                epochs * windows_per_epoch,
                reject_non_finite,
            )
            worker = Worker(model, optimizer, self.server, strategy)
        # As under TensorFlow's `ParameterServerStrategy`, the workers are
        # not in step: every worker is pipeline 0 of 1.
        input_context = tf.distribute.InputContext(
            num_input_pipelines=1,
            input_pipeline_id=0,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        build_compiled_metrics(model, dataset_from(dataset_fn, input_context, model))
        # Restores the center, the server's counters and the record of
        # applied windows: only windows not yet applied run again.
        self._manager = checkpoint_manager(model, self.server, checkpoint_dir)
        self._applied = self.server.applied_windows.numpy().astype(bool)
        per_worker_dataset = self._coordinator.create_per_worker_dataset(
            lambda: dataset_from(dataset_fn, input_context, model)
        )
        self._iterator = iter(per_worker_dataset)
        self._run_window = window_function(worker, optimizer.local_steps)
        self.staleness = Staleness()

    def epoch_restored(self, epoch):
        """Whether every window of `epoch` was applied before the checkpoint
        this run restored."""
        first = epoch * self._windows_per_epoch
        return bool(self._applied[first : first + self._windows_per_epoch].all())

    def run_epoch(self, epoch, callback_list):
        """Runs the windows of `epoch` that no checkpoint holds, calling
        `callback_list`'s batch hooks around each.

        Returns:
            The epoch's logs.
        """
        first = epoch * self._windows_per_epoch
        pending = [
            w for w in range(first, first + self._windows_per_epoch) if not self._applied[w]
        ]
        epoch_staleness = Staleness()
        losses = []
        chunk = self._checkpoint_every or len(pending)
        for start in range(0, len(pending), chunk):
            scheduled = [(w, self._schedule(w)) for w in pending[start : start + chunk]]
            for window, result in scheduled:
                callback_list.on_train_batch_begin(window - first)
                # A dead worker's window is re-run elsewhere by the
                # `ClusterCoordinator`; the server drops a second commit.
                loss, window_staleness, outcome = fetch_window(
                    result, lambda: self._schedule(window)
                )
                if outcome == APPLIED:
                    self.staleness.record(window_staleness)
                    epoch_staleness.record(window_staleness)
                if outcome != REJECTED_NON_FINITE:
                    losses.append(float(loss))
                callback_list.on_train_batch_end(window - first, {"loss": _mean(losses)})
            # Every window scheduled before the save has been fetched: the
            # checkpoint is consistent (each save waits for them).
            if self._manager is not None:
                self._manager.save()
        write_staleness_histogram(callback_list, self.staleness, epoch)
        return {
            "loss": _mean(losses),
            "staleness": epoch_staleness.mean,
            "commits": int(self.server.commits.numpy()),
            "rejected_commits": int(self.server.rejected.numpy()),
        }

    def _schedule(self, window):
        """Schedules `window` on a free worker; returns its `RemoteValue`."""
        return self._coordinator.schedule(
            self._run_window, args=(self._iterator, tf.constant(window, tf.int64))
        )


def _mean(values):
    """The mean of `values`, NaN if there are none."""
    return float(np.mean(values)) if values else float("nan")
