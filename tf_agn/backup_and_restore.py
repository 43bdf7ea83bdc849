"""`BackupAndRestore`: fault-tolerant `fit` for one process or many workers
sharing one backup directory, restoring every replica's own state."""

import json
import os
import re

import keras
import numpy as np
import tensorflow as tf

from tf_agn import _compat

# The file that names the latest complete backup; written last, by the chief.
POINTER = "latest.json"
_FORMAT = 1
_CHECKPOINT = re.compile(r"^ckpt-(\d+)\.(.+)\.npz(\.tmp)?$")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state and resumes `fit` from it, exactly.

    A drop-in for `keras.callbacks.BackupAndRestore` that also works when
    several workers (`tf_agn.strategies.multi_worker_mirrored`) share one
    backup directory, and that restores what Keras's cannot:

    - **One writer per file.** Keras's callback has every worker write the
      same `latest.weights.h5`; two workers on one filesystem clash
      (`BlockingIOError: unable to lock file`) or overwrite each other.
      Here each task (worker or chief) writes only its own state file, and
      only the chief (worker 0, or the "chief" task) writes the shared
      pointer `latest.json`, after every task's file is complete.
    - **Atomic.** Every file is written under a temporary name in the same
      directory, flushed to disk (`fsync`) and renamed (`os.replace`). A
      collective among all replicas (a `strategy.reduce` SUM of a 1 from
      each) makes sure every task has finished writing before the chief
      renames the pointer, so the pointer never names an incomplete
      backup, whenever a process dies. The previous backup stays on disk
      until the next one is published.
    - **Every replica's own state.** Keras saves a `MirroredVariable` as
      replica 0's copy. With tf_agn's local steps (`AGN` and the other
      windowed optimizers mid-window, aggregation NONE) the replicas'
      weights and inner optimizer state (AGN's inner Adam moments) differ.
      Each task saves its own replicas' copies of the model's variables,
      of all of `model.optimizer.variables` and of the metrics, and puts
      each copy back on its replica.
    - **Mid-epoch resume.** With an int `save_freq`, the backup records
      the step within the epoch. On restore, `fit` starts at the saved
      epoch (as Keras's callback does) and the batches that epoch already
      trained are drawn from the data and skipped without training, so at
      most `save_freq` steps are redone and the run continues as if it had
      never stopped. (Keras has no argument for a first step: until those
      batches have passed, `model.train_function` is a wrapper that draws
      them from the iterator.) Skipped batches still reach other
      callbacks' `on_train_batch_*` hooks, with empty logs; the epoch's
      logs cover all its batches, the metrics being restored too.

    A resumed run equals an uninterrupted one when every epoch feeds the
    same batches in the same order (`shuffle=False`, or a dataset with a
    fixed seed that does not reshuffle per epoch) and the model, optimizer
    and `fit` arguments are the same. Communication counters
    (`communication_stats`) restart from zero.

    Restarting is the job of a supervisor: `python -m
    tf_agn.strategies.launch --multi_worker N --max_restarts K` on one
    machine, systemd or Kubernetes on several (every worker reading the
    same directory on a shared filesystem). A backup names the cluster
    it was taken on: restoring it with another number of workers or
    replicas raises a `ValueError`.

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
            ends normally; False keeps it (a later `fit` then resumes from
            it, as with Keras's callback).

    Raises:
        ValueError: for an empty `backup_dir` or a `save_freq` that is
            neither "epoch" nor an int >= 1; from `fit`, for a backup taken
            from another model, optimizer or cluster shape.
        OSError: if `backup_dir` cannot be created or written to (e.g.
            `NotADirectoryError`, `PermissionError`); from `fit`, if a
            backup cannot be written or the pointer names a missing file.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
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
        os.makedirs(self.backup_dir, exist_ok=True)
        if not os.access(self.backup_dir, os.W_OK | os.X_OK):
            raise PermissionError(
                f"BackupAndRestore cannot write to backup_dir {self.backup_dir!r}."
            )
        self._restored = None  # the pointer restored from, if any
        self._metric_arrays = None  # the restored epoch's metrics, until it begins
        self._original_train_function = None

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "delete_checkpoint": self.delete_checkpoint,
        }

    # Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model: call it on a batch of "
                "data or build it before fit()."
            )
        strategy = self.model.distribute_strategy
        self._task = _Task.of(strategy)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self._remove_own_temporary_files()
        self._epoch, self._step, self._steps_since_save = 0, 0, 0
        self._next_checkpoint = 0
        pointer = _read_pointer(self.backup_dir)
        self._restored = pointer
        if pointer is None:
            return
        self._check_cluster(pointer)
        arrays = self._load(self._path(pointer["checkpoint"], self._task.name))
        _assign_per_replica(strategy, self._state_variables(), arrays, "state")
        self._metric_arrays = arrays
        self._next_checkpoint = pointer["checkpoint"] + 1
        _compat.set_initial_epoch(self.model, pointer["epoch"])
        if pointer["step"]:
            self._skip_trained_batches(pointer["step"])

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._step = epoch, 0
        restored = self._restored
        if restored and epoch == restored["epoch"] and restored["step"]:
            # `fit` reset the metrics just now: put back the interrupted
            # epoch's, so that its logs cover all of its batches.
            self._step = restored["step"]
            _assign_per_replica(
                self.model.distribute_strategy,
                self.model.metrics_variables,
                self._metric_arrays,
                "metrics",
            )
        self._metric_arrays = None

    def on_train_batch_end(self, batch, logs=None):
        step = batch + 1
        if step <= self._step:  # a batch skipped after a restore
            return
        self._steps_since_save += step - self._step
        self._step = step
        if self.save_freq != "epoch" and self._steps_since_save >= self.save_freq:
            self._steps_since_save = 0
            if step == self.params.get("steps"):
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self._stop_skipping()
        _compat.set_initial_epoch(self.model, None)
        self._restored = None
        if self.delete_checkpoint and self._task.is_chief:
            self._delete_backup()

    # Saving --------------------------------------------------------------

    def _state_variables(self):
        """The variables a backup holds but for the metrics, in a fixed
        order: the model's (weights and random seeds), then the
        optimizer's."""
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            variables += list(self.model.optimizer.variables)
        return variables

    def _path(self, checkpoint, task_name):
        return os.path.join(self.backup_dir, f"ckpt-{checkpoint}.{task_name}.npz")

    def _save(self, epoch, step):
        """Every task writes its file; after all have, the chief publishes
        the pointer to them; then each task drops its files older than
        the previous backup."""
        strategy = self.model.distribute_strategy
        checkpoint = self._next_checkpoint
        self._next_checkpoint += 1
        arrays = _local_copies(strategy, self._state_variables(), "state")
        arrays.update(_local_copies(strategy, self.model.metrics_variables, "metrics"))
        path = self._path(checkpoint, self._task.name)
        failure = None
        try:
            _write_atomically(path, lambda f: np.savez(f, **arrays))
        except OSError as error:  # still join the barrier, or peers hang
            failure = error
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
            pointer = {
                "format": _FORMAT,
                "checkpoint": checkpoint,
                "epoch": epoch,
                "step": step,
                "tasks": self._task.all_names,
                "num_replicas_in_sync": strategy.num_replicas_in_sync,
            }
            _write_atomically(
                os.path.join(self.backup_dir, POINTER),
                lambda f: f.write(json.dumps(pointer).encode()),
            )
        # The pointer names `checkpoint` or, if the chief has not renamed
        # it yet, `checkpoint - 1` (published before this save's barrier).
        for old in self._own_files():
            if _checkpoint_of(old) < checkpoint - 1:
                os.remove(old)

    def _own_files(self):
        """This task's backup files, temporary ones included."""
        return [
            os.path.join(self.backup_dir, name)
            for name in os.listdir(self.backup_dir)
            if _task_of(name) == self._task.name
        ]

    def _remove_own_temporary_files(self):
        """Half-written files a dead process of this task left behind."""
        for path in self._own_files():
            if path.endswith(".tmp"):
                os.remove(path)

    def _delete_backup(self):
        """The pointer first: a crash midway leaves no pointer to missing
        files."""
        pointer = os.path.join(self.backup_dir, POINTER)
        if os.path.exists(pointer):
            os.remove(pointer)
        for name in os.listdir(self.backup_dir):
            if _CHECKPOINT.match(name) or name == POINTER + ".tmp":
                os.remove(os.path.join(self.backup_dir, name))
        if not os.listdir(self.backup_dir):
            os.rmdir(self.backup_dir)

    # Restoring -----------------------------------------------------------

    def _check_cluster(self, pointer):
        if pointer.get("format") != _FORMAT:
            raise ValueError(
                f"{os.path.join(self.backup_dir, POINTER)} has format "
                f"{pointer.get('format')!r}; this tf_agn reads {_FORMAT}."
            )
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        if pointer["tasks"] != self._task.all_names or pointer["num_replicas_in_sync"] != replicas:
            raise ValueError(
                f"The backup in {self.backup_dir!r} was taken on tasks "
                f"{pointer['tasks']} with {pointer['num_replicas_in_sync']} "
                f"replicas; this cluster has tasks {self._task.all_names} with "
                f"{replicas}. Restart on the same cluster shape, or delete "
                "the backup to start over."
            )

    def _load(self, path):
        try:
            with np.load(path) as npz:
                return dict(npz)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{os.path.join(self.backup_dir, POINTER)} names {path}, which "
                "is missing: was the backup directory changed by hand?"
            ) from None

    def _skip_trained_batches(self, steps):
        """Makes `fit`'s next `steps` batches pass without training.

        `fit` calls `model.train_function(iterator)` once per
        `steps_per_execution` batches, after `on_train_begin`. Until
        `steps` batches have passed, the function takes them from the
        iterator and returns no logs; then the model's own function is
        back in place.
        """
        train_function = self.model.train_function
        per_call = self.model.steps_per_execution
        remaining = steps

        def skip_or_train(iterator):
            nonlocal remaining
            if remaining <= 0:
                return train_function(iterator)
            for _ in range(min(per_call, remaining)):
                next(iterator)
            remaining -= per_call
            if remaining <= 0:
                self._stop_skipping()
            return {}

        self._original_train_function = train_function
        self.model.train_function = skip_or_train

    def _stop_skipping(self):
        if self._original_train_function is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None


