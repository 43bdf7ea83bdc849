"""Sharded optimizer state (ZeRO stage 1): each of n replicas keeps and
updates 1/n of the optimizer's state.

With `shard_optimizer_state=True` a tf_agn optimizer splits every trainable
variable, flattened and padded to a multiple of n, into n equal parts;
replica r owns part r of each. Its state (Adam's moments, momentum) is made
for the parts only, so each replica holds 1/n of it. Each step:

1. the replicas' gradients are reduce-scattered: each replica receives the
   combination (SUM or MEAN) of its parts only;
2. the optimizer's own `update_step` updates the parts, with the parts of
   its state;
3. the updated parts are all-gathered into every replica's copy of the
   weights.

A reduce-scatter and an all-gather move what one all-reduce moves. Weight
decay is applied to every replica's whole copy before, as without
sharding; `clipnorm` and `global_clipnorm` clip the parts by the whole
gradients' norms; the weights every replica holds stay equal. With fp16 or
bf16 compression the gradients travel in that dtype, with int8 as
quantized rows by an all-to-all (`sharded_step`); the weights do not.

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
from tf_agn import packing
from tf_agn.aggregation import AggregationMethod
from tf_agn.compression import Cast
from tf_agn.compression import Int8
from tf_agn.replica_aggregation import all_gather
from tf_agn.replica_aggregation import tf_agn_ops

# Keras's optimizers whose update of each element reads that element's
# gradient, weight and state only.
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
    """Whether `optimizer`'s update rule acts element by element: its class
    says so (`elementwise = True`), or its `update_step` is that of one of
    Keras's element-wise optimizers."""
    if getattr(type(optimizer), "elementwise", False):
        return True
    return any(type(optimizer).update_step is known.update_step for known in ELEMENTWISE)


