"""Sharded optimizer state (ZeRO stage 1): each of n replicas keeps and
updates 1/n of the optimizer's state.

With `shard_optimizer_state=True` every trainable variable is flattened,
padded and split into n parts; replica r owns part r and the state for it.
Each step reduce-scatters the gradients, updates each replica's parts with
the optimizer's own `update_step`, and all-gathers the parts into every
replica's weights: the bytes of one all-reduce.

Example:

```python
with tf_agn.strategies.mirrored().scope():
    model = make_model()
    model.compile(tf_agn.optimizers.Adam(1e-3, shard_optimizer_state=True), loss="mse")
```
"""

import keras
import numpy as np
import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives import packing
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.cross_device_ops import tf_agn_ops
from tf_agn.collectives.routing import all_gather

# Keras's optimizers whose update is element by element.
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.Lion,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
)


def is_elementwise(optimizer):
    """Whether `optimizer`'s update rule acts element by element."""
    if getattr(type(optimizer), "elementwise", False):
        return True
    return any(type(optimizer).update_step is known.update_step for known in ELEMENTWISE)


def check_shardable(optimizer, method, compressor):
    """Raises a ValueError unless `optimizer` can shard its state with
    `method` and `compressor` under its strategy."""
    name = type(optimizer).__name__
    problems = []
    if not is_elementwise(optimizer):
        problems.append(
            f"{name}'s update_step is not one of Keras's element-wise rules (a "
            "per-tensor rule, such as Adafactor's factored moments or a "
            "layer-wise trust ratio, needs whole tensors); a class of your own "
            "that updates element by element can say so with elementwise = True"
        )
    if method not in (AggregationMethod.SUM, AggregationMethod.MEAN):
        problems.append(f"aggregation {method.name} (SUM and MEAN shard)")
    if compressor is not None and "reduce_scatter" not in compressor.patterns:
        problems.append(
            f"compression={compressor.name!r}, which carries no reduce-scatter (fp16, bf16, "
            "int8 and int4 shard; PowerSGD's factors need whole matrices on every replica)"
        )
    if optimizer.use_ema:
        problems.append("use_ema=True (not yet with sharding)")
    strategy = _compat.creation_strategy(optimizer)
    if strategy.num_replicas_in_sync > 1 and tf_agn_ops(strategy) is None:
        problems.append(
            f"{type(strategy).__name__} without tf_agn's cross-device ops "
            "(use tf_agn.strategies.mirrored or multi_worker_mirrored)"
        )
    if problems:
        raise ValueError(
            f"{name}(shard_optimizer_state=True) cannot shard with: "
            + "; ".join(problems) + "."
        )


