"""`ShardedStep`: one step of an optimizer whose state is sharded
(`tf_agn.optimizers.sharding`)."""

import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.finite import all_finite
from tf_agn.collectives.routing import aggregate
from tf_agn.collectives.routing import all_gather
from tf_agn.collectives.routing import keras_loss_divisor
from tf_agn.collectives.routing import reduce_scatter
from tf_agn.compression import compresses
from tf_agn.optimizers.compressor_state import check_gradients
from tf_agn.optimizers.loss_scaling import loss_scaled
from tf_agn.optimizers.loss_scaling import not_counted
from tf_agn.optimizers.step import Step


class ShardedStep(Step):
    """A `Step` for sharded state: reduce-scatters the gradients, updates
    this replica's parts of the weights and all-gathers them.

    Args:
        shards: the optimizer's `Shards`.
        *args: as `Step`'s.

    Example:

    ```python
    step = ShardedStep(shards, optimizer, AggregationMethod.MEAN, None, states, counter)
    step.apply(grads, variables)  # in replica context, variables as built
    ```
    """

    def __init__(self, shards, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shards = shards

    def apply(self, grads, variables):
        """Combines `grads` and updates `variables` (in the order built)."""
        if self.accumulation is None:
            self._apply(grads, variables)
            return
        micro_step = self.accumulation.micro_step(grads, variables)
        self._apply(micro_step.sums, variables, self.accumulation.scale, micro_step.is_last)
        tf.cond(micro_step.is_last, micro_step.reset, micro_step.store)

    def _apply(self, grads, variables, value_scale=1, when=None):
        """`apply`, of `grads` multiplied by the Python number `value_scale`
        first; with `when`, a boolean tensor alike on every replica, nothing
        travels or changes where it is false."""
        optimizer, state = self.optimizer, self.shards
        # Kept by position among the variables built, never in this call.
        indices = [state.index_of(v) for v in variables]
        rank = tf.distribute.get_replica_context().replica_id_in_sync_group
        states = self.states_of(variables)
        check_gradients(grads, variables, states, optimizer.sparse_gradients)
        residuals = [s.get("residual") for s in states]
        wire_scale = self.wire_loss_scale()
        grads = loss_scaled(grads, wire_scale)
        combined = [None] * len(grads)
        sparse = [p for p, grad in enumerate(grads) if isinstance(grad, tf.IndexedSlices)]
        dense = [p for p in range(len(grads)) if p not in set(sparse)]
        rows = {p: state.rows(grads[p], indices[p]) for p in dense}
        # {pattern: [bytes, condition]}; the weights' all-gather is half an
        # all-reduce's volume.
        traffic = {"all_gather": [sum(
            state.part_sizes[i] * state.num_replicas * tf.as_dtype(v.dtype).size // 2
            for i, v in zip(indices, variables)
        ), None]}
        new_residuals = {}
        # Backward order, as `tf_agn.collectives.packing.all_reduce_packs`
        # launches packs: the last layers' gradients exist first.
        for pack in reversed(_packs(state, indices, dense)):
            joined = tf.concat([rows[p] for p in pack], 1)
            residual = None
            if residuals[pack[0]] is not None:
                residual = tf.concat([state.rows(residuals[p], indices[p]) for p in pack], 1)
            summed, error, sent = self._reduce_scatter(joined, residual, value_scale, when)
            for pattern, (nbytes, condition) in sent.items():
                traffic.setdefault(pattern, [0, condition])[0] += nbytes
            sizes = [state.part_sizes[indices[p]] for p in pack]
            for p, part in zip(pack, tf.split(summed, sizes)):
                combined[p] = part
            if error is not None:
                new_residuals.update(zip(pack, tf.split(error, sizes, axis=1)))
        for p in reversed(sparse):
            combined[p] = self._part_of_sparse(grads[p], indices[p], rank, value_scale, when)
        for pattern, (nbytes, condition) in traffic.items():
            self.counter.record(pattern, nbytes, _both(when, condition))
        combined = clipped(optimizer, loss_scaled(combined, wire_scale, inverse=True), when, self.counter)
        if when is not None or self.checks_finite():
            when = self._where_finite(combined, when)
        parts = state.parts_at(indices)

        def step():
            for variable, part, index in zip(variables, parts, indices):
                part.assign(tf.gather(state.rows(variable, index), rank))
            _compat.apply_weight_decay(optimizer, [
                part for part, variable in zip(parts, variables)
                if _compat.uses_weight_decay(optimizer, variable)
            ])
            _compat.update_step(optimizer, combined, parts, optimizer.learning_rate)
            for p, error in new_residuals.items():
                whole = tf.reshape(error, [-1])[: state.sizes[indices[p]]]
                residuals[p].assign(tf.reshape(whole, residuals[p].shape))

        _run_if(when, step)
        gathered = [
            (pack, all_gather([tf.concat([parts[p] for p in pack], 0)], when)[0])
            for pack in _packs(state, indices, range(len(variables)))
        ]
        _run_if(when, lambda: _assign_gathered(state, gathered, variables, indices))

    def _where_finite(self, parts, when):
        """`when` (None: always), and where every replica's `parts` are finite."""
        (non_finite,) = aggregate(
            [tf.cast(tf.logical_not(all_finite(parts)), tf.float32)],
            AggregationMethod.SUM, counter=self.counter, when=when,
        )
        finite = tf.equal(non_finite, 0.0)
        if when is None:
            self.finite = finite
            not_counted(self.optimizer, finite)
            return finite
        self.finite = tf.logical_or(tf.logical_not(when), finite)
        return tf.logical_and(when, finite)

    def _part_of_sparse(self, grad, index, rank, value_scale, when):
        """This replica's part of the replicas' combined sparse `grad`."""
        # Repeated indices are kept: Keras's rules treat slices one by one.
        (summed,) = aggregate(
            [grad], self.method,
            value_scale=keras_loss_divisor() * value_scale,
            counter=self.counter, when=when,
        )
        values = tf.reshape(summed.values, [tf.shape(summed.values)[0], -1])
        row_length = tf.shape(values, out_type=tf.int64)[1]
        columns = tf.range(row_length, dtype=tf.int64)
        part = self.shards.part_sizes[index]
        flat = tf.cast(summed.indices, tf.int64)[:, None] * row_length + columns[None, :]
        flat = tf.reshape(flat, [-1]) - tf.cast(rank, tf.int64) * part
        mine = tf.logical_and(flat >= 0, flat < part)
        return tf.IndexedSlices(
            tf.boolean_mask(tf.reshape(values, [-1]), mine),
            tf.boolean_mask(flat, mine),
            dense_shape=tf.constant([part], tf.int64),
        )

    def _reduce_scatter(self, joined, residual, value_scale, when):
        """This replica's part of one pack's rows `joined` ([n, length]), combined.

        Returns:
            `(part, new residual rows or None, {pattern: (bytes, condition)})`.
        """
        compressor = self.compressor
        (part,), new_states = reduce_scatter(
            [joined], self.method, keras_loss_divisor() * value_scale, when,
            compressor=compressor, states=None if residual is None else [{"residual": residual}],
            step=self.optimizer.iterations,
        )
        error = None if residual is None else new_states[0]["residual"]
        exact = joined.shape.num_elements() * joined.dtype.size // 2
        if not compresses(compressor, joined):
            return part, error, {"reduce_scatter": (exact, None)}
        (pattern,) = compressor.patterns["reduce_scatter"]
        sent = compressor.wire_bytes([joined], joined.shape[0]) // 2
        if not compressor.start_step:
            return part, error, {pattern: (sent, None)}
        # Before `start_step` the rows travel exactly.
        compressing = tf.greater_equal(self.optimizer.iterations, compressor.start_step)
        return part, error, {
            "reduce_scatter": (exact, tf.logical_not(compressing)), pattern: (sent, compressing)
        }


def _packs(state, indices, positions):
    """`state.packs` of the variables at `positions` of this call."""
    positions = list(positions)
    return [
        [positions[j] for j in pack]
        for pack in state.packs([indices[p] for p in positions])
    ]


def _both(when, condition):
    """Where both hold; either may be None (always)."""
    if when is None or condition is None:
        return condition if when is None else when
    return tf.logical_and(when, condition)


def clipped(optimizer, parts, when=None, counter=None):
    """`parts` of the gradients clipped as `optimizer` clips whole gradients
    (the norms' all-reduce recorded in `counter`)."""
    # Keras's and TensorFlow's formulas, on norms across replicas.
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        norms = whole_norms(parts, when, counter)
        return [
            _map_values(p, lambda v, n=n: v * optimizer.clipnorm / tf.maximum(
                tf.cast(n, v.dtype), optimizer.clipnorm))
            for p, n in zip(parts, tf.unstack(norms))
        ]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        norm = tf.norm(whole_norms(parts, when, counter))
        clip = optimizer.global_clipnorm
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [_map_values(p, lambda v: v * tf.cast(scale, v.dtype)) for p in parts]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        value = optimizer.clipvalue
        return [_map_values(p, lambda v: tf.clip_by_value(v, -value, value)) for p in parts]
    return parts


def whole_norms(parts, when=None, counter=None):
    """Each variable's whole L2 norm, from every replica's `parts` of it."""
    squares = tf.stack([
        tf.reduce_sum(tf.square(tf.cast(_values(p), tf.float32))) for p in parts
    ])
    (squares,) = aggregate([squares], AggregationMethod.SUM, counter=counter, when=when)
    # As `tf.clip_by_norm`: a sum of 0 (or NaN) is its own norm.
    return tf.where(squares > 0, tf.sqrt(tf.where(squares > 0, squares, 1.0)), squares)


def _values(part):
    return part.values if isinstance(part, tf.IndexedSlices) else part


def _map_values(part, function):
    """`function` of `part`'s values, as a part of the same kind."""
    if isinstance(part, tf.IndexedSlices):
        return tf.IndexedSlices(function(part.values), part.indices, part.dense_shape)
    return function(part)


def _assign_gathered(state, gathered, variables, indices):
    """Every replica's parts, `all_gather`ed per pack, into `variables`."""
    for pack, whole_pack in gathered:
        sizes = [state.part_sizes[indices[p]] for p in pack]
        columns = tf.split(tf.reshape(whole_pack, [state.num_replicas, -1]), sizes, 1)
        for p, column in zip(pack, columns):
            whole = tf.reshape(column, [-1])[: state.sizes[indices[p]]]
            variables[p].assign(tf.reshape(whole, variables[p].shape))


def _run_if(when, function):
    """`function()`, where `when` (if given) is true."""
    if when is None:
        function()
    else:
        tf.cond(when, lambda: function() or tf.constant(True), lambda: tf.constant(False))
