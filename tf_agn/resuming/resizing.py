"""Restoring a `tf_agn.callbacks.BackupAndRestore` backup on another number
of replicas or workers than it was taken on.

What every replica holds alike (the weights of synchronous training, the
optimizer's state) is restored as it was. Sharded optimizer state is joined
from every old replica's part and shared out again over the new replicas.
What each replica holds a share of (gradient accumulators, error
feedback residuals, the metrics' totals) keeps its sum: each new replica
takes the old replicas' sum divided by the new number. Non-trainable
weights that the replicas hold apart (BatchNorm's moving statistics) are
replica 0's, as Keras's own `save` keeps them.

A windowed optimizer (AGN and the others) resumes from its last committed
window: every replica's weights are the center, its inner optimizer's step
count goes back to that window's end, and its inner optimizer's state is
the old replicas' mean. The local steps taken since are not committed and
are dropped. Streaming DiLoCo resumes at the backup's step instead, every
replica from the centers, each fragment's last landing; a Δ in flight lands
when due (a slice not yet combined takes the old replicas' mean Δ), and the
local steps since each fragment's last landing are dropped. Trainable weights that differ between replicas (aggregation NONE)
are refused by name.
"""

import warnings

import numpy as np
import tensorflow as tf

from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.optimizers import saving
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.resuming.replica_state import assign_every_copy


def replicas_copies(task_arrays, num_replicas, prefix, index):
    """Every old replica's copy of variable `index`, in global replica
    order.

    Args:
        task_arrays: each old task's backup arrays, in the tasks' order.
        num_replicas: the old replicas in sync, spread evenly over tasks.
        prefix: "state" or "metrics".
        index: the variable's position in the backup.
    """
    per_task = num_replicas // len(task_arrays)
    return [
        arrays.get(f"{prefix}/{index}/{replica}", arrays[f"{prefix}/{index}/0"])
        for arrays in task_arrays
        for replica in range(per_task)
    ]


def sharded_positions(model):
    """The positions, among a backup's state variables (the model's, then
    its optimizer's), of the optimizer state that each replica holds a
    part of."""
    optimizer = model.optimizer
    if optimizer is None:
        return []
    sharded = [found.shards for found in saving.sharded_within(optimizer)]
    return [
        len(model.variables) + index
        for index, variable in enumerate(optimizer.variables)
        if any(state.is_state(variable) for state in sharded)
    ]


def restore(model, task_arrays, pointer, num_replicas):
    """Restores `model`'s weights and optimizer state from a backup taken on
    `pointer["num_replicas_in_sync"]` replicas, onto `num_replicas`.

    Raises:
        ValueError: for a backup of another model, or state that differs
            between replicas and cannot be shared out (named).
    """
    old_replicas = pointer["num_replicas_in_sync"]
    optimizer = model.optimizer
    weights = list(model.variables)
    optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    saved = sum(1 for key in task_arrays[0] if key.startswith("state/") and key.endswith("/0"))
    if saved != len(weights) + len(optimizer_variables):
        raise ValueError(
            f"The backup holds {saved} state variables; this model and "
            f"optimizer have {len(weights) + len(optimizer_variables)}. Was it "
            "taken from another model or optimizer?"
        )

    def copies(index, prefix="state"):
        return replicas_copies(task_arrays, old_replicas, prefix, index)

    # Each optimizer variable's position in the backup.
    position = {id(v): len(weights) + i for i, v in enumerate(optimizer_variables)}
    windowed = isinstance(optimizer, WindowedOptimizer)
    # A windowed optimizer's last committed window: the centers, alike on
    # every replica, stand for the weights.
    centers = {
        id(v): position[id(c)]
        for v, c in zip(model.trainable_variables, optimizer.center_variables)
    } if windowed else {}
    trainable = {id(v) for v in model.trainable_variables}
    for index, variable in enumerate(weights):
        old = copies(centers.get(id(variable), index))
        # Under MirroredStrategy Keras keeps each replica's own BatchNorm
        # statistics (aggregation NONE) and saves replica 0's: so does this.
        variable.assign(_alike(old, variable.path) if id(variable) in trainable else old[0])
    if optimizer is not None:
        shapes = saving.saved_shapes(optimizer)
        within = saving.aggregating_within(optimizer)
        summed = {id(v) for found in within for v in found.summed_variables()}
        averaged = {id(v) for v in optimizer.replica_state_variables()} if windowed else set()
        owed = {}
        for found in within + ([optimizer] if windowed else []):
            owed.update(_owed_values(found, lambda v: copies(position[id(v)]), num_replicas))
        # Which state was sharded when backed up, as the backup says: a part
        # can have the whole variable's shape (a `Dense(1)` bias's, (1,)).
        sharded = set(pointer["shards"])
        values = [
            owed[id(v)] if id(v) in owed else _resized(
                copies(position[id(v)]), shape, num_replicas, v.path,
                sharded=position[id(v)] in sharded, summed=id(v) in summed,
                averaged=id(v) in averaged,
            )
            for v, shape in zip(optimizer_variables, shapes)
        ]
        saving.load_values(optimizer, values)
        # Owed state is "sum"-aggregated, which an assignment in cross-replica
        # context would share out again: each copy takes its value as it is.
        owed_variables = [v for v in optimizer_variables if id(v) in owed]
        assign_every_copy(
            model.distribute_strategy, owed_variables, [owed[id(v)] for v in owed_variables]
        )
        if windowed:
            optimizer.resume_from_centers()
        _warn_if_the_step_changes(optimizer, old_replicas, num_replicas)