def check_shardable(optimizer, method, compressor):
    """Raises unless `optimizer` can shard its state with `method` and
    `compressor` under its strategy.

    Raises:
        ValueError: naming what cannot be sharded and why.
    """
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
    if compressor is not None and not isinstance(compressor, (Cast, Int8)):
        problems.append(
            f"compression={compressor.name!r} (fp16, bf16 and int8 shard; PowerSGD's "
            "factors need whole matrices on every replica)"
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


class ShardedState:
    """Each trainable variable's part on this replica, and the sharded step.

    Args:
        optimizer: the tf_agn optimizer whose state is sharded, being built.
        variables: the trainable variables it is built for.
        num_replicas: n, the replicas in sync.
        bytes_per_pack: the most bytes one reduce-scatter carries.
    """

    def __init__(self, optimizer, variables, num_replicas, bytes_per_pack):
        self.num_replicas = num_replicas
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.parts = [-(-size // num_replicas) for size in self.sizes]
        # The part each replica updates: a scratch variable per trainable
        # one, refreshed from the weights every step, so that weights set
        # from outside (loading, `set_weights`) are what the step updates.
        self.variables = [
            keras.Variable(
                tf.zeros([part], v.dtype), trainable=False, name=v.name, aggregation="none"
            )
            for v, part in zip(variables, self.parts)
        ]
        self._index = {id(v): i for i, v in enumerate(variables)}
        self._dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self._bytes_per_pack = bytes_per_pack
        # The optimizer's state variables (each of one part's shape), by
        # the index of the trainable variable each belongs to.
        self._state_index = {}

    @classmethod
    def for_optimizer(cls, optimizer, variables, method, compressor):
        """The sharded state of `optimizer`, being built for `variables`, or
        None with one replica (the plain optimizer).

        Raises:
            ValueError: as `check_shardable`.
        """
        check_shardable(optimizer, method, compressor)
        strategy = _compat.creation_strategy(optimizer)
        if strategy.num_replicas_in_sync == 1:
            return None
        return cls(
            optimizer, variables, strategy.num_replicas_in_sync,
            tf_agn_ops(strategy).bytes_per_pack,
        )

    def register_parts(self, optimizer, variables):
        """Makes `optimizer`, built, find each variable's state when its
        `update_step` is given the variable's part."""
        for variable, part in zip(variables, self.variables):
            _compat.register_variable_alias(optimizer, part, variable)

    def index_of(self, variable):
        """The position of trainable `variable` among those built with: what
        its part, sizes and state are kept by."""
        return self._index[id(variable)]

    def part_of(self, variable):
        """The scratch variable of `variable`'s part, whose shape the
        optimizer's state for `variable` takes."""
        return self.variables[self.index_of(variable)]

    def variables_at(self, indices):
        """The scratch variables of the parts of the variables at `indices`."""
        return [self.variables[i] for i in indices]

    def packs(self, indices):
        """Packs (`tf_agn.packing.plan_packs`) of the variables at
        `indices`, each a list of positions in `indices`."""
        sizes = [(self._dtypes[i], self.parts[i] * self.num_replicas) for i in indices]
        return packing.plan_packs(sizes, self._bytes_per_pack)

    def add_state(self, optimizer, variable, name, initializer):
        """A variable of `optimizer`'s state for trainable `variable`, of its
        part's shape, named as Keras names the whole variable's.

        Returns:
            A `keras.Variable` each replica holds its own part in.
        """
        part = self.part_of(variable)
        # Each replica's copy is its own part (`on_read`, no aggregation):
        # `tf.train.Checkpoint` then refuses it rather than save one
        # replica's part as the whole, as it would of a mirrored variable.
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
        """{id(state variable): the shape of its trainable variable}, for
        `optimizer`'s sharded state."""
        shapes = [tuple(v.shape) for v in _compat.built_variables(optimizer)]
        return {id(s): shapes[self.index_of_state(s)] for s in self.states(optimizer)}

    def whole_values(self, optimizer):
        """Yields `(state variable, its value as the unsharded optimizer
        holds it)` for each of `optimizer`'s sharded state variables: every
        replica's part, joined, unpadded and shaped as the trainable
        variable.

        The parts travel a pack at a time (`packing.plan_packs`: at most the
        strategy's `bytes_per_pack` when whole, or one larger variable), one
        all-gather each, when the values before them have been taken: so a
        caller that writes each value away before taking the next holds
        one pack beside the weights, not the whole state. Packs are in the
        order of their first variable; a pack's values come together.

        Call it in cross-replica context on every worker, and take every
        value there: each all-gather needs every worker.
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
        """Gives each replica its part of each whole value, one variable at
        a time: each value is asked for when its variable is assigned.

        Args:
            optimizer: the optimizer whose sharded state takes them.
            value_of: `value_of(state variable)`, its value with the
                trainable variable's shape (what `np.asarray` reads).

        Returns:
            The ids of the state variables assigned.

        Raises:
            ValueError: for a value of another shape than the unsharded
                optimizer's (the variables before it are assigned).
        """
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
        """The length of `state`'s part."""
        return self.parts[self.index_of_state(state)]

    def states(self, optimizer):
        """`optimizer`'s sharded state variables, in `variables`' order."""
        return [v for v in optimizer.variables if self.is_state(v)]

    def rows(self, tensor, index):
        """`tensor` (of trainable variable `index`), flat, padded to n
        parts, as n rows."""
        flat = tf.reshape(tf.convert_to_tensor(tensor), [-1])
        padding = self.parts[index] * self.num_replicas - self.sizes[index]
        return tf.reshape(tf.pad(flat, [[0, padding]]), [self.num_replicas, self.parts[index]])


def _per_replica(strategy, local_values):
    """The distributed value whose local results are `local_values`, one
    for each of this worker's replicas, in `experimental_local_results`'
    order."""
    # `experimental_distribute_values_from_function` asks this worker's
    # replicas' values in that order.
    values = iter(local_values)
    return strategy.experimental_distribute_values_from_function(lambda context: next(values))
