"""Saving an optimizer that wraps one with sharded state: its variables in
Keras's layout, the sharded state whole.

Keras saves a wrapper's variables with `.numpy()`, one replica's part of
sharded state; `save` and `load` write every variable with the unsharded
optimizer's shape. A wrapper of one's own:

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
    """The `Aggregating` optimizers that `optimizer` is or wraps."""
    found = [optimizer] if hasattr(optimizer, "shards") else []
    for name in ("inner_optimizer", "outer_optimizer"):
        nested = getattr(optimizer, name, None)
        if nested is not None:
            found.extend(aggregating_within(nested))
    return found


def sharded_within(optimizer):
    """The optimizers with sharded state that `optimizer` is or wraps."""
    return [found for found in aggregating_within(optimizer) if found.shards]


def each_saved_value(optimizer):
    """Yields `optimizer.variables`' values, sharded state whole.

    Sharded state is gathered a pack at a time as values are taken; call it
    on every worker and take every value.
    """
    gathering = {}
    for found in sharded_within(optimizer):
        values = found.shards.whole_values(found)
        gathering.update((id(s), values) for s in found.shards.states(found))
    # Packs of different dtypes interleave: values gathered early wait here.
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
    """`optimizer.variables`' values as a list of numpy arrays, sharded
    state whole."""
    return list(each_saved_value(optimizer))


def saved_shapes(optimizer):
    """The shapes of `saved_values`: the unsharded optimizer's."""
    by_id = {}
    for found in sharded_within(optimizer):
        by_id.update(found.shards.whole_shapes(found))
    return [by_id.get(id(v), tuple(v.shape)) for v in optimizer.variables]


def save(optimizer, store):
    """Writes `optimizer.variables` to a Keras saving `store`, sharded state whole."""
    for i, value in enumerate(each_saved_value(optimizer)):
        store[str(i)] = value


def load(optimizer, store):
    """Sets `optimizer.variables` from a Keras saving `store` `save` wrote."""
    load_values(optimizer, _StoredValues(store))


def load_values(optimizer, values):
    """Sets `optimizer.variables` from `values`, as `saved_values` gives
    them; each is read when its variable is assigned."""
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
        loaded.update(found.shards.assign_whole_values(found, value_of))
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
    """Makes Keras's `LossScaleOptimizer` save sharded state whole. Idempotent."""
    # Keras saves the inner optimizer's variables in both entries.
    _compat.replace_loss_scale_methods(
        save_own_variables=_loss_scale_save, load_own_variables=_loss_scale_load
    )


# Keras leaves `exclude_from_weight_decay` out of `get_config`, and a loaded
# (built) optimizer refuses it; the names are kept (ids cannot be).
EXCLUDED_NAMES = "exclude_from_weight_decay_names"


def with_excluded_names(config, optimizer):
    """`config` with the names `optimizer` excludes from weight decay."""
    names = _compat.excluded_weight_decay_names(optimizer)
    return config if names is None else {**config, EXCLUDED_NAMES: names}


def restore_excluded_names(make, config):
    """`make(config)`, excluding the names kept in `config` from weight decay."""
    config = dict(config)
    names = config.pop(EXCLUDED_NAMES, None)
    optimizer = make(config)
    if names is not None:
        optimizer.exclude_from_weight_decay(var_names=[names])
    return optimizer
