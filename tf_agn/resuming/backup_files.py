"""The files of a `BackupAndRestore` directory, each task's written atomically:
backups, the pointer to the latest, and survivors' rescues."""

import json
import os
import re

import numpy as np

# The file that names the latest complete backup; written last, by the chief.
POINTER = "latest.json"
# 2: the pointer names the sharded state variables ("shards").
_FORMAT = 2
# Each task writes its own files: Keras's workers all write one
# `latest.weights.h5` and clash on a shared filesystem.
_STATE_FILE = re.compile(r"^ckpt-(\d+)\.(.+)\.npz(\.tmp)?$")
# A survivor's state after step <step> of epoch <epoch> (`tf_agn.resuming.rescue`).
_RESCUE_FILE = re.compile(r"^rescue-(\d+)-(\d+)\.(.+)\.npz(\.tmp)?$")
# The key of the pointer (as JSON) among a rescue file's arrays.
_RESCUE_POINTER = "rescue/pointer"


class Task:
    """This process's task: its `name` ("worker-1"), whether it `is_chief`
    (writes the pointer: the chief task, else worker 0), and `all_names`,
    chief first."""

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
    """The files `task` reads and writes in `backup_dir`: its own
    `ckpt-<n>.<task>.npz` and `rescue-<epoch>-<step>.<task>.npz`, and for
    the chief the pointer naming the latest complete backup."""

    def __init__(self, backup_dir, task):
        self._backup_dir = backup_dir
        self._task = task
        self._pointer = os.path.join(backup_dir, POINTER)

    def read_pointer(self):
        """The dict `write_pointer` wrote, or None; raises ValueError for
        another format."""
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

    def pointer(
        self, checkpoint, epoch, step, num_replicas_in_sync, steps_per_epoch=None,
        shards=(),
    ):
        """The pointer to backup `checkpoint`, which resumes at `step` of
        `epoch`; `shards` lists the positions of sharded state variables."""
        return {
            "format": _FORMAT,
            "checkpoint": checkpoint,
            "epoch": epoch,
            "step": step,
            "tasks": self._task.all_names,
            "num_replicas_in_sync": num_replicas_in_sync,
            "steps_per_epoch": steps_per_epoch,
            "shards": list(shards),
        }

    def write_pointer(self, pointer):
        """Publishes the backup that `pointer` (a dict from `pointer()`) names."""
        _write_atomically(self._pointer, lambda f: f.write(json.dumps(pointer).encode()))

    def write_state(self, checkpoint, arrays):
        """Writes this task's file of backup `checkpoint`: named numpy arrays."""
        _write_atomically(self._state_path(checkpoint), lambda f: np.savez(f, **arrays))

    def read_state(self, checkpoint, task_name=None):
        """The named arrays of this task's (or `task_name`'s) file of backup
        `checkpoint`."""
        path = self._state_path(checkpoint, task_name)
        try:
            with np.load(path) as npz:
                return dict(npz)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self._pointer} names {path}, which is missing: was the "
                "backup directory changed by hand?"
            ) from None

    def write_rescue(self, pointer, arrays):
        """Writes this task's rescue: `arrays` as `write_state` takes them,
        with `pointer`, which says where they resume."""
        name = f"rescue-{pointer['epoch']}-{pointer['step']}.{self._task.name}.npz"
        arrays = dict(arrays, **{_RESCUE_POINTER: np.array(json.dumps(pointer))})
        _write_atomically(os.path.join(self._backup_dir, name), lambda f: np.savez(f, **arrays))

    def rescues(self):
        """{(epoch, step): {task name: path}} of every task's whole rescue files."""
        found = {}
        for name in os.listdir(self._backup_dir):
            match = _RESCUE_FILE.match(name)
            if match and not match.group(4):
                key = (int(match.group(1)), int(match.group(2)))
                found.setdefault(key, {})[match.group(3)] = os.path.join(self._backup_dir, name)
        return found

    @staticmethod
    def read_rescue(path):
        """(pointer, arrays) of the rescue file `path`."""
        with np.load(path) as npz:
            arrays = dict(npz)
        return json.loads(str(arrays.pop(_RESCUE_POINTER))), arrays

    @staticmethod
    def read_rescue_pointer(path):
        """(pointer, the names of its arrays) of the rescue file `path`,
        without reading the arrays."""
        with np.load(path) as npz:
            return json.loads(str(npz[_RESCUE_POINTER])), npz.files

    def remove_rescues(self):
        """Removes every task's rescue files."""
        for paths in self.rescues().values():
            for path in paths.values():
                os.remove(path)

    def remove_states_older_than(self, checkpoint):
        """Removes this task's files of the backups before `checkpoint`."""
        for path in self._own_files():
            if _STATE_FILE.match(os.path.basename(path)) and _checkpoint_of(path) < checkpoint:
                os.remove(path)

    def remove_temporary_files(self):
        """Removes the half-written files a dead process of this task left."""
        for path in self._own_files():
            if path.endswith(".tmp"):
                os.remove(path)

    def delete_backup(self):
        """Removes every task's files, the pointer, and the directory if empty."""
        # The pointer first: a crash midway leaves no pointer to missing files.
        if os.path.exists(self._pointer):
            os.remove(self._pointer)
        for name in os.listdir(self._backup_dir):
            if _STATE_FILE.match(name) or _RESCUE_FILE.match(name) or name == POINTER + ".tmp":
                os.remove(os.path.join(self._backup_dir, name))
        if not os.listdir(self._backup_dir):
            os.rmdir(self._backup_dir)

    def _state_path(self, checkpoint, task_name=None):
        name = task_name or self._task.name
        return os.path.join(self._backup_dir, f"ckpt-{checkpoint}.{name}.npz")

    def _own_files(self):
        return [
            os.path.join(self._backup_dir, name)
            for name in os.listdir(self._backup_dir)
            if _task_of(name) == self._task.name
        ]


def _write_atomically(path, write):
    """Writes `path` with `write(file)`: old content or all of the new."""
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
    return int(_STATE_FILE.match(os.path.basename(path)).group(1))


def _task_of(name):
    match = _STATE_FILE.match(name)
    if match:
        return match.group(2)
    match = _RESCUE_FILE.match(name)
    return match.group(3) if match else None