class _Task:
    """Which task of the cluster this process is, and which one writes the
    shared pointer.

    Attributes:
        name: this task's name in file names, e.g. "worker-1".
        is_chief: whether it writes the pointer: the "chief" task, else
            worker 0; a process outside a cluster is its own chief.
        all_names: every task's name, chief first, as
            `MultiWorkerMirroredStrategy` numbers them.
    """

    def __init__(self, name, is_chief, all_names):
        self.name, self.is_chief, self.all_names = name, is_chief, all_names

    @classmethod
    def of(cls, strategy):
        resolver = strategy.cluster_resolver
        jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
        all_names = [f"chief-{i}" for i in range(len(jobs.get("chief", [])))]
        all_names += [f"worker-{i}" for i in range(len(jobs.get("worker", [])))]
        if resolver is None or not resolver.task_type or not all_names:
            return cls("worker-0", True, ["worker-0"])
        name = f"{resolver.task_type}-{int(resolver.task_id)}"
        return cls(name, name == all_names[0], all_names)


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras one (a distributed variable
    under a strategy)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _local_copies(strategy, variables, prefix):
    """This process's replicas' copies of `variables`, as numpy arrays
    named "<prefix>/<variable index>/<local replica>"; a replica's copy is
    left out where it equals local replica 0's."""
    arrays = {}
    for index, variable in enumerate(variables):
        copies = strategy.experimental_local_results(_tf_variable(variable))
        first = copies[0].numpy()
        arrays[f"{prefix}/{index}/0"] = first
        for replica, copy in enumerate(copies[1:], start=1):
            value = copy.numpy()
            if not np.array_equal(value, first):
                arrays[f"{prefix}/{index}/{replica}"] = value
    return arrays


