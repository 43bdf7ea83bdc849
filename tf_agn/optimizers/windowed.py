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
from tf_agn.memory import memory_stats
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.commit_rules import CommitRules
from tf_agn.optimizers.communicating import Communicating
from tf_agn.optimizers.compression_state import add_compression_state
from tf_agn.optimizers.wrapping import WrappingOptimizer
from tf_agn.optimizers.wrapping import check_wrappable
from tf_agn.replica_aggregation import aggregate
from tf_agn.replica_aggregation import default_aggregation

# What `get_config` of the windowed optimizers wrote before they became
# compositions, for settings they never had a use for: files saved then
# hold these values, which mean nothing now.
_FORMER_CONFIG_ENTRIES = {"accumulation_reduction": "mean", "sparse_gradients": None}


@keras.saving.register_keras_serializable(package="tf_agn")
class WindowedOptimizer(CommitRules, Communicating, WrappingOptimizer):
    """Local exploration for a window of λ steps, then one commit.

    Every replica or worker steps its own weights θ with the inner
    `optimizer` for `local_steps` steps, sending nothing, then commits a Δ
    computed from θ and the center θ_c. Subclass it and override the
    `CommitRules` (`commit_delta`, `commit_scale`, `local_after_commit`,
    `resets_to_center`) for a new algorithm, as AGN, DOWNPOUR, DynSGD,
    AEASGD and EAMSGD do; they run synchronously under `MirroredStrategy`
    and asynchronously in `tf_agn.strategies.fit` and `simulate`.

    Synchronously, the replicas' Δ_r are combined with `aggregation_method`
    and the `outer_optimizer` applies the result to θ_c as the
    pseudo-gradient −Δ (by default SGD(1.0): θ_c ← θ_c + Δ; with Nesterov
    momentum, DiLoCo). The inner optimizer's state stays per replica. At
    the end of `fit` a partial window is committed, so the weights are the
    center after. Under mixed precision even a local step is skipped on
    every replica when one overflows: the loss scale is shared.

    Example:

    ```python
    class Averaging(tf_agn.optimizers.WindowedOptimizer):
        def commit_delta(self, local, reference):
            return (local - reference) / self.local_steps
    ```

    Args:
        optimizer: the inner Keras optimizer every replica or worker steps
            with, locally.
        local_steps: λ, the number of local steps per window (an int >= 1).
        aggregation_method: how the replicas' commits are combined
            synchronously: an `AggregationMethod` or its name. None takes
            the default of the strategy's `tf_agn.AggregatingAllReduce`.
        outer_optimizer: the Keras optimizer that applies the combined Δ to
            the center; default `keras.optimizers.SGD(1.0)`. Only its update
            rule is used, not its clipping or weight decay.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit (its step counter keeps counting).
        compression: how the commits travel: None (the strategy's
            `compression`, if any), "fp16", "bf16", "int8",
            `tf_agn.compression.PowerSGD(rank=r)` or any
            `tf_agn.compression` compressor. Synchronously, int8 and
            PowerSGD keep each replica's residual of its Δ_r as optimizer
            variables, and their `start_step` counts commits; to a
            parameter server, each worker keeps its own residual
            (`tf_agn.strategies.commit_server`).
        name: the optimizer's name.

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: if `local_steps` is not an int >= 1, the outer learning
            rate is not positive, `aggregation_method` or `compression` is
            unknown, the inner optimizer accumulates gradients (the window
            already does), or has an aggregation method other than "none"
            (its steps are local).
    """

    def __init__(
        self,
        optimizer,
        local_steps,
        aggregation_method="mean",
        outer_optimizer=None,
        reset_inner_state=False,
        compression=None,
        name=None,
    ):
        owner = type(self).__name__
        _check_local_inner_optimizer(owner, optimizer, local_steps)
        check_wrappable(owner, optimizer, {})
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(learning_rate=1.0)
        _check_outer_optimizer(outer_optimizer)
        if aggregation_method is not None:
            aggregation_method = AggregationMethod.parse(aggregation_method)
        compression = compression_lib.get(compression)
        # The inner optimizer's own steps are local.
        super().__init__(optimizer, {"aggregation_method": "none"}, name=name)
        self.local_steps = local_steps
        self.aggregation_method = aggregation_method
        self.compression = compression
        self.outer_optimizer = outer_optimizer
        self.reset_inner_state = bool(reset_inner_state)
        self._swap_function = None
        # The positions among the built variables of those `apply` was given.
        self._applied = set()

    @property
    def aggregation(self):
        """The `AggregationMethod` the commits use: `aggregation_method`, or
        the strategy's default."""
        if self.aggregation_method is not None:
            return self.aggregation_method
        return default_aggregation(_compat.creation_strategy(self))

    def build(self, var_list):
        if self.built:
            return
        _check_not_parameter_server(self)
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
        self._compression_state = add_compression_state(self, var_list, self.resolved_compression)

    @property
    def variables(self):
        # In this order, as files saved by earlier releases hold them.
        return super().variables + self.outer_optimizer.variables

    @property
    def center_variables(self):
        """θ_c, the weights every replica starts its window from."""
        return list(self._centers)

    def memory_stats(self):
        """The bytes one replica holds: see
        `tf_agn.optimizers.Aggregating.memory_stats`; the centers and the
        inner and outer optimizers' states are optimizer state."""
        commit_state = [v for state in self._compression_state for v in state.values()]
        return memory_stats(_compat.built_variables(self), self.variables, (), commit_state)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
        built = _compat.built_variables(self)
        # Commits move the variables this optimizer steps (Keras's `apply`
        # takes any of those built: a GAN's optimizer may be built on every
        # variable and step only its own), known while the step is traced.
        self._applied.update(
            _compat.variable_index(self.inner_optimizer, v) for v in trainable_variables or built
        )
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

    def _commit(self):
        """A synchronous commit, in replica context."""
        built = _compat.built_variables(self)
        # In the order built, the same on every replica and worker.
        indices = sorted(self._applied) or range(len(built))
        variables = [built[i] for i in indices]
        centers = [self._centers[i] for i in indices]
        deltas = [
            self.commit_delta(variable, center)
            for variable, center in zip(variables, centers)
        ]
        combined = aggregate(
            deltas,
            self.aggregation,
            compressor=self.resolved_compression,
            state=[self._compression_state[i] for i in indices],
            step=self.outer_optimizer.iterations,
            counter=self._communication,
        )
        # The center update runs per replica, like the local steps: every
        # replica holds the same combined Δ, so the copies of θ_c stay equal.
        self.apply_to_center(combined, centers)
        for variable, delta, center in zip(variables, deltas, centers):
            variable.assign(self.local_after_commit(variable, delta, center))
        if self.reset_inner_state:
            for slot in optimizer_state(self.inner_optimizer):
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

    def swap_weights_and_center(self):
        """Exchanges every replica's copy of the weights with the center.

        Called twice, it restores both exactly. `tf_agn.callbacks.
        EvaluateAtCenter` uses it so that evaluation and prediction mid-window
        see θ_c, not each replica's exploration.
        """
        if not self.built:
            return
        if self._swap_function is None:
            self._swap_function = _in_replica_context(
                self, functools.partial(_swap, _compat.built_variables(self), self._centers)
            )
        self._swap_function()

    def finalize_variable_values(self, var_list):
        """Commits a partial window at the end of `fit`."""
        if self.built:
            steps_into_window = int(
                self.inner_optimizer.iterations.numpy() % self.local_steps
            )
            if steps_into_window:
                _in_replica_context(self, self._commit)()
        super().finalize_variable_values(var_list)

    def get_config(self):
        method = self.aggregation_method
        return {
            **super().get_config(),
            "local_steps": self.local_steps,
            "aggregation_method": None if method is None else method.value,
            "outer_optimizer": keras.saving.serialize_keras_object(self.outer_optimizer),
            "reset_inner_state": self.reset_inner_state,
            "compression": compression_lib.serialize(self.compression),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for entry, meaningless in _FORMER_CONFIG_ENTRIES.items():
            if config.pop(entry, meaningless) != meaningless:
                raise ValueError(
                    f"{cls.__name__} has no {entry}; this config sets it to "
                    f"{config.get(entry)!r}."
                )
        config["outer_optimizer"] = keras.saving.deserialize_keras_object(
            config["outer_optimizer"], custom_objects=custom_objects
        )
        return super().from_config(config, custom_objects=custom_objects)


def _in_replica_context(optimizer, fn):
    """A graph function that runs `fn` on every replica of `optimizer`'s
    strategy."""
    # `strategy.run` goes inside the tf.function, as TensorFlow requires for
    # functions that synchronize replicas.
    return tf.function(lambda: _compat.creation_strategy(optimizer).run(fn), autograph=False)


def _swap(variables, centers):
    """Exchanges each variable's value with its center's, in replica
    context: each assign writes this replica's copy only."""
    for variable, center in zip(variables, centers):
        # `tf.identity` takes a snapshot; a converted variable would be
        # read only when used, after the assign below.
        local = tf.identity(variable.value)
        variable.assign(center)
        center.assign(local)


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
        counters.update(id(v) for v in communication.counts.values())
    return [v for v in optimizer.variables if id(v) not in counters]


def _check_not_parameter_server(optimizer):
    """Raises unless `optimizer` was created outside `ParameterServerStrategy`."""
    if isinstance(
        _compat.creation_strategy(optimizer), tf.distribute.experimental.ParameterServerStrategy
    ):
        # Keras 3's fit and train steps cannot drive this strategy; its
        # windows run through tf_agn's own asynchronous executor.
        raise ValueError(
            f"{type(optimizer).__name__} runs asynchronously under "
            "ParameterServerStrategy through tf_agn.strategies.fit(model, "
            "dataset_fn, ...), not through model.fit or optimizer.apply."
        )


def _current_value_of(variable):
    """An initializer that copies `variable`'s value when it runs."""
    return lambda shape, dtype: ops.cast(ops.convert_to_tensor(variable), dtype)


def _check_local_inner_optimizer(owner, optimizer, local_steps):
    """Raises unless `local_steps` is an int >= 1 and `optimizer` steps
    locally, once per step."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1; received {local_steps!r}.")
    accumulation = getattr(optimizer, "gradient_accumulation_steps", None)
    if accumulation:
        raise ValueError(
            f"{owner} takes no gradient_accumulation_steps (received "
            f"{accumulation!r}): its window of local_steps already combines "
            "replicas once per window. Either take local_steps optimizer steps "
            "per commit here, or accumulate with "
            "tf_agn.optimizers.DistributedOptimizer."
        )
    if not isinstance(optimizer, Aggregating):
        return
    own = optimizer.aggregation_method
    if own in (None, AggregationMethod.NONE):
        return
    # The window's local steps communicate nothing; an inner method chosen
    # by the user would be silently replaced, when they likely meant the
    # commits'.
    raise ValueError(
        f"{owner}'s inner optimizer steps locally: its aggregation_method "
        f"must be None or 'none'; received {own.value!r} on "
        f"{optimizer.name!r}. Pass aggregation_method={own.value!r} to "
        f"{owner} to combine the commits that way."
    )


def _check_outer_optimizer(outer_optimizer):
    """Raises unless `outer_optimizer` is a Keras optimizer whose learning
    rate is positive, a schedule or a callable."""
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer; received "
            f"{outer_optimizer!r}."
        )
    if getattr(outer_optimizer, "shard_optimizer_state", False):
        # The commit applies it in place on every replica's center.
        raise ValueError(
            f"outer_optimizer {type(outer_optimizer).__name__}(shard_optimizer_"
            "state=True) is not supported yet: a windowed optimizer steps its "
            "outer optimizer whole on every replica. Pass it with "
            "shard_optimizer_state=False."
        )
    _compat.check_updates_in_place(outer_optimizer)
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
