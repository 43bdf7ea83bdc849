"""Rescues: the last step every survivor of a lost worker completed, saved
by the survivors, so that the restarted job resumes there rather than at
the last backup.

Each worker of a multi-worker job keeps its last two completed steps'
state in host memory (`StepSnapshots`, taken by
`tf_agn.callbacks.BackupAndRestore` after every step). When one of its
collectives fails, because a peer died or hung and the launcher (or
TensorFlow's health check) aborted the others' collectives, the worker
writes both snapshots as rescue files before the error leaves `fit`, and
exits. A step is never applied on some workers only: the restarted job
puts every worker at the latest step that every rescuing worker saved
(`find`). Two snapshots, because a ring all-reduce can finish on one
worker and not yet on another, so the survivors may be one step apart.

A lost worker's own state goes with it. Its copy of what every replica
holds alike (synchronous weights, the optimizer's state) is any
survivor's. Its BatchNorm statistics are a survivor's, as Keras's own
`save` keeps replica 0's, and so are its metrics' totals, which only the
interrupted epoch's logs read. State that only it held (a window's local
steps, its part of sharded optimizer state, gradient accumulators, error
feedback residuals) no survivor has: then the rescue is not used and the
job resumes from the last backup, saying why.
"""

import collections
import typing

from tf_agn.optimizers import saving
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.resuming.backup_files import BackupFiles


class Snapshot(typing.NamedTuple):
    """One completed step: the backup `pointer` that would resume after it
    (`BackupFiles.pointer`) and this task's `arrays` (`local_copies`)."""

    pointer: dict
    arrays: dict


class StepSnapshots:
    """This worker's last two completed steps, in host memory: twice the
    size of its training state (`local_copies`)."""

    def __init__(self):
        self._snapshots = collections.deque(maxlen=2)

    def take(self, pointer: dict, arrays: dict) -> None:
        """Keeps the step after which `pointer` resumes, dropping the oldest."""
        self._snapshots.append(Snapshot(pointer, arrays))

    def write(self, files: BackupFiles) -> list[Snapshot]:
        """Writes every snapshot as this task's rescue, the oldest first
        (a worker killed midway leaves it whole); returns them."""
        for snapshot in self._snapshots:
            files.write_rescue(snapshot.pointer, snapshot.arrays)
        return list(self._snapshots)


class Rescue(typing.NamedTuple):
    """Where a restarted job resumes: the `pointer` of the rescued step,
    and `read(task name)`, each old task's arrays."""

    pointer: dict
    read: typing.Callable[[str], dict]


def own_state(model) -> list[str]:
    """What each replica of `model` holds of its own that a lost worker's
    survivors cannot give back, in words (empty if nothing)."""
    optimizer = model.optimizer
    if optimizer is None:
        return []
    found = []
    if isinstance(optimizer, WindowedOptimizer):
        found.append(f"its local steps in {type(optimizer).__name__}'s window")
    for aggregating in saving.aggregating_within(optimizer):
        if aggregating.shards:
            found.append("its part of the sharded optimizer state")
        if aggregating.summed_variables():
            found.append("its gradient accumulators")
        if aggregating.compressor_state() is not None:
            found.append("its compressor state (error feedback residuals)")
    return found


def find(files: BackupFiles, after: dict | None, model, say: bool) -> Rescue | None:
    """The rescue a restarted job resumes from, if one is newer than the
    backup `after` (a pointer, or None) and whole.

    Args:
        files: the backup directory's files.
        after: the latest backup's pointer, or None.
        model: the model being restored, whose optimizer tells what state
            a lost worker took with it.
        say: whether to print which rescue is used, or why none.
    """
    by_step = files.rescues()
    if not by_step:
        return None
    rescuers = set().union(*by_step.values())
    common = [key for key, found in by_step.items() if set(found) == rescuers]
    if not common or (after is not None and max(common) <= (after["epoch"], after["step"])):
        return None
    found = by_step[max(common)]
    read = {task: files.read_rescue(path) for task, path in found.items()}
    pointer = next(iter(read.values()))[0]
    lost = [task for task in pointer["tasks"] if task not in found]
    where = f"epoch {pointer['epoch']}, step {pointer['step']}"
    if lost and own_state(model):
        if say:
            print(
                f"BackupAndRestore: {', '.join(lost)} lost {'; '.join(own_state(model))}; "
                f"the survivors' rescue at {where} cannot be used: resuming from the "
                "last backup.",
                flush=True,
            )
        return None
    if say:
        print(
            f"BackupAndRestore: resuming at {where}, the last step every survivor "
            f"completed, from their rescue" + (f" ({', '.join(lost)} lost)." if lost else "."),
            flush=True,
        )
    survivor = read[min(found)][1]
    return Rescue(pointer, lambda task: read[task][1] if task in read else survivor)
