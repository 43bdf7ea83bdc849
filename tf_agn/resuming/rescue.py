"""Rescues: the last step the survivors of a lost worker completed, saved
by the survivors, so that the restarted job resumes there rather than at
the last backup.

Each worker of a multi-worker job keeps its last two completed steps'
state in host memory (`StepSnapshots`, taken by
`tf_agn.callbacks.BackupAndRestore` after every step). When one of its
collectives fails, because a peer died or hung and the launcher (or
TensorFlow's health check) aborted the others' collectives, the worker
writes both snapshots as rescue files before the error leaves `fit`, and
exits. A step is never applied on some workers only: the restarted job
puts every worker at one step that a survivor saved (`find`). The
survivors may be one step apart, since a ring all-reduce can finish on one
worker and not yet on another: the one behind takes the other's state of
that step, or, where replicas hold state of their own, the one ahead goes
back to the step before, which it kept too.

A lost worker's own state goes with it. Its copy of what every replica
holds alike (synchronous weights, the optimizer's state) is any
survivor's. Its BatchNorm statistics are a survivor's, as Keras's own
`save` keeps replica 0's, and so are its metrics' totals, which only the
interrupted epoch's logs read. Its part of sharded optimizer state is cut
from the survivors' peer copies: with each snapshot, every worker gathers
every replica's part (`gather_parts`), so a step costs, on top of its own
exchange, (n - 1)/n of the sharded state received per worker (8Ψ(n - 1)/n
bytes for Adam's moments of Ψ float32 parameters), and each snapshot holds
the whole state. State that only the lost worker held and nobody copies (a
window's local steps, gradient accumulators, error feedback residuals) no
survivor has: then the rescue is not used and the job resumes from the last
backup, saying why.
"""

import collections
import typing

import numpy as np
import tensorflow as tf

from tf_agn.optimizers import saving
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.resuming.backup_files import BackupFiles
from tf_agn.resuming.replica_state import tf_variable

# The prefix of a snapshot's gathered parts of sharded state, one flat array
# per dtype (`gather_parts`).
_PEER = "peer/"


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


def gather_parts(strategy, variables) -> dict:
    """Every replica's part of the sharded state `variables`, gathered from
    every worker: {"peer/<dtype>": one flat array, replica after replica
    (in the order of `strategy.gather`), each replica's parts in
    `variables`' order}.

    Raises:
        tf.errors.OpError: if a peer is lost meanwhile.
    """
    local = len(strategy.extended.worker_devices)
    gathered = {}
    for dtype in sorted({tf.as_dtype(v.dtype).name for v in variables}):
        group = [v for v in variables if tf.as_dtype(v.dtype).name == dtype]

        def parts(context, group=group):
            index = context.replica_id_in_sync_group % local
            return tf.concat([
                tf.reshape(strategy.experimental_local_results(tf_variable(v))[index], [-1])
                for v in group
            ], 0)

        per_replica = strategy.experimental_distribute_values_from_function(parts)
        gathered[_PEER + dtype] = strategy.gather(per_replica, axis=0).numpy()
    return gathered


def _lost_parts(survivor, positions, replicas):
    """A lost task's copies of the sharded state at `positions` (its
    "state/<position>/<local replica>" arrays, for global `replicas`), cut
    from a survivor's arrays and their `gather_parts`."""
    cut = {}
    by_dtype = collections.defaultdict(list)
    for position in positions:
        by_dtype[tf.as_dtype(survivor[f"state/{position}/0"].dtype).name].append(position)
    for dtype, group in by_dtype.items():
        flat = survivor[_PEER + dtype]
        shapes = [survivor[f"state/{position}/0"].shape for position in group]
        per_replica = sum(int(np.prod(shape)) for shape in shapes)
        for local, replica in enumerate(replicas):
            offset = replica * per_replica
            for position, shape in zip(group, shapes):
                size = int(np.prod(shape))
                cut[f"state/{position}/{local}"] = flat[offset:offset + size].reshape(shape)
                offset += size
    return cut


def own_state(model, peer_copies=False) -> list[str]:
    """What each replica of `model` holds of its own that a lost worker's
    survivors cannot give back, in words (empty if nothing); with
    `peer_copies`, sharded state is not among it."""
    optimizer = model.optimizer
    if optimizer is None:
        return []
    found = []
    if isinstance(optimizer, WindowedOptimizer):
        found.append(f"its local steps in {type(optimizer).__name__}'s window")
    for aggregating in saving.aggregating_within(optimizer):
        if aggregating.shards and not peer_copies:
            found.append("its part of the sharded optimizer state")
        if aggregating.summed_variables():
            found.append("its gradient accumulators")
        if aggregating.compressor_state() is not None:
            found.append("its compressor state (error feedback residuals)")
    return found


def find(files: BackupFiles, after: dict | None, model, say: bool) -> Rescue | None:
    """The rescue a restarted job resumes from, if one is newer than the
    backup `after` (a pointer, or None) and usable.

    That is the latest step any survivor saved, whose state every task
    that did not save it (lost, or a step behind) takes from one that did;
    or, where each replica holds state of its own that nobody copies
    (`own_state`), the latest step every task saved.

    Args:
        files: the backup directory's files.
        after: the latest backup's pointer, or None.
        model: the model being restored, whose optimizer tells what state
            a lost worker took with it.
        say: whether to print which rescue is used, or why none.
    """
    by_step = files.rescues()
    newer = sorted(
        (key for key in by_step if after is None or key > (after["epoch"], after["step"])),
        reverse=True,
    )
    if not newer:
        return None
    pointer, names = files.read_rescue_pointer(next(iter(by_step[newer[0]].values())))
    unrecoverable = own_state(model, peer_copies=any(n.startswith(_PEER) for n in names))
    tasks = set(pointer["tasks"])
    chosen = next(
        (key for key in newer if not unrecoverable or set(by_step[key]) == tasks), None
    )
    lost = sorted(tasks - set().union(*by_step.values()))
    if chosen is None:
        if say:
            print(
                f"BackupAndRestore: {', '.join(lost)} lost {'; '.join(unrecoverable)}; "
                f"the survivors' rescue at epoch {newer[0][0]}, step {newer[0][1]} cannot "
                "be used: resuming from the last backup.",
                flush=True,
            )
        return None
    found = by_step[chosen]
    read = {task: files.read_rescue(path) for task, path in found.items()}
    pointer, survivor = read[min(found)]
    if say:
        others = [f"{', '.join(lost)} lost"] if lost else []
        behind = sorted(tasks - set(found) - set(lost))
        if behind:
            others.append(f"{', '.join(behind)} a step behind")
        print(
            f"BackupAndRestore: resuming at epoch {chosen[0]}, step {chosen[1]}, the last "
            "step the survivors completed, from their rescue"
            + (f" ({'; '.join(others)})." if others else "."),
            flush=True,
        )
    per_task = pointer["num_replicas_in_sync"] // len(pointer["tasks"])

    def arrays_of(task):
        if task in read:
            return read[task][1]
        first = pointer["tasks"].index(task) * per_task
        replicas = range(first, first + per_task)
        return dict(survivor, **_lost_parts(survivor, pointer["shards"], replicas))

    return Rescue(pointer, arrays_of)
