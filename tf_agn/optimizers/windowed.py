"""`WindowedOptimizer`: λ local steps, then a commit."""

import functools

import keras
from keras import ops
import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression as compression_lib
from tf_agn.collectives import agreement
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.communication import CommunicationCounter
from tf_agn.collectives.cross_device_ops import default_aggregation
from tf_agn.collectives.routing import aggregate
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.commit_rules import CommitRules
from tf_agn.optimizers.communicating import Communicating
from tf_agn.optimizers.compressor_state import add_compressor_state
from tf_agn.optimizers.wrapping import WrappingOptimizer
from tf_agn.optimizers.wrapping import check_wrappable
from tf_agn.utils.memory import memory_stats

# Settings older configs wrote with these meaningless values.
_FORMER_CONFIG_ENTRIES = {"accumulation_reduction": "mean", "sparse_gradients": None}


@keras.saving.register_keras_serializable(package="tf_agn")
class WindowedOptimizer(CommitRules, Communicating, WrappingOptimizer):
    """Local exploration for a window of λ steps, then one commit.

    Every replica or worker steps its own weights θ with the inner
    `optimizer` for `local_steps` steps, sending nothing, then commits a Δ
    computed from θ and the center θ_c. Override the `CommitRules` for a new
    algorithm. Synchronously the replicas' Δ are combined and
    `outer_optimizer` applies −Δ to θ_c as a gradient. At the end of `fit` a
    partial window is committed.

    Example:

    ```python
    class Averaging(tf_agn.optimizers.WindowedOptimizer):
        def commit_delta(self, local, reference):
            return (local - reference) / self.local_steps
    ```

    Args:
        optimizer: the inner Keras optimizer, stepped locally.
        local_steps: λ, the local steps per window (an int >= 1).
        aggregation_method: how the replicas' commits are combined: an
            `AggregationMethod` or its name; None, the strategy's default.
        outer_optimizer: applies the combined Δ to the center (only its
            update rule); default `keras.optimizers.SGD(1.0)`.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        compression: how the commits travel: None (the strategy's), "fp16",
            "bf16", "int8" or a `tf_agn.compression` compressor, whose
            `start_step` counts commits.
        name: the optimizer's name.

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: if `local_steps` is not an int >= 1, the outer learning
            rate is not positive, `aggregation_method` or `compression` is
            unknown, or the inner optimizer accumulates gradients or
            aggregates other than "none".
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
        super().__init__(optimizer, {"aggregation_method": "none"}, name=name)
        self.local_steps = local_steps
        self.aggregation_method = aggregation_method
        self.compression = compression
        self.outer_optimizer = outer_optimizer
        self.reset_inner_state = bool(reset_inner_state)
        self._swap_function = None
        # Positions among the built variables of those `apply` was given.
        self._applied = set()

    @property
    def aggregation(self):
        """The `AggregationMethod` the commits use."""
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
            self.compressor,
            ("local_steps", self.local_steps),
            var_list,
            schedule=self._commit_schedule(),
        )
        super().build(var_list)
        # Not an assign: built while tracing, it would land in that graph only.
        self._centers = [
            self.add_variable_from_reference(
                v, name="center", initializer=_current_value_of(v)
            )
            for v in var_list
        ]
        self.outer_optimizer.build(self._centers)
        self._communication = CommunicationCounter(self)
        self._compression_state = add_compressor_state(
            self, self._compressed_values(var_list), self.compressor
        )

    def _compressed_values(self, var_list):
        """What travels, each with its own compressor state: the variables
        (pieces of them for `StreamingDiLoCo`)."""
        return var_list

    def _commit_schedule(self):
        """Settings besides `local_steps` that decide which step commits
        what, as `(name, int)` pairs every worker must share."""
        return ()

    @property
    def variables(self):
        # The order saved files hold them in.
        return super().variables + self.outer_optimizer.variables

    @property
    def center_variables(self):
        """θ_c, the weights every replica starts its window from."""
        return list(self._centers)

    def memory_stats(self):
        """See `tf_agn.optimizers.Aggregating.memory_stats`."""
        commit_state = [v for state in self._compression_state for v in state.values()]
        return memory_stats(_compat.built_variables(self), self.variables, (), commit_state)

    def apply(self, grads, trainable_variables=None):
        self._record_applied(trainable_variables)
        self.inner_optimizer.apply(grads, trainable_variables)
        in_cross_replica_context(self._commit_if_window_ends)

    def _record_applied(self, trainable_variables):
        """Builds on the first call; records which variables are stepped."""
        if not self.built:
            self.build(trainable_variables)
        built = _compat.built_variables(self)
        # Commits move only the variables stepped (a GAN's optimizer may be
        # built on every variable and step only its own).
        self._applied.update(
            _compat.variable_index(self.inner_optimizer, v) for v in trainable_variables or built
        )

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
            compressor=self.compressor,
            state=[self._compression_state[i] for i in indices],
            step=self.outer_optimizer.iterations,
            counter=self._communication,
        )
        # Per replica: the combined Δ is the same, so θ_c's copies stay equal.
        self.apply_to_center(combined, centers)
        for variable, delta, center in zip(variables, deltas, centers):
            variable.assign(self.local_after_commit(variable, delta, center))
        if self.reset_inner_state:
            for slot in optimizer_state(self.inner_optimizer):
                slot.assign(ops.zeros_like(slot))

    def apply_to_center(self, deltas, centers):
        """θ_c ← the outer optimizer's step with gradient −`deltas`."""
        _compat.update_step_in_place(
            self.outer_optimizer,
            [ops.negative(delta) for delta in deltas],
            centers,
            self.outer_optimizer.learning_rate,
        )
        self.outer_optimizer.iterations.assign_add(1)

    def swap_weights_and_center(self):
        """Exchanges every replica's copy of the weights with the center;
        called twice, it restores both exactly."""
        if not self.built:
            return
        if self._swap_function is None:
            self._swap_function = _in_replica_context(
                self, functools.partial(_swap, _compat.built_variables(self), self._centers)
            )
        self._swap_function()

    def replica_state_variables(self):
        """The optimizer variables each replica holds its own value of
        between commits: the inner optimizer's. A backup resumed on another
        number of replicas gives every replica their old mean."""
        return list(self.inner_optimizer.variables)

    def resume_from_centers(self):
        """Steps back to the start of the window: called where a resume on
        another replica count replaced the weights with the centers, which
        were committed there."""
        iterations = self.inner_optimizer.iterations
        iterations.assign(iterations.numpy() // self.local_steps * self.local_steps)

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


def in_cross_replica_context(fn):
    """Calls `fn(strategy)` in cross-replica context, from either context."""
    context = tf.distribute.get_replica_context()
    if context is None:
        fn(tf.distribute.get_strategy())
    else:
        # TensorFlow refuses a `merge_call` inside a `tf.cond` in replica
        # context, so the window test runs in cross-replica context.
        context.merge_call(fn)


def _in_replica_context(optimizer, fn):
    """A graph function that runs `fn` on every replica of `optimizer`'s
    strategy."""
    return tf.function(lambda: _compat.creation_strategy(optimizer).run(fn), autograph=False)


def _swap(variables, centers):
    """Exchanges each variable's value with its center's, in replica context."""
    for variable, center in zip(variables, centers):
        # A snapshot: a converted variable would be read after the assign.
        local = tf.identity(variable.value)
        variable.assign(center)
        center.assign(local)


def optimizer_state(optimizer):
    """A built optimizer's per-weight state: its variables but the counters."""
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
        raise ValueError(
            f"{type(optimizer).__name__} runs asynchronously under "
            "ParameterServerStrategy through tf_agn.strategies.fit(model, "
            "dataset_fn, ...), not through model.fit or optimizer.apply."
        )


def _current_value_of(variable):
    """An initializer that copies `variable`'s value when it runs."""
    return lambda shape, dtype: ops.cast(ops.convert_to_tensor(variable), dtype)


def _check_local_inner_optimizer(owner, optimizer, local_steps):
    """Raises unless `local_steps` is an int >= 1 and `optimizer` steps locally."""
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
    # Not silently replaced: the user likely meant the commits' method.
    raise ValueError(
        f"{owner}'s inner optimizer steps locally: its aggregation_method "
        f"must be None or 'none'; received {own.value!r} on "
        f"{optimizer.name!r}. Pass aggregation_method={own.value!r} to "
        f"{owner} to combine the commits that way."
    )


def _check_outer_optimizer(outer_optimizer):
    """Raises unless `outer_optimizer` is a Keras optimizer with a positive rate."""
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer; received "
            f"{outer_optimizer!r}."
        )
    if getattr(outer_optimizer, "shard_optimizer_state", False):
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
