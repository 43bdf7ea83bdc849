"""Saving an optimizer that wraps one with sharded state: its variables in
Keras's layout, the sharded state whole.

Keras's `LossScaleOptimizer`, `DistributedOptimizer` and the windowed
optimizers list their wrapped optimizers' variables among their own, and
Keras saves each with `.numpy()`, which gives one replica's part of
sharded state. `save` and `load` give the wrapped tf_agn optimizer those
values to convert (`Aggregating.saved_values` and `load_values`), so a
file holds every variable with the unsharded optimizer's shape.

`install` (run when `tf_agn.optimizers` is imported) makes Keras's
`LossScaleOptimizer`, which `compile` puts around the optimizer under mixed
precision, save and load this way when it wraps sharded state.

Example, a wrapper of one's own:

```python
class MyWrapper(keras.optimizers.Optimizer):
    def save_own_variables(self, store):
        saving.save(self, store)

    def load_own_variables(self, store):
        saving.load(self, store)
```
"""

import collections.abc

from tf_agn import _compat


def aggregating_within(optimizer):
    """The tf_agn optimizers (`tf_agn.optimizers.Aggregating`) that
    `optimizer` is or wraps (through `inner_optimizer` and
    `outer_optimizer`)."""
    found = [optimizer] if hasattr(optimizer, "sharded_state") else []
    for name in ("inner_optimizer", "outer_optimizer"):
        nested = getattr(optimizer, name, None)
        if nested is not None:
            found.extend(aggregating_within(nested))
    return found


def sharded_within(optimizer):
    """The tf_agn optimizers with sharded state that `optimizer` is or
    wraps."""
    return [found for found in aggregating_within(optimizer) if found.sharded_state]


def each_saved_value(optimizer):
    """Yields `optimizer.variables`' values as Keras saves them, in order,
    sharded state whole, with the unsharded optimizer's shapes.

    Sharded state is all-gathered a pack at a time
    (`ShardedState.whole_values`), when the values before it have been
    taken: write each value away before taking the next, and saving holds
    one pack of the state at a time. Call it on every worker, as Keras
    asks of `model.save` under a multi-worker strategy, and take every
    value.
    """
    gathering = {}
    for found in sharded_within(optimizer):
        values = found.sharded_state.whole_values(found)
        gathering.update((id(s), values) for s in found.sharded_state.states(found))
    # A pack's values come together, and packs of different dtypes may
    # interleave: those gathered before their turn wait here.
    waiting = {}
    for variable in optimizer.variables:
        if id(variable) not in gathering:
            yield variable.numpy()
            continue
        while id(variable) not in waiting:
            state, value = next(gathering[id(variable)])
            waiting[id(state)] = value
        yield waiting.pop(id(variable))


def saved_values(optimizer):
    """`optimizer.variables`' values as Keras saves them: the list of
    `each_saved_value`'s, every one held at once.

    Returns:
        One numpy array per variable of `optimizer.variables`.
    """
    return list(each_saved_value(optimizer))


def saved_shapes(optimizer):
    """The shapes of `saved_values`: the unsharded optimizer's."""
    by_id = {}
    for found in sharded_within(optimizer):
        by_id.update(found.sharded_state.whole_shapes(found))
    return [by_id.get(id(v), tuple(v.shape)) for v in optimizer.variables]


def save(optimizer, store):
    """Writes `optimizer.variables` to a Keras saving `store`, by position,
    sharded state whole."""
    for i, value in enumerate(each_saved_value(optimizer)):
        store[str(i)] = value


def load(optimizer, store):
    """Sets `optimizer.variables` from a Keras saving `store`, as `save`
    wrote it (or the unsharded optimizer's Keras saved), reading each value
    when its variable is assigned.

    Raises:
        ValueError: as `load_values`.
    """
    load_values(optimizer, _StoredValues(store))


def load_values(optimizer, values):
    """Sets `optimizer.variables` from values as `saved_values` gives them.

    Args:
        optimizer: the optimizer to set.
        values: a sequence of one value per variable; each is taken
            (`values[i]`) when its variable is assigned.

    Raises:
        ValueError: for another number of values, or sharded state of a
            shape that is not the unsharded one.
    """
    variables = optimizer.variables
    if len(values) != len(variables):
        raise ValueError(
            f"{optimizer.name} has {len(variables)} variables; the saved "
            f"optimizer has {len(values)}. Was it saved from another optimizer?"
        )
    position = {id(v): i for i, v in enumerate(variables)}

    def value_of(variable):
        return values[position[id(variable)]]

    loaded = set()
    for found in sharded_within(optimizer):
        loaded.update(found.sharded_state.assign_whole_values(found, value_of))
    for variable in variables:
        if id(variable) not in loaded:
            variable.assign(value_of(variable))


class _StoredValues(collections.abc.Sequence):
    """A Keras saving store's values by position, each read when taken."""

    def __init__(self, store):
        self.store = store

    def __len__(self):
        return len(self.store.keys())

    def __getitem__(self, index):
        return self.store[str(index)]


def _loss_scale_save(loss_scale_optimizer, store):
    """`LossScaleOptimizer.save_own_variables`, sharded state whole."""
    if sharded_within(loss_scale_optimizer):
        save(loss_scale_optimizer, store)
    else:
        _compat.stock_loss_scale_method("save_own_variables")(loss_scale_optimizer, store)


def _loss_scale_load(loss_scale_optimizer, store):
    """`LossScaleOptimizer.load_own_variables`, sharded state from whole."""
    if sharded_within(loss_scale_optimizer):
        load(loss_scale_optimizer, store)
    else:
        _compat.stock_loss_scale_method("load_own_variables")(loss_scale_optimizer, store)


def install():
    """Makes Keras's `LossScaleOptimizer` save sharded state whole.
    Idempotent."""
    # Keras saves the inner optimizer's variables twice: in the loss scale
    # optimizer's entry, after its own, and in the inner optimizer's.
    _compat.replace_loss_scale_methods(
        save_own_variables=_loss_scale_save, load_own_variables=_loss_scale_load
    )


# Keras leaves `exclude_from_weight_decay` out of `get_config`, so a loaded
# optimizer decays what the user excluded, and `exclude_from_weight_decay`
# cannot be called again once loading has built it. The names are kept;
# excluded variables (by id) cannot outlive the process.
EXCLUDED_NAMES = "exclude_from_weight_decay_names"


def with_excluded_names(config, optimizer):
    """`config` with the names `optimizer` excludes from weight decay."""
    names = _compat.excluded_weight_decay_names(optimizer)
    return config if names is None else {**config, EXCLUDED_NAMES: names}


def restore_excluded_names(make, config):
    """`make(config)` with the names `with_excluded_names` kept in `config`
    excluded from weight decay again."""
    config = dict(config)
    names = config.pop(EXCLUDED_NAMES, None)
    optimizer = make(config)
    if names is not None:
        optimizer.exclude_from_weight_decay(var_names=[names])
    return optimizer