def metric_values(model, task_arrays, pointer, num_replicas):
    """What each of `num_replicas` replicas takes of each of `model`'s
    metric variables, from a backup taken on another number: a share of
    the old replicas' sum."""
    old_replicas = pointer["num_replicas_in_sync"]
    values = []
    for index, variable in enumerate(model.metrics_variables):
        copies = replicas_copies(task_arrays, old_replicas, "metrics", index)
        if _all_equal(copies) and not _is_float(copies[0]):
            values.append(copies[0])
        elif _is_float(copies[0]):
            values.append(_share(np.sum(copies, axis=0), num_replicas))
        else:
            values.append(_alike(copies, variable.path))
    return values


def _resized(copies, shape, num_replicas, path, sharded, summed, averaged):
    """The value every new replica takes of an optimizer variable of
    unsharded shape `shape`, from the old replicas' `copies`: each
    replica's part, padded, if `sharded` when backed up."""
    if sharded:
        size = int(np.prod(shape))
        return np.concatenate([np.ravel(c) for c in copies])[:size].reshape(shape)
    if summed:
        return _share(np.sum(copies, axis=0), num_replicas)
    if averaged and _is_float(copies[0]) and not _all_equal(copies):
        return _share(np.sum(copies, axis=0), len(copies))
    return _alike(copies, path)


def _owed_values(optimizer, copies_of, num_replicas):
    """{id(state variable): the value each new replica takes} for
    `optimizer`'s error feedback state: the old replicas' residuals, summed,
    owed in equal shares; the rest of the state as every replica held it."""
    found = optimizer.compressor_state()
    if found is None:
        return {}
    compressor, states = found
    values = {}
    for state in states:
        old = [dict(zip(state, replica)) for replica in zip(*(copies_of(v) for v in state.values()))]
        owed = np.sum([owed_by(compressor, replica) for replica in old], axis=0)
        new = compressor.state_owing(old[0], _share(owed, num_replicas))
        for key, variable in state.items():
            if new[key] is old[0][key]:  # not a part of what is owed
                new[key] = _alike([replica[key] for replica in old], variable.path)
            values[id(variable)] = np.asarray(new[key])
    return values


def owed_by(compressor, state):
    """What a replica with `state` (a dict of arrays) owes, as an array."""
    return np.asarray(compressor.residual({k: tf.convert_to_tensor(v) for k, v in state.items()}))


def _all_equal(copies):
    return all(np.array_equal(c, copies[0]) for c in copies[1:])


def _alike(copies, path):
    """The one value of `copies`, which every replica held alike."""
    if not _all_equal(copies):
        raise ValueError(
            f"The replicas' copies of {path} differ in the backup "
            "(aggregation NONE?): it resumes only on the number of replicas "
            "it was taken on."
        )
    return copies[0]


def _share(total, num_replicas):
    return (total / num_replicas).astype(total.dtype)


def _is_float(value):
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def _warn_if_the_step_changes(optimizer, old_replicas, num_replicas):
    methods = {found.aggregation for found in saving.aggregating_within(optimizer)}
    if isinstance(optimizer, WindowedOptimizer):
        methods.add(optimizer.aggregation)  # the commits'
    if AggregationMethod.SUM in methods:
        warnings.warn(
            f"Resuming a SUM-aggregated run of {old_replicas} replicas on "
            f"{num_replicas}: the combined gradient now sums {num_replicas} "
            f"replicas' gradients. Multiply the learning rate by "
            f"{old_replicas}/{num_replicas} to keep the step.",
            stacklevel=3,
        )