class Shards:
    """How each trainable variable is split into one part per replica: the
    sizes, this replica's scratch `parts`, and the state kept per part."""

    def __init__(self, variables, num_replicas, bytes_per_pack):
        self.num_replicas = num_replicas
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.part_sizes = [-(-size // num_replicas) for size in self.sizes]
        # Scratch parts, refreshed from the weights every step so that weights
        # set from outside (loading, `set_weights`) are what it updates.
        self.parts = [
            keras.Variable(
                tf.zeros([part], v.dtype), trainable=False, name=v.name, aggregation="none"
            )
            for v, part in zip(variables, self.part_sizes)
        ]
        self._index = {id(v): i for i, v in enumerate(variables)}
        self._dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self._bytes_per_pack = bytes_per_pack
        # id(state variable) -> index of its trainable variable.
        self._state_index = {}

    @classmethod
    def for_optimizer(cls, optimizer, variables, method, compressor):
        """The `Shards` of `optimizer`, or None with one replica."""
        check_shardable(optimizer, method, compressor)
        strategy = _compat.creation_strategy(optimizer)
        if strategy.num_replicas_in_sync == 1:
            return None
        return cls(variables, strategy.num_replicas_in_sync, tf_agn_ops(strategy).bytes_per_pack)

    def register_parts(self, optimizer, variables):
        """Makes `optimizer`'s `update_step` find a variable's state by its part."""
        for variable, part in zip(variables, self.parts):
            _compat.register_variable_alias(optimizer, part, variable)

    def index_of(self, variable):
        """The position of trainable `variable` among those built with."""
        return self._index[id(variable)]

    def part_of(self, variable):
        """The scratch variable of `variable`'s part."""
        return self.parts[self.index_of(variable)]

    def parts_at(self, indices):
        return [self.parts[i] for i in indices]

    def packs(self, indices):
        """`tf_agn.collectives.packing.plan_packs` of the variables at `indices`."""
        sizes = [(self._dtypes[i], self.part_sizes[i] * self.num_replicas) for i in indices]
        return packing.plan_packs(sizes, self._bytes_per_pack)

    def add_state(self, optimizer, variable, name, initializer):
        """A `keras.Variable` of `optimizer`'s state for `variable`'s part."""
        part = self.part_of(variable)
        # `on_read` without aggregation: `tf.train.Checkpoint` refuses it
        # rather than save one replica's part as the whole.
        with keras.name_scope(optimizer.name, caller=optimizer):
            state = keras.Variable(
                initializer=initializer, shape=part.shape, dtype=part.dtype, trainable=False,
                aggregation="none", synchronization="on_read",
                name=_compat.reference_variable_name(variable, name),
            )
        _compat.track_variable(optimizer, state)
        self._state_index[id(state)] = self.index_of(variable)
        return state

    def index_of_state(self, state):
        """The index of the trainable variable `state` belongs to."""
        return self._state_index[id(state)]

    def is_state(self, variable):
        """Whether `variable` is optimizer state of a part's shape."""
        return id(variable) in self._state_index

    def whole_shapes(self, optimizer):
        """{id(state variable): the shape of its trainable variable}."""
        shapes = [tuple(v.shape) for v in _compat.built_variables(optimizer)]
        return {id(s): shapes[self.index_of_state(s)] for s in self.states(optimizer)}

    def whole_values(self, optimizer):
        """Yields `(state variable, its whole value)` for `optimizer`'s
        sharded state, one all-gathered pack at a time as values are taken.

        Call it in cross-replica context on every worker, and take every value.
        """
        states = self.states(optimizer)
        strategy = _compat.creation_strategy(optimizer)
        local = strategy.experimental_local_results
        sizes = [(tf.as_dtype(s.dtype), self._part(s) * self.num_replicas) for s in states]
        packs = packing.plan_packs(sizes, tf_agn_ops(strategy).bytes_per_pack)

        # Traced for a first shape, then once for any shape.
        @tf.function(reduce_retracing=True)
        def gather(parts):
            # One replica's copy: what no output needs is not computed.
            return local(strategy.run(lambda part: all_gather([part])[0], args=(parts,)))[0]

        shapes = self.whole_shapes(optimizer)
        for pack in [[states[i] for i in pack] for pack in packs]:
            joined = []
            for copies in zip(*[local(s.value) for s in pack]):
                with tf.device(copies[0].device):
                    joined.append(tf.concat([tf.reshape(c, [-1]) for c in copies], 0))
            # Row r: replica r's parts of the pack's variables, joined.
            rows = gather(_per_replica(strategy, joined)).numpy().reshape(self.num_replicas, -1)
            ends = np.cumsum([self._part(s) for s in pack])
            for state, end in zip(pack, ends):
                flat = rows[:, end - self._part(state) : end].reshape(-1)
                size = self.sizes[self.index_of_state(state)]
                yield state, flat[:size].reshape(shapes[id(state)])

    def assign_whole_values(self, optimizer, value_of):
        """Gives each replica its part of `value_of(state variable)`, a whole
        value, for each state variable; returns the ids assigned."""
        shapes = self.whole_shapes(optimizer)
        strategy = _compat.creation_strategy(optimizer)
        local = strategy.experimental_local_results
        states = self.states(optimizer)
        for state in states:
            value = np.asarray(value_of(state), state.dtype)
            if value.shape != shapes[id(state)]:
                raise ValueError(
                    f"The saved value of {state.path} has shape {value.shape}; "
                    f"this model's variable has {shapes[id(state)]}."
                )
            rows = self.rows(value, self.index_of_state(state))
            # This worker's replicas' rows, in the order of their copies.
            mine = strategy.experimental_distribute_values_from_function(
                lambda context, rows=rows: rows[context.replica_id_in_sync_group]
            )
            for copy, row in zip(local(state.value), local(mine), strict=True):
                copy.assign(row)
        return {id(s) for s in states}

    def _part(self, state):
        return self.part_sizes[self.index_of_state(state)]

    def states(self, optimizer):
        """`optimizer`'s sharded state variables, in `variables`' order."""
        return [v for v in optimizer.variables if self.is_state(v)]

    def rows(self, tensor, index):
        """`tensor` (of trainable variable `index`), flat and padded, as n rows."""
        flat = tf.reshape(tf.convert_to_tensor(tensor), [-1])
        padding = self.part_sizes[index] * self.num_replicas - self.sizes[index]
        return tf.reshape(tf.pad(flat, [[0, padding]]), [self.num_replicas, self.part_sizes[index]])


def _per_replica(strategy, local_values):
    """The distributed value whose local results are `local_values`."""
    # Asked for in `experimental_local_results`' order.
    values = iter(local_values)
    return strategy.experimental_distribute_values_from_function(lambda context: next(values))
