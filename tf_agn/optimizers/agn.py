"""`AGN`: Accumulated Gradient Normalization, synchronously across replicas."""

import keras
from keras import ops
from keras.src.optimizers import base_optimizer
from keras.src.optimizers.schedules import learning_rate_schedule
from keras.src.saving import serialization_lib
import tensorflow as tf

from tf_agn.aggregation import AggregationMethod
from tf_agn.communication import CommunicationCounter
from tf_agn.communication import communication_stats
from tf_agn.optimizers.distributed_optimizer import DistributedOptimizer
from tf_agn.replicas import aggregate
from tf_agn.replicas import default_aggregation


@keras.saving.register_keras_serializable(package="tf_agn")
class AGN(DistributedOptimizer):
    """Accumulated Gradient Normalization (Hermans et al., 2017).

    Every replica explores on its own for a window of `local_steps` = λ
    steps, then the replicas combine their normalized accumulated changes:

    1. During the window each replica applies its own gradients to its own
       copy θ_r of the weights with the inner `optimizer` (aggregation NONE:
       nothing is communicated).
    2. At the window's end each replica forms Δ_r = (θ_r − θ_c) / λ, where
       θ_c is the center the window started from (not divided by λ with
       `normalize=False`, the DOWNPOUR-style variant).
    3. The Δ_r are combined with `aggregation` (MEAN by default) in one
       packed reduction: one communication per window instead of one per
       step.
    4. The `outer_optimizer` applies the combined Δ to the center, as the
       pseudo-gradient −Δ. The default, SGD with learning rate 1, gives
       θ_c ← θ_c + Δ; SGD with Nesterov momentum gives DiLoCo (Douillard et
       al., 2023).
    5. Every replica resets its copy to the new center.

    With λ = 1, an SGD(η) inner optimizer, the default outer optimizer and
    MEAN, this is exactly synchronous SGD(η).

    The inner optimizer's state (e.g. Adam's moments) stays per replica and
    is kept across windows, as in the paper; `reset_inner_state=True`
    clears it at every commit instead (its step counter keeps counting).
    At the end of `fit` (Keras' `finalize_variable_values`) a partial window
    is committed, so the weights are the center afterwards.

    Example:

    ```python
    with tf_agn.strategies.mirrored().scope():
        model = make_model()
        model.compile(
            optimizer=tf_agn.optimizers.AGN(
                keras.optimizers.Adam(1e-3), local_steps=8
            ),
            loss="sparse_categorical_crossentropy",
        )
    ```

    Args:
        optimizer: the inner Keras optimizer every replica steps with.
        local_steps: λ, the number of local steps per window (an int >= 1).
        aggregation: how the replicas' Δ_r are combined: an
            `AggregationMethod` or its name. None takes the default of the
            strategy's `tf_agn.AggregatingAllReduce`.
        outer_optimizer: the Keras optimizer that applies the combined Δ to
            the center; default `keras.optimizers.SGD(1.0)`. Only its update
            rule is used, not its clipping or weight decay.
        normalize: whether Δ_r is divided by λ.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        name: the optimizer's name.

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: if `local_steps` is not an int >= 1, the outer learning
            rate is not positive, or `aggregation` is unknown.
    """

    def __init__(
        self,
        optimizer,
        local_steps,
        aggregation="mean",
        outer_optimizer=None,
        normalize=True,
        reset_inner_state=False,
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
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(learning_rate=1.0)
        _check_outer_optimizer(outer_optimizer)
        if aggregation is not None:
            aggregation = AggregationMethod.parse(aggregation)
        # The inner optimizer's own steps are local: aggregation NONE.
        super().__init__(optimizer, aggregation="none", name=name, **kwargs)
        self.local_steps = local_steps
        self.commit_aggregation = aggregation
        self.outer_optimizer = outer_optimizer
        self.normalize = bool(normalize)
        self.reset_inner_state = bool(reset_inner_state)
        self._swap_function = None

    @property
    def aggregation(self):
        """The `AggregationMethod` the commits use."""
        if self.commit_aggregation is not None:
            return self.commit_aggregation
        return default_aggregation(self._distribution_strategy)

    def build(self, var_list):
        if self.built:
            return
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
            nothing.
        """
        return communication_stats(self)

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
        window_ends = ops.equal(
            self.inner_optimizer.iterations % self.local_steps, 0
        )
        ops.cond(
            window_ends,
            lambda: strategy.extended.call_for_each_replica(self._commit),
            lambda: None,
        )

    def _commit(self):
        """Steps 2 to 5 of the class docstring, in replica context."""
        variables = self._trainable_variables
        scale = 1 / self.local_steps if self.normalize else 1
        deltas = [
            ops.subtract(variable, center)
            for variable, center in zip(variables, self._centers)
        ]
        combined = aggregate(deltas, self.aggregation, scale, self._communication)
        # The center update runs per replica, like the local steps: every
        # replica holds the same combined Δ, so the copies of θ_c stay equal.
        base_optimizer.BaseOptimizer._backend_update_step(
            self.outer_optimizer,
            [ops.negative(delta) for delta in combined],
            self._centers,
            self.outer_optimizer.learning_rate,
        )
        self.outer_optimizer.iterations.assign_add(1)
        for variable, center in zip(variables, self._centers):
            variable.assign(center)
        if self.reset_inner_state:
            for slot in self._inner_state():
                slot.assign(ops.zeros_like(slot))

    def _inner_state(self):
        """The inner optimizer's per-weight state, without its counters."""
        inner = self.inner_optimizer
        counting = inner._communication
        counters = {
            id(inner.iterations),
            id(inner._learning_rate),
            id(counting.calls),
            id(counting.bytes),
        }
        return [v for v in inner.variables if id(v) not in counters]

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
        return tf.function(lambda: self._distribution_strategy.run(fn))

    def _swap(self):
        # In replica context each assign writes this replica's copy only.
        for variable, center in zip(self._trainable_variables, self._centers):
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
                "aggregation": None
                if self.commit_aggregation is None
                else self.commit_aggregation.value,
                "outer_optimizer": serialization_lib.serialize_keras_object(
                    self.outer_optimizer
                ),
                "normalize": self.normalize,
                "reset_inner_state": self.reset_inner_state,
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["outer_optimizer"] = serialization_lib.deserialize_keras_object(
            config["outer_optimizer"], custom_objects=custom_objects
        )
        return super().from_config(config, custom_objects=custom_objects)


def _current_value_of(variable):
    """An initializer that copies `variable`'s value when it runs."""
    return lambda shape, dtype: ops.cast(ops.convert_to_tensor(variable), dtype)


def _check_outer_optimizer(outer_optimizer):
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer; received "
            f"{outer_optimizer!r}."
        )
    rate = outer_optimizer._learning_rate
    if isinstance(rate, learning_rate_schedule.LearningRateSchedule):
        return
    if callable(rate):
        return
    value = float(ops.convert_to_numpy(rate))
    if not value > 0:
        raise ValueError(
            f"The outer optimizer's learning rate must be > 0; received {value}."
        )
