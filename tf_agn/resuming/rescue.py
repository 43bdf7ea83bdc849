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
interrupted epoch's logs read. What each replica holds of its own (`peer_
positions`: its part of sharded optimizer state, its gradient accumulators,
its compressor state such as error feedback residuals) is cut from the
survivors' peer copies: with each snapshot, every worker gathers every
replica's copy (`gather_parts`). A step then costs, on top of its own
exchange, every other replica's copy received per worker: (n - 1)/n of the
sharded state (8Ψ(n - 1)/n bytes for Adam's moments of Ψ float32
parameters), n - 1 times the accumulators and residuals (4Ψ(n - 1) bytes
each, more than the step's own all-reduce), and each snapshot holds them
all. A window's local steps (AGN, Streaming DiLoCo) no survivor has: then
the rescue is not used and the job resumes from the last backup, saying
why.
"""

import collections
import typing

import numpy as np
import tensorflow as tf

from tf_agn.optimizers import saving
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.resuming import resizing
from tf_agn.resuming.backup_files import BackupFiles
from tf_agn.resuming.replica_state import tf_variable

# The prefix of a snapshot's peer copies (`gather_parts`): one flat array
# per dtype, and the positions they copy.
_PEER = "peer/"
_PEER_POSITIONS = _PEER + "positions"


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


def peer_positions(model) -> list[int]:
    """The positions, among a backup's state variables (the model's, then
    its optimizer's), of the state each replica holds of its own: its part
    of sharded optimizer state, its gradient accumulators and its
    compressor state."""
    optimizer = model.optimizer
    if optimizer is None:
        return []
    own = set()
    for aggregating in saving.aggregating_within(optimizer):
        own.update(id(v) for v in aggregating.summed_variables())
        compressor_state = aggregating.compressor_state()
        if compressor_state is not None:
            own.update(id(v) for state in compressor_state[1] for v in state.values())
    first = len(model.variables)
    return sorted(set(resizing.sharded_positions(model)) | {
        first + index for index, v in enumerate(optimizer.variables) if id(v) in own
    })


def gather_parts(strategy, state_variables, positions) -> dict:
    """Every replica's copy of the state at `positions` of
    `state_variables`, gathered from every worker: {"peer/<dtype>": one
    flat array, replica after replica (in the order of `strategy.gather`),
    each replica's copies in `positions`' order; "peer/positions":
    `positions`}.

    Raises:
        tf.errors.OpError: if a peer is lost meanwhile.
    """
    local = len(strategy.extended.worker_devices)
    variables = [state_variables[p] for p in positions]
    gathered = {_PEER_POSITIONS: np.array(positions, np.int64)}
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
    positions = [int(p) for p in positions]
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
    `peer_copies`, only a window's local steps."""
    optimizer = model.optimizer
    if optimizer is None:
        return []
    found = []
    if isinstance(optimizer, WindowedOptimizer):
        found.append(f"its local steps in {type(optimizer).__name__}'s window")
    if peer_copies:
        return found
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
        return dict(survivor, **_lost_parts(survivor, survivor.get(_PEER_POSITIONS, []), replicas))

    return Rescue(pointer, arrays_of)
