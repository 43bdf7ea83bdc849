"""`BackupAndRestore`: fault-tolerant `fit` for one process or many workers
sharing one backup directory, restoring every replica's own state."""

import itertools
import os
import signal
import warnings

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn.resuming import resizing
from tf_agn.resuming.backup_files import POINTER  # noqa: F401  (part of this module's interface)
from tf_agn.resuming.backup_files import BackupFiles
from tf_agn.resuming.backup_files import Task
from tf_agn.resuming.preemption import PreemptionNotice
from tf_agn.resuming.preemption import Preempted
from tf_agn.resuming.preemption import check_notice
from tf_agn.resuming.replica_state import assign_every_copy
from tf_agn.resuming.replica_state import assign_local_copies
from tf_agn.resuming.replica_state import local_copies


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state and resumes `fit` from it, exactly.

    A drop-in for `keras.callbacks.BackupAndRestore` that also works when
    several workers share one backup directory, restores every replica's
    own copy of the variables, and, with an int `save_freq`, the step
    within the epoch (the batches already trained are skipped; other
    callbacks still see them, with empty logs).

    The latest backup is whole whenever a process dies. A resumed run
    equals an uninterrupted one when every epoch feeds the same batches in
    the same order; `communication_stats` restart from zero. Restarting is
    a supervisor's job (`python -m tf_agn.strategies.launch --max_restarts
    K`, systemd, Kubernetes). A backup also resumes on another number of
    workers or replicas (`tf_agn.resuming.resizing`).

    On a preemption notice (SIGTERM by default) every worker finishes one
    agreed step, backs up after it and raises `tf_agn.callbacks.Preempted`,
    a `SystemExit` whose code, 75, asks the supervisor for a restart that
    is not a failure; the restarted run trains no step twice.

    Example:

    ```python
    strategy = tf_agn.strategies.multi_worker_mirrored()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=tf_agn.optimizers.AGN(keras.optimizers.Adam()),
                      loss="sparse_categorical_crossentropy")
    model.fit(x, y, epochs=10, shuffle=False, callbacks=[
        tf_agn.callbacks.BackupAndRestore("/shared/backup", save_freq=50)])
    ```

    Args:
        backup_dir: the directory for the backup files, created if needed;
            the same path on every worker. Use it for nothing else.
        save_freq: "epoch" to back up at the end of every epoch, or an int
            n >= 1 to back up every n batches.
        delete_checkpoint: whether the chief deletes the backup when `fit`
            ends normally.
        preemption_notice: what tells this worker it will be preempted: a
            signal (default `signal.SIGTERM`, watched during `fit` when it
            runs in the main thread), a callable polled after every step
            that returns True once notified, a path whose appearance is the
            notice, or None to watch nothing. A notice on any worker stops
            every worker after the same step.

    Raises:
        ValueError: for a bad `backup_dir`, `save_freq` or
            `preemption_notice`; from `fit`, for
            a backup of another model or optimizer, or state that cannot be
            shared out on another cluster shape.
        OSError: if `backup_dir` or a backup cannot be written, or the
            pointer names a missing file.
    """

    def __init__(
        self, backup_dir, save_freq="epoch", delete_checkpoint=True,
        preemption_notice=signal.SIGTERM,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("backup_dir must be a directory path; received an empty one.")
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                'save_freq must be "epoch" or an int >= 1 (batches between '
                f"backups); received {save_freq!r}."
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.preemption_notice = check_notice(preemption_notice)
        os.makedirs(self.backup_dir, exist_ok=True)
        if not os.access(self.backup_dir, os.W_OK | os.X_OK):
            raise PermissionError(
                f"BackupAndRestore cannot write to backup_dir {self.backup_dir!r}."
            )
        self._restored = None  # the pointer restored from, if any
        self._metric_arrays = None  # the restored epoch's metrics, until it begins
        self._batch_skipper = None
        self._preemption = None

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "delete_checkpoint": self.delete_checkpoint,
            "preemption_notice": self.preemption_notice,
        }

    # Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model: call it on a batch of "
                "data or build it before fit()."
            )
        strategy = self.model.distribute_strategy
        self._task = Task.of(strategy)
        self._files = BackupFiles(self.backup_dir, self._task)
        if self.preemption_notice is not None:
            # Every worker runs the same fits in the same order, so their
            # keys agree; a later fit in this process never reads these.
            self._preemption = PreemptionNotice(
                self.preemption_notice, self._task.all_names, self._task.name,
                f"tf_agn/preemption/{next(_FITS)}", self.model,
            )
            self._preemption.start()
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self._files.remove_temporary_files()
        self._epoch, self._step, self._steps_since_save = 0, 0, 0
        self._calls = 0  # train-function calls trained in this fit
        self._next_checkpoint = 0
        self._restored = self._files.read_pointer()
        if self._restored is not None:
            self._restore(self._restored)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._step = epoch, 0
        restored = self._restored
        if restored and epoch == restored["epoch"] and restored["step"]:
            # `fit` reset the metrics just now: put back the interrupted
            # epoch's, so that its logs cover all of its batches.
            self._step = restored["step"]
            strategy = self.model.distribute_strategy
            if isinstance(self._metric_arrays, list):  # resized: one value each
                assign_every_copy(strategy, self.model.metrics_variables, self._metric_arrays)
            else:
                assign_local_copies(
                    strategy, self.model.metrics_variables, self._metric_arrays, "metrics"
                )
        self._metric_arrays = None

    def on_train_batch_end(self, batch, logs=None):
        step = batch + 1
        if step <= self._step:  # a batch skipped after a restore
            return
        self._steps_since_save += step - self._step
        self._step = step
        self._calls += 1
        preempted = (
            self._preemption is not None
            and self._preemption.stop_step(self._calls) == self._calls
        )
        if preempted or (
            self.save_freq != "epoch" and self._steps_since_save >= self.save_freq
        ):
            self._steps_since_save = 0
            if step == self.params.get("steps"):
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, step)
        if preempted:
            self._end()
            raise Preempted(self._calls)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and self._task.is_chief:
            self._files.delete_backup()
        # A notice after the last step: training is done, so the signal
        # takes its old course (a supervisor's SIGTERM still stops us).
        self._end(redeliver=True)

    def _end(self, redeliver=False):
        """Leaves `fit`: the model's own train function and start epoch,
        and no notice watched."""
        if self._batch_skipper is not None:
            self._batch_skipper.stop()
            self._batch_skipper = None
        _compat.set_initial_epoch(self.model, None)
        self._restored = None
        if self._preemption is not None:
            self._preemption.stop(redeliver=redeliver)
            self._preemption = None

    # Saving and restoring ------------------------------------------------

    def _state_variables(self):
        """The variables a backup holds but for the metrics, in a fixed
        order: the model's (weights and random seeds), then the
        optimizer's."""
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            variables += list(self.model.optimizer.variables)
        return variables

    def _save(self, epoch, step):
        """Backs up the training state, to resume at `step` of `epoch`."""
        strategy = self.model.distribute_strategy
        checkpoint = self._next_checkpoint
        self._next_checkpoint += 1
        arrays = local_copies(strategy, self._state_variables(), "state")
        arrays.update(local_copies(strategy, self.model.metrics_variables, "metrics"))
        failure = None
        try:
            self._files.write_state(checkpoint, arrays)
        except OSError as error:  # still join the barrier, or peers hang
            failure = error
        # Once this collective returns every task has written its file, so
        # the chief's pointer never names an incomplete backup.
        written = _sum_over_replicas(strategy, 0.0 if failure else 1.0)
        if failure is not None:
            raise failure
        if written != strategy.num_replicas_in_sync:
            raise RuntimeError(
                f"Backup {checkpoint}: another worker could not write its "
                f"file in {self.backup_dir!r} (see its error); the previous "
                "backup stays the latest."
            )
        if self._task.is_chief:
            self._files.write_pointer(
                checkpoint, epoch, step, strategy.num_replicas_in_sync, self.params.get("steps"),
                shards=resizing.sharded_positions(self.model),
            )
        # The pointer names `checkpoint` or, if the chief has not renamed
        # it yet, `checkpoint - 1` (published before this save's barrier).
        self._files.remove_states_older_than(checkpoint - 1)

    def _restore(self, pointer):
        """Restores the backup `pointer` names; `fit` resumes where it was
        taken."""
        strategy = self.model.distribute_strategy
        pointer["step"] = _resumed_step(pointer, self.params.get("steps"))
        if (pointer["tasks"], pointer["num_replicas_in_sync"]) == (
            self._task.all_names, strategy.num_replicas_in_sync
        ):
            arrays = self._files.read_state(pointer["checkpoint"])
            assign_local_copies(strategy, self._state_variables(), arrays, "state")
            self._metric_arrays = arrays
        else:
            # Another cluster shape: every old task's file, shared out anew.
            task_arrays = [
                self._files.read_state(pointer["checkpoint"], name) for name in pointer["tasks"]
            ]
            resizing.restore(self.model, task_arrays, pointer, strategy.num_replicas_in_sync)
            if self._task.is_chief:
                print(
                    f"BackupAndRestore: resized from {pointer['num_replicas_in_sync']} "
                    f"replicas to {strategy.num_replicas_in_sync}, resuming at epoch "
                    f"{pointer['epoch']}, step {pointer['step']}.",
                    flush=True,
                )
            self._metric_arrays = resizing.metric_values(
                self.model, task_arrays, pointer, strategy.num_replicas_in_sync
            )
        self._next_checkpoint = pointer["checkpoint"] + 1
        _compat.set_initial_epoch(self.model, pointer["epoch"])
        if pointer["step"]:
            self._batch_skipper = _BatchSkipper(self.model, pointer["step"])


# Numbers the fits that watch for notices, alike on every worker.
_FITS = itertools.count()


def _resumed_step(pointer, steps_per_epoch):
    """The step at which as much of the epoch's data has passed as at the
    backup; warns where the global batch changed."""
    saved = pointer.get("steps_per_epoch")
    if not saved or not steps_per_epoch or saved == steps_per_epoch:
        return pointer["step"]
    step = pointer["step"] * steps_per_epoch // saved
    warnings.warn(
        f"Resuming a run of {saved} steps per epoch with {steps_per_epoch}: the "
        f"global batch is about {saved / steps_per_epoch:.3g} times the old one, so "
        "each step averages the gradient over another number of examples. Keep the "
        "global batch (the batch per replica times the replicas) to train as before, "
        "or scale the learning rate with it. The interrupted epoch resumes at step "
        f"{step} (was {pointer['step']}).",
        stacklevel=3,
    )
    return step


class _BatchSkipper:
    """Makes `fit`'s next `steps` batches of `model` pass without training
    (drawn from the iterator, no logs)."""

    def __init__(self, model, steps):
        self._model = model
        self._train_function = model.train_function
        self._per_call = model.steps_per_execution
        self._remaining = steps
        self._skipping = True
        # Keras's `fit` has no argument for a first step. After
        # `on_train_begin`, it calls `model.train_function(iterator)` once per
        # `steps_per_execution` batches: this wrapper takes their place.
        model.train_function = self._skip_or_train

    def stop(self):
        """Puts the model's own train function back, if not done yet."""
        if self._skipping:
            self._model.train_function = self._train_function
            self._skipping = False

    def _skip_or_train(self, iterator):
        if self._remaining <= 0:
            return self._train_function(iterator)
        for _ in range(min(self._per_call, self._remaining)):
            next(iterator)
        self._remaining -= self._per_call
        if self._remaining <= 0:
            self.stop()
        return {}


def _sum_over_replicas(strategy, value):
    """The sum of `value` over every replica of every worker: a collective
    that returns only once every worker has called it."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(value, tf.float32)
    )
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))
