"""`BackupAndRestore`: fault-tolerant `fit` for one process or many workers
sharing one backup directory, restoring every replica's own state."""

import atexit
import functools
import itertools
import os
import signal
import warnings

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn.resuming import rescue as rescue_lib
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

    When a worker is lost (killed, or hung and killed by its supervisor),
    the others save the last step they completed as it fails their
    collectives, and the restarted job resumes there rather than at the
    last backup (`tf_agn.resuming.rescue` says what a lost worker's own
    state becomes).

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
        keep_last_steps: whether each worker of a multi-worker job keeps
            its last two completed steps in host memory (twice its training
            state, and every replica's copy of what each holds of its
            own), for its rescue when a peer is lost; with sharded
            optimizer state, gradient accumulation or compressor state,
            every step then gathers every replica's copy of it
            (`tf_agn.resuming.rescue`).

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
        preemption_notice=signal.SIGTERM, keep_last_steps=True,
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
        self.keep_last_steps = bool(keep_last_steps)
        os.makedirs(self.backup_dir, exist_ok=True)
        if not os.access(self.backup_dir, os.W_OK | os.X_OK):
            raise PermissionError(
                f"BackupAndRestore cannot write to backup_dir {self.backup_dir!r}."
            )
        self._restored = None  # the pointer restored from, if any
        self._metric_arrays = None  # the restored epoch's metrics, until it begins
        self._batch_skipper = None
        self._preemption = None
        self._snapshots = None  # with keep_last_steps on several workers
        self._peer_positions = None  # rescue_lib.peer_positions, once a fit
        self._rescuer = None

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "delete_checkpoint": self.delete_checkpoint,
            "preemption_notice": self.preemption_notice,
            "keep_last_steps": self.keep_last_steps,
        }

    # Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model: call it on a batch of "
                "data or build it before fit()."
            )
        strategy = self.model.distribute_strategy
        _TrainFunctionWrapper.remove_all(self.model)  # left by a fit that raised
        atexit.unregister(self._rescue_at_exit)  # likewise
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
        rescue = rescue_lib.find(self._files, self._restored, self.model, self._task.is_chief)
        if rescue is not None:
            self._restore(rescue.pointer, rescue.read)
        elif self._restored is not None:
            checkpoint = self._restored["checkpoint"]
            self._restore(self._restored, functools.partial(self._files.read_state, checkpoint))
        if self._files.rescues():
            self._retire_rescues(rescue)
        if self.keep_last_steps and len(self._task.all_names) > 1:
            self._snapshots = rescue_lib.StepSnapshots()
            self._peer_positions = None  # found after the first step
            self._rescuer = _Rescuer(self.model, self._write_rescue)
            atexit.register(self._rescue_at_exit)
        if self._restored is not None and self._restored["step"]:
            self._batch_skipper = _BatchSkipper(self.model, self._restored["step"])

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
        saving = preempted or (
            self.save_freq != "epoch" and self._steps_since_save >= self.save_freq
        )
        if not saving and self._snapshots is None:
            return
        epoch, step = (self._epoch + 1, 0) if step == self.params.get("steps") else (
            self._epoch, step
        )
        arrays = self._arrays()
        if self._snapshots is not None:
            pointer = self._pointer(self._next_checkpoint - 1, epoch, step)
            self._snapshots.take(pointer, dict(arrays, **self._peer_copies()))
        if saving:
            self._steps_since_save = 0
            self._save(epoch, step, arrays)
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
        for wrapper in (self._batch_skipper, self._rescuer):
            if wrapper is not None:
                wrapper.stop()
        self._batch_skipper = self._rescuer = self._snapshots = None
        atexit.unregister(self._rescue_at_exit)
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

    def _arrays(self):
        """This task's copies of the training state and the metrics."""
        strategy = self.model.distribute_strategy
        arrays = local_copies(strategy, self._state_variables(), "state")
        arrays.update(local_copies(strategy, self.model.metrics_variables, "metrics"))
        return arrays

    def _peer_copies(self):
        """Every replica's copy of the state each holds of its own."""
        # Once a fit, after its first step: by then the optimizer has made
        # all its state (compressor state is made as the first step runs).
        if self._peer_positions is None:
            self._peer_positions = rescue_lib.peer_positions(self.model)
        positions = self._peer_positions
        if not positions:
            return {}
        try:
            return rescue_lib.gather_parts(
                self.model.distribute_strategy, self._state_variables(), positions
            )
        except tf.errors.OpError:  # a peer was lost
            self._write_rescue()
            raise

    def _pointer(self, checkpoint, epoch, step):
        return self._files.pointer(
            checkpoint, epoch, step, self.model.distribute_strategy.num_replicas_in_sync,
            self.params.get("steps"), shards=resizing.sharded_positions(self.model),
        )

    def _save(self, epoch, step, arrays=None):
        """Backs up the training state (`arrays`, else this task's copies
        now), to resume at `step` of `epoch`."""
        strategy = self.model.distribute_strategy
        checkpoint = self._next_checkpoint
        self._next_checkpoint += 1
        arrays = self._arrays() if arrays is None else arrays
        failure = None
        try:
            self._files.write_state(checkpoint, arrays)
        except OSError as error:  # still join the barrier, or peers hang
            failure = error
        # Once this collective returns every task has written its file, so
        # the chief's pointer never names an incomplete backup.
        try:
            written = _sum_over_replicas(strategy, 0.0 if failure else 1.0)
        except tf.errors.OpError:  # a peer was lost
            self._write_rescue()
            raise
        if failure is not None:
            raise failure
        if written != strategy.num_replicas_in_sync:
            raise RuntimeError(
                f"Backup {checkpoint}: another worker could not write its "
                f"file in {self.backup_dir!r} (see its error); the previous "
                "backup stays the latest."
            )
        if self._task.is_chief:
            self._files.write_pointer(self._pointer(checkpoint, epoch, step))
        # The pointer names `checkpoint` or, if the chief has not renamed
        # it yet, `checkpoint - 1` (published before this save's barrier).
        self._files.remove_states_older_than(checkpoint - 1)

    def _restore(self, pointer, read):
        """Restores the state `pointer` names, each old task's arrays given
        by `read(task name)`; `fit` resumes where it was taken."""
        strategy = self.model.distribute_strategy
        pointer["step"] = _resumed_step(pointer, self.params.get("steps"))
        if (pointer["tasks"], pointer["num_replicas_in_sync"]) == (
            self._task.all_names, strategy.num_replicas_in_sync
        ):
            arrays = read(self._task.name)
            assign_local_copies(strategy, self._state_variables(), arrays, "state")
            self._metric_arrays = arrays
        else:
            # Another cluster shape: every old task's file, shared out anew.
            task_arrays = [read(name) for name in pointer["tasks"]]
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
        self._restored = pointer
        self._next_checkpoint = pointer["checkpoint"] + 1
        _compat.set_initial_epoch(self.model, pointer["epoch"])

    def _retire_rescues(self, rescue):
        """Once every task has restored: publishes the rescued state as a
        backup, if it was used, and removes every rescue file."""
        if rescue is None:
            _sum_over_replicas(self.model.distribute_strategy, 1.0)  # a barrier
        else:
            arrays = self._arrays()
            if isinstance(self._metric_arrays, dict):  # restored in on_epoch_begin
                arrays.update({k: v for k, v in self._metric_arrays.items()
                               if k.startswith("metrics/")})
            self._save(rescue.pointer["epoch"], rescue.pointer["step"], arrays)
        if self._task.is_chief:
            self._files.remove_rescues()

    def _write_rescue(self, why="a collective failed (a peer lost?)"):
        """Writes this worker's last completed steps, once, for the
        restarted job."""
        snapshots, self._snapshots = self._snapshots, None
        try:
            written = snapshots.write(self._files) if snapshots else []
        except OSError as error:
            print(f"BackupAndRestore: could not write a rescue: {error}", flush=True)
            return
        if written:
            last = written[-1].pointer
            print(
                f"BackupAndRestore: {why}; saved the last steps this worker completed, "
                f"up to epoch {last['epoch']}, step {last['step']}, for the restarted job.",
                flush=True,
            )

    def _rescue_at_exit(self):
        """Registered with `atexit` while `fit` runs on several workers: a
        fit that left by an error raised outside the steps (Keras reading
        the metrics at an epoch's end is a collective too, and so is
        validation) still leaves its rescue as the process exits."""
        self._write_rescue("fit left with an error")


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