def _assign_per_replica(strategy, variables, arrays, prefix):
    """Puts each of this process's replicas' saved copy back on its copy of
    each variable (replica 0's where the replica's own equalled it).

    Raises:
        ValueError: if the backup holds other variables.
    """
    saved = sum(1 for key in arrays if key.startswith(prefix + "/") and key.endswith("/0"))
    if saved != len(variables):
        raise ValueError(
            f"The backup holds {saved} {prefix} variables; this model has "
            f"{len(variables)}. Was it taken from another model or optimizer?"
        )
    for index, variable in enumerate(variables):
        first = arrays[f"{prefix}/{index}/0"]
        copies = strategy.experimental_local_results(_tf_variable(variable))
        if tuple(first.shape) != tuple(copies[0].shape):
            raise ValueError(
                f"The backup's {prefix} variable {index} has shape "
                f"{first.shape}; this model's ({variable.name}) has "
                f"{tuple(copies[0].shape)}. Was it taken from another model?"
            )
        for replica, copy in enumerate(copies):
            copy.assign(arrays.get(f"{prefix}/{index}/{replica}", first))


def _sum_over_replicas(strategy, value):
    """The sum of `value` over every replica of every worker: a collective
    that returns only once every worker has called it."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(value, tf.float32)
    )
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))


def _write_atomically(path, write):
    """Writes `path` so that it holds either its old content or all of the
    new, whenever the process dies: `write(file)` fills `path + ".tmp"`,
    which is flushed to disk and renamed over `path`."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    # The rename itself reaches the disk with the directory.
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_pointer(backup_dir):
    """The latest complete backup's description, or None if there is none."""
    try:
        with open(os.path.join(backup_dir, POINTER)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _checkpoint_of(path):
    """The number of the backup a file of it belongs to."""
    return int(_CHECKPOINT.match(os.path.basename(path)).group(1))


def _task_of(name):
    """The task that writes the backup file `name`; None for other files."""
    match = _CHECKPOINT.match(name)
    return match.group(2) if match else None
