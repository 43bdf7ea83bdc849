"""`WindowedOptimizer`: λ local steps, then a commit; the algorithms' shared
machinery."""

import functools

import keras
from keras import ops
import tensorflow as tf

from tf_agn import _compat
from tf_agn import agreement
from tf_agn import compression as compression_lib
from tf_agn.aggregation import AggregationMethod
from tf_agn.communication import CommunicationCounter
from tf_agn.communication import communication_stats
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.distributed_optimizer import DistributedOptimizer
from tf_agn.optimizers.compression_state import add_compression_state
from tf_agn.optimizers.loss_scaling import all_replicas_finite
from tf_agn.replica_aggregation import aggregate
from tf_agn.replica_aggregation import default_aggregation
from tf_agn.replica_aggregation import default_compression


@keras.saving.register_keras_serializable(package="tf_agn")
class WindowedOptimizer(DistributedOptimizer):
    """Local exploration for a window of λ steps, then one commit.

    Every algorithm of the AGN paper (AGN, DOWNPOUR, DynSGD, AEASGD, EAMSGD)
    is this loop with different update rules, and each rule is one small pure
    method, so that every executor (synchronous under `MirroredStrategy`
    here, asynchronous under `ParameterServerStrategy` in
    `tf_agn.strategies.fit`, and the deterministic `tf_agn.strategies.
    simulate`) runs the same math:

    - `local_step`: the inner `optimizer`, on the worker's own weights θ;
    - `commit_delta(θ, θ_ref)`: what a worker commits after the window, θ_ref
      being the center it pulled;
    - `commit_scale(staleness)`: the factor the server applies a commit with,
      given how many commits landed since the worker's pull;
    - `local_after_commit(θ, Δ, θ_c)`: the worker's weights after its
      commit (reset to the center, or an elastic move);
    - `resets_to_center`: whether a window starts from a fresh pull of the
      center (AGN, DOWNPOUR, DynSGD), or the worker keeps its own weights
      and pulls the center only to commit (the elastic methods).

    Synchronously, at a window's end every replica forms its Δ_r, the Δ_r are
    combined with `aggregation_method` in one packed reduction, and the
    `outer_optimizer` applies the combination to the center θ_c as the
    pseudo-gradient −Δ (default SGD(1.0): θ_c ← θ_c + Δ). Asynchronously the
    server applies each worker's Δ on its own, scaled by `commit_scale`.

    The inner optimizer's state (e.g. Adam's moments) stays per replica or
    worker and is kept across windows, as in the paper;
    `reset_inner_state=True` clears it at every commit instead (its step
    counter keeps counting). At the end of `fit` (Keras'
    `finalize_variable_values`) a partial window is committed, so the
    weights are the center afterwards.

    Args:
        optimizer: the inner Keras optimizer every replica or worker steps
            with.
        local_steps: λ, the number of local steps per window (an int >= 1).
        aggregation_method: how the replicas' Δ_r are combined
            synchronously: an `AggregationMethod` or its name. None takes the
            default of the strategy's `tf_agn.AggregatingAllReduce`.
        outer_optimizer: the Keras optimizer that applies the combined Δ to
            the center; default `keras.optimizers.SGD(1.0)`. Only its update
            rule is used, not its clipping or weight decay.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        compression: how the commits travel: None (the strategy's
            `compression`, if any), "fp16", "bf16", "int8",
            `tf_agn.compression.PowerSGD(rank=r)` or any `tf_agn.compression`
            compressor. Synchronously, int8 and PowerSGD keep each
            replica's residual of its Δ_r (error feedback) as optimizer
            variables, and their `start_step` counts commits; to a
            parameter server, each worker keeps its own residual and the
            server decompresses (`tf_agn.strategies.commit_server`). The
            local steps send nothing.
        name: the optimizer's name.
        **kwargs: more arguments of `tf_agn.optimizers.DistributedOptimizer`
            for the commits: `accumulation_reduction` and
            `sparse_gradients` (`gradient_accumulation_steps` is refused).

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: if `local_steps` is not an int >= 1, the outer learning
            rate is not positive, `aggregation_method` is unknown, the
            inner optimizer accumulates gradients (see
            `gradient_accumulation_steps`: the window already does), or it
            has an aggregation method other than "none" (its steps are
            local).
    """

    # Class attribute: the elastic methods keep their own weights.
    resets_to_center = True

    def __init__(
        self,
        optimizer,
        local_steps,
        aggregation_method="mean",
        outer_optimizer=None,
        reset_inner_state=False,
        compression=None,
        name=None,
        **kwargs,
    ):
        if (
            isinstance(local_steps, bool)
            or not isinstance(local_steps, int)
            or local_steps < 1
        ):
            raise ValueError(
                f"local_steps must be an int >= 1; received {local_steps!r}."
            )
        accumulation = kwargs.get("gradient_accumulation_steps") or getattr(
            optimizer, "gradient_accumulation_steps", None
        )
        if accumulation:
            raise ValueError(
                f"{type(self).__name__} takes no gradient_accumulation_steps "
                f"(received {accumulation!r}): its window of local_steps "
                "already combines replicas once per window. Either take "
                "local_steps optimizer steps per commit here, or accumulate "
                "with tf_agn.optimizers.DistributedOptimizer."
            )
        _check_local_inner_optimizer(type(self).__name__, optimizer)
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(learning_rate=1.0)
        _check_outer_optimizer(outer_optimizer)
        if aggregation_method is not None:
            aggregation_method = AggregationMethod.parse(aggregation_method)
        # The inner optimizer's own steps are local: aggregation NONE.
        super().__init__(optimizer, aggregation_method="none", name=name, **kwargs)
        self.local_steps = local_steps
        self.commit_aggregation = aggregation_method
        self.outer_optimizer = outer_optimizer
        self.reset_inner_state = bool(reset_inner_state)
        self.commit_compression = compression_lib.get(compression)
        self._swap_function = None

    @property
    def aggregation(self):
        """The `AggregationMethod` the commits use."""
        if self.commit_aggregation is not None:
            return self.commit_aggregation
        return default_aggregation(_compat.creation_strategy(self))

    @property
    def resolved_compression(self):
        """The compressor the commits travel in: our own, or the strategy's."""
        if self.commit_compression is not None:
            return self.commit_compression
        return default_compression(_compat.creation_strategy(self))

    def build(self, var_list):
        if self.built:
            return
        if isinstance(
            _compat.creation_strategy(self),
            tf.distribute.experimental.ParameterServerStrategy,
        ):
            # Keras 3's fit and train steps cannot drive this strategy; its
            # windows run through tf_agn's own asynchronous executor.
            raise ValueError(
                f"{type(self).__name__} runs asynchronously under "
                "ParameterServerStrategy through tf_agn.strategies.fit("
                "model, dataset_fn, ...), not through model.fit or "
                "optimizer.apply."
            )
        agreement.check_optimizer_agreement(
            self,
            self.aggregation,
            self.resolved_compression,
            ("local_steps", self.local_steps),
            var_list,
        )
        super().build(var_list)
        # An initializer rather than an assign: Keras may build the
        # optimizer while tracing the train step, where an assign would only
        # land in that graph.
        self._centers = [
            self.add_variable_from_reference(
                v, name="center", initializer=_current_value_of(v)
            )
            for v in var_list
        ]
        self.outer_optimizer.build(self._centers)
        self._communication = CommunicationCounter(self)
        self._commit_state = add_compression_state(self, var_list, self.resolved_compression)

    @property
    def variables(self):
        return super().variables + self.outer_optimizer.variables

    @property
    def center_variables(self):
        """θ_c, the weights every replica starts its window from."""
        return list(self._centers)

    def communication_stats(self):
        """What the commits sent so far.

        Returns:
            `{"all_reduce_calls": int, "bytes_sent": int}`; local steps send
            nothing, but under mixed precision each sends one float32 (see
            `all_replicas_finite`).
        """
        return communication_stats(self)

    def all_replicas_finite(self, grads):
        """See `tf_agn.optimizers.Aggregating.all_replicas_finite`: even a
        local step is skipped on every replica when one overflows, because
        the loss scale is shared. Counted in this optimizer's own
        `communication_stats`."""
        return all_replicas_finite(grads, self._communication)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
        self.inner_optimizer.apply(grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        if context is None:
            self._commit_if_window_ends(tf.distribute.get_strategy())
        else:
            # TensorFlow refuses a `merge_call` (the commit's reduction)
            # inside a `tf.cond` in replica context, so the window test runs
            # in cross-replica context, as Keras' LossScaleOptimizer does it.
            # `merge_call` only shapes the graph: it costs nothing per step.
            context.merge_call(self._commit_if_window_ends)

    def _commit_if_window_ends(self, strategy):
        window_ends = ops.equal(self.inner_optimizer.iterations % self.local_steps, 0)
        ops.cond(
            window_ends,
            functools.partial(strategy.extended.call_for_each_replica, self._commit),
            lambda: None,
        )

    # The update rules. Each is pure and works on one tensor at a time, in
    # any executor; subclasses override them.

    def commit_delta(self, local, reference):
        """What a worker commits: Δ = θ − θ_ref (DOWNPOUR's rule).

        Args:
            local: the worker's weight θ after its local steps.
            reference: θ_ref, the center as the worker pulled it.

        Returns:
            The tensor Δ.
        """
        return ops.subtract(local, reference)

    def commit_scale(self, staleness):
        """The factor the server applies a commit with: 1.

        Args:
            staleness: the number of commits the server applied between the
                worker's pull and this commit, a scalar tensor (0 for a
                synchronous commit).

        Returns:
            A float32 scalar.
        """
        del staleness
        return ops.ones((), "float32")

    def local_after_commit(self, local, delta, center):
        """The worker's weight after its commit: the new center.

        Args:
            local: the worker's weight θ before the commit.
            delta: the Δ it committed.
            center: the center θ_c after the commit.

        Returns:
            The worker's new weight.
        """
        del local, delta
        return center

    def _commit(self):
        """A synchronous commit, in replica context."""
        variables = _compat.built_variables(self)
        deltas = [
            self.commit_delta(variable, center)
            for variable, center in zip(variables, self._centers)
        ]
        combined = aggregate(
            deltas,
            self.aggregation,
            compressor=self.resolved_compression,
            state=self._commit_state,
            step=self.outer_optimizer.iterations,
            counter=self._communication,
        )
        # The center update runs per replica, like the local steps: every
        # replica holds the same combined Δ, so the copies of θ_c stay equal.
        self.apply_to_center(combined, self._centers)
        for variable, delta, center in zip(variables, deltas, self._centers):
            variable.assign(self.local_after_commit(variable, delta, center))
        if self.reset_inner_state:
            for slot in self._inner_state():
                slot.assign(ops.zeros_like(slot))

    def apply_to_center(self, deltas, centers):
        """θ_c ← the outer optimizer's step with the pseudo-gradient −Δ.

        Args:
            deltas: the (combined, scaled) commit, one tensor per center.
            centers: the center variables, on any device.
        """
        _compat.update_step_in_place(
            self.outer_optimizer,
            [ops.negative(delta) for delta in deltas],
            centers,
            self.outer_optimizer.learning_rate,
        )
        self.outer_optimizer.iterations.assign_add(1)

    def _inner_state(self):
        """The inner optimizer's per-weight state."""
        return optimizer_state(self.inner_optimizer)

    def swap_weights_and_center(self):
        """Exchanges every replica's copy of the weights with the center.

        Called twice, it restores both exactly. `tf_agn.callbacks.
        EvaluateAtCenter` uses it so that evaluation and prediction mid-window
        see θ_c, not each replica's exploration.
        """
        if not self.built:
            return
        if self._swap_function is None:
            self._swap_function = self._in_replica_context(self._swap)
        self._swap_function()

    def _in_replica_context(self, fn):
        """Returns a graph function that runs `fn` on every replica."""
        # `strategy.run` goes inside the tf.function, as TensorFlow requires
        # for functions that synchronize replicas.
        return tf.function(lambda: _compat.creation_strategy(self).run(fn))

    def _swap(self):
        # In replica context each assign writes this replica's copy only.
        for variable, center in zip(_compat.built_variables(self), self._centers):
            # `tf.identity` takes a snapshot; a converted variable would be
            # read only when used, after the assign below.
            local = tf.identity(variable.value)
            variable.assign(center)
            center.assign(local)

    def finalize_variable_values(self, var_list):
        """Commits a partial window at the end of `fit`."""
        if self.built:
            steps_into_window = int(
                self.inner_optimizer.iterations.numpy() % self.local_steps
            )
            if steps_into_window:
                self._in_replica_context(self._commit)()
        super().finalize_variable_values(var_list)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "local_steps": self.local_steps,
                "aggregation_method": (
                    None
                    if self.commit_aggregation is None
                    else self.commit_aggregation.value
                ),
                "outer_optimizer": keras.saving.serialize_keras_object(
                    self.outer_optimizer
                ),
                "reset_inner_state": self.reset_inner_state,
                "compression": compression_lib.serialize(self.commit_compression),
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["outer_optimizer"] = keras.saving.deserialize_keras_object(
            config["outer_optimizer"], custom_objects=custom_objects
        )
        return super().from_config(config, custom_objects=custom_objects)


def optimizer_state(optimizer):
    """An optimizer's per-weight state: its variables but for the counters.

    Args:
        optimizer: a built Keras optimizer.

    Returns:
        The list of its state variables (e.g. Adam's moments).
    """
    counters = {id(optimizer.iterations), id(_compat.learning_rate_source(optimizer))}
    communication = getattr(optimizer, "_communication", None)
    if communication is not None:
        counters.update((id(communication.calls), id(communication.bytes)))
    return [v for v in optimizer.variables if id(v) not in counters]


def _current_value_of(variable):
    """An initializer that copies `variable`'s value when it runs."""
    return lambda shape, dtype: ops.cast(ops.convert_to_tensor(variable), dtype)


def _check_local_inner_optimizer(owner, optimizer):
    """Raises if `optimizer` would combine its steps across replicas.

    The window's local steps communicate nothing; an inner method chosen by
    the user would be silently replaced, when they likely meant the
    commits'.
    """
    if not isinstance(optimizer, Aggregating):
        return
    own = optimizer.aggregation_method
    if own in (None, AggregationMethod.NONE):
        return
    raise ValueError(
        f"{owner}'s inner optimizer steps locally: its aggregation_method "
        f"must be None or 'none'; received {own.value!r} on "
        f"{optimizer.name!r}. Pass aggregation_method={own.value!r} to "
        f"{owner} to combine the commits that way."
    )


def _check_outer_optimizer(outer_optimizer):
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer; received "
            f"{outer_optimizer!r}."
        )
    rate = _compat.learning_rate_source(outer_optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return
    if callable(rate):
        return
    value = float(ops.convert_to_numpy(rate))
    if not value > 0:
        raise ValueError(
            f"The outer optimizer's learning rate must be > 0; received {value}."
        )