class _TrainFunctionWrapper:
    """Takes the place of `model.train_function` until `stop`: after
    `on_train_begin`, Keras's `fit` calls `model.train_function(iterator)`
    once per `steps_per_execution` batches."""

    def __init__(self, model):
        self._model = model
        self.wrapped = model.train_function
        self._active = True
        model.train_function = self

    def stop(self):
        """Puts back the function it wrapped, if not done yet."""
        if self._active:
            self._model.train_function = self.wrapped
            self._active = False

    @staticmethod
    def remove_all(model):
        """Puts back `model`'s own train function."""
        while isinstance(model.train_function, _TrainFunctionWrapper):
            model.train_function = model.train_function.wrapped


class _BatchSkipper(_TrainFunctionWrapper):
    """Makes `fit`'s next `steps` batches of `model` pass without training
    (drawn from the iterator, no logs): Keras's `fit` has no argument for a
    first step."""

    def __init__(self, model, steps):
        super().__init__(model)
        self._per_call = model.steps_per_execution
        self._remaining = steps

    def __call__(self, iterator):
        if self._remaining <= 0:
            return self.wrapped(iterator)
        for _ in range(min(self._per_call, self._remaining)):
            next(iterator)
        self._remaining -= self._per_call
        if self._remaining <= 0:
            self.stop()
        return {}


class _Rescuer(_TrainFunctionWrapper):
    """Calls `rescue()` when a step's collective fails, then raises on."""

    def __init__(self, model, rescue):
        super().__init__(model)
        self._rescue = rescue

    def __call__(self, iterator):
        try:
            return self.wrapped(iterator)
        except tf.errors.OpError:
            self._rescue()
            raise


def _sum_over_replicas(strategy, value):
    """The sum of `value` over every replica of every worker: a collective
    that returns only once every worker has called it."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(value, tf.float32)
    )
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))
