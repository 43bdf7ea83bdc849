"""The files of a `tf_agn.callbacks.BackupAndRestore` backup directory:
which task writes each, and how each is written atomically."""

import json
import os
import re

import numpy as np

# The file that names the latest complete backup; written last, by the chief.
POINTER = "latest.json"
# 2: the pointer names the sharded state variables ("sharded_state").
_FORMAT = 2
# Keras's own callback has every worker write the same `latest.weights.h5`:
# two workers on one filesystem clash (`BlockingIOError: unable to lock
# file`) or overwrite each other. Here each task writes files of its own.
_STATE_FILE = re.compile(r"^ckpt-(\d+)\.(.+)\.npz(\.tmp)?$")


class Task:
    """Which task of the cluster this process is, and whether it publishes
    backups.

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
        """The task this process is in `strategy`'s cluster."""
        resolver = strategy.cluster_resolver
        jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
        all_names = [f"chief-{i}" for i in range(len(jobs.get("chief", [])))]
        all_names += [f"worker-{i}" for i in range(len(jobs.get("worker", [])))]
        if resolver is None or not resolver.task_type or not all_names:
            return cls("worker-0", True, ["worker-0"])
        name = f"{resolver.task_type}-{int(resolver.task_id)}"
        return cls(name, name == all_names[0], all_names)


class BackupFiles:
    """The files one task reads and writes in a backup directory.

    Each task writes only its own state files, `ckpt-<n>.<task>.npz`; the
    chief alone writes the pointer, `latest.json`, which names the latest
    complete backup. A reader sees each file's old content or all of the
    new, whenever the writing process dies.

    Args:
        backup_dir: the backup directory, which exists.
        task: this process's `Task`.
    """

    def __init__(self, backup_dir, task):
        self._backup_dir = backup_dir
        self._task = task
        self._pointer = os.path.join(backup_dir, POINTER)

    def read_pointer(self):
        """The latest complete backup's description, or None if there is none.

        Returns:
            A dict with the backup's "checkpoint" number, the "epoch" and
            "step" within it that `fit` resumes from, the "tasks",
            "num_replicas_in_sync" and "steps_per_epoch" (None where `fit`
            did not know it) it was taken with, and "sharded_state": the
            positions of the state variables each replica held a part of.

        Raises:
            ValueError: if the backup is of another format.
        """
        try:
            with open(self._pointer) as f:
                pointer = json.load(f)
        except FileNotFoundError:
            return None
        if pointer.get("format") != _FORMAT:
            raise ValueError(
                f"{self._pointer} has format {pointer.get('format')!r}; this "
                f"tf_agn reads {_FORMAT}."
            )
        return pointer

    def write_pointer(
        self, checkpoint, epoch, step, num_replicas_in_sync, steps_per_epoch=None,
        sharded_state=(),
    ):
        """Publishes backup `checkpoint`, which resumes at `step` of `epoch`;
        `sharded_state` lists the positions of the state variables that
        each replica holds a part of."""
        pointer = {
            "format": _FORMAT,
            "checkpoint": checkpoint,
            "epoch": epoch,
            "step": step,
            "tasks": self._task.all_names,
            "num_replicas_in_sync": num_replicas_in_sync,
            "steps_per_epoch": steps_per_epoch,
            "sharded_state": list(sharded_state),
        }
        _write_atomically(self._pointer, lambda f: f.write(json.dumps(pointer).encode()))

    def write_state(self, checkpoint, arrays):
        """Writes this task's file of backup `checkpoint`: named numpy arrays."""
        _write_atomically(self._state_path(checkpoint), lambda f: np.savez(f, **arrays))

    def read_state(self, checkpoint, task_name=None):
        """The named numpy arrays of a task's file of backup `checkpoint`:
        this task's, or that of the task named `task_name`.

        Raises:
            FileNotFoundError: if the file is missing.
        """
        path = self._state_path(checkpoint, task_name)
        try:
            with np.load(path) as npz:
                return dict(npz)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self._pointer} names {path}, which is missing: was the "
                "backup directory changed by hand?"
            ) from None

    def remove_states_older_than(self, checkpoint):
        """Removes this task's files of the backups before `checkpoint`."""
        for path in self._own_files():
            if _checkpoint_of(path) < checkpoint:
                os.remove(path)

    def remove_temporary_files(self):
        """Removes the half-written files a dead process of this task left."""
        for path in self._own_files():
            if path.endswith(".tmp"):
                os.remove(path)

    def delete_backup(self):
        """Removes every task's files and the pointer, and the directory if
        nothing else is left in it."""
        # The pointer first: a crash midway leaves no pointer to missing files.
        if os.path.exists(self._pointer):
            os.remove(self._pointer)
        for name in os.listdir(self._backup_dir):
            if _STATE_FILE.match(name) or name == POINTER + ".tmp":
                os.remove(os.path.join(self._backup_dir, name))
        if not os.listdir(self._backup_dir):
            os.rmdir(self._backup_dir)

    def _state_path(self, checkpoint, task_name=None):
        name = task_name or self._task.name
        return os.path.join(self._backup_dir, f"ckpt-{checkpoint}.{name}.npz")

    def _own_files(self):
        """This task's state files, temporary ones included."""
        return [
            os.path.join(self._backup_dir, name)
            for name in os.listdir(self._backup_dir)
            if _task_of(name) == self._task.name
        ]


def _write_atomically(path, write):
    """Writes `path` with `write(file)` so that it holds either its old
    content or all of the new, whenever the process dies."""
    # Filled as `path + ".tmp"`, flushed to disk, then renamed over `path`.
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


def _checkpoint_of(path):
    """The number of the backup a state file belongs to."""
    return int(_STATE_FILE.match(os.path.basename(path)).group(1))


def _task_of(name):
    """The task that writes the file `name`; None for other files."""
    match = _STATE_FILE.match(name)
    return match.group(2) if match else None
