"""The `Aggregating` mixin: how a Keras optimizer combines replicas' gradients."""

import functools

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression as compression_lib
from tf_agn.collectives import agreement
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.communication import CommunicationCounter
from tf_agn.collectives.cross_device_ops import default_aggregation
from tf_agn.optimizers import saving
from tf_agn.optimizers.accumulation import Accumulation
from tf_agn.optimizers.accumulation import add_accumulator
from tf_agn.optimizers.accumulation import check_accumulation_reduction
from tf_agn.optimizers.accumulation import check_accumulation_steps
from tf_agn.optimizers.communicating import Communicating
from tf_agn.optimizers.compressor_state import add_compressor_state
from tf_agn.optimizers.compressor_state import check_sparse_gradients
from tf_agn.optimizers.compressor_state import declared_sparse
from tf_agn.optimizers.sharded_step import ShardedStep
from tf_agn.optimizers.sharding import Shards
from tf_agn.optimizers.step import Step
from tf_agn.utils.memory import memory_stats


class Aggregating(Communicating):
    """Mixin that gives a Keras optimizer tf_agn's gradient combining.

    Each step combines the replicas' gradients with `aggregation_method`
    (Keras's 1/n loss scaling undone), then decays, clips and updates each
    replica's copy with the combined gradient, so that clipping sees what
    is applied. With NONE each replica applies its own gradient (read the
    copies with `tf_agn.replica_weights`).

    Example:

    ```python
    Lion = tf_agn.optimizers.aggregating_class(keras.optimizers.Lion)
    model.compile(optimizer=Lion(1e-4, aggregation_method="sum"), loss="mse")
    ```

    Args:
        aggregation_method: an `AggregationMethod` or its name; None takes
            the strategy's `tf_agn.AggregatingAllReduce` default, else MEAN.
        compression: "fp16", "bf16", "int8" or a `tf_agn.compression`
            compressor; None takes the strategy's.
        sparse_gradients: regular expressions (searched in `variable.path`)
            naming the variables whose gradients are `tf.IndexedSlices`;
            they travel uncompressed.
        accumulation_reduction: how `gradient_accumulation_steps` micro-step
            gradients combine: "mean" (Keras's) or "sum".
        shard_optimizer_state: whether each of n replicas keeps and updates
            1/n of the state (ZeRO-1; `tf_agn.optimizers.sharding`).
        *args, **kwargs: the Keras optimizer's own.

    Raises:
        ValueError: for a bad value of any argument above, accumulation with
            `use_ema`, or, when training, a dense gradient of a
            `sparse_gradients` variable or what cannot shard.
    """

    SETTINGS = ("aggregation_method", "accumulation_reduction", "compression",
                "sparse_gradients", "shard_optimizer_state")

    def __init__(
        self,
        *args,
        aggregation_method=None,
        accumulation_reduction="mean",
        compression=None,
        sparse_gradients=None,
        shard_optimizer_state=False,
        **kwargs,
    ):
        if "gradient_accumulation_steps" in kwargs:
            kwargs["gradient_accumulation_steps"] = check_accumulation_steps(
                kwargs["gradient_accumulation_steps"]
            )
        super().__init__(*args, **kwargs)
        if aggregation_method is not None:
            aggregation_method = AggregationMethod.parse(aggregation_method)
        self.aggregation_method = aggregation_method
        self.accumulation_reduction = check_accumulation_reduction(
            accumulation_reduction
        )
        self.compression = compression_lib.get(compression)
        self.sparse_gradients = check_sparse_gradients(sparse_gradients)
        self.shard_optimizer_state = bool(shard_optimizer_state)
        self._sharded = None
        if self.gradient_accumulation_steps and self.use_ema:
            raise ValueError(
                "tf_agn's optimizers do not combine gradient_accumulation_steps "
                "with use_ema=True yet; use one or the other."
            )
        self._step = None

    @property
    def aggregation(self):
        """The method in force: our own, or the strategy's default."""
        if self.aggregation_method is not None:
            return self.aggregation_method
        return default_aggregation(_compat.creation_strategy(self))

    def build(self, variables):
        if self.built:
            return
        check_strategy(self)
        method = self.aggregation
        # With NONE nothing travels, so nothing is compressed or kept.
        compressor = None if method is AggregationMethod.NONE else self.compressor
        # An accumulated sum is dense, whatever the gradients were.
        sparse = None if self.gradient_accumulation_steps else self.sparse_gradients
        agreement.check_optimizer_agreement(
            self,
            method,
            compressor,
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            variables,
            [declared_sparse(sparse, v) for v in variables],
        )
        if self.shard_optimizer_state:
                self._sharded = Shards.for_optimizer(self, variables, method, compressor)
        super().build(variables)
        if self._sharded is not None:
            self._sharded.register_parts(self, variables)
        self._communication = CommunicationCounter(self)
        self._compression_state = add_compressor_state(self, variables, compressor, sparse)
        accumulation = None
        if self.gradient_accumulation_steps:
            accumulation = Accumulation(
                self, self.gradient_accumulation_steps, self.accumulation_reduction
            )
        # The optimizer's own compressor, even with NONE: a cast's loss
        # scaling of the gradients depends on it.
        arguments = (self, method, self.compressor, self._compression_state, self._communication)
        if self._sharded is None:
            self._step = Step(*arguments, accumulation=accumulation)
        else:
            self._step = ShardedStep(self._sharded, *arguments, accumulation=accumulation)

    def memory_stats(self):
        """The bytes one replica holds for this optimizer and its weights, as
        `tf_agn.utils.memory.memory_stats` counts them."""
        accumulators = _compat.accumulators(self) if self.gradient_accumulation_steps else []
        return memory_stats(
            _compat.built_variables(self),
            list(self.variables) + ([] if self._sharded is None else self._sharded.parts),
            accumulators,
            [v for state in self._compression_state for v in state.values()],
        )

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        # Keras' `build` asks for its accumulators by this name.
        if name == _compat.KERAS_ACCUMULATOR_NAME:
            return add_accumulator(self, reference_variable, self.aggregation)
        if self._sharded is not None:
            return self._sharded.add_state(self, reference_variable, name or "var", initializer)
        return super().add_variable_from_reference(
            reference_variable, name=name, initializer=initializer
        )

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Keras's `apply` takes variables in any order; every replica must send
        # them in one.
        grads, trainable_variables = in_built_order(self, grads, trainable_variables)
        self._step.apply(grads, trainable_variables)
        _compat.update_moving_average(self)

    def apply_loss_scaled(self, apply, loss_scale):
        """Runs `apply()`, a `LossScaleOptimizer`'s step, under `loss_scale`;
        returns whether the combined gradients were finite (a scalar
        boolean tensor, the same on every replica)."""
        return self._step.loss_scaled(apply, loss_scale)

    def save_own_variables(self, store):
        saving.save(self, store)

    def load_own_variables(self, store):
        if self._sharded is None:
            super().load_own_variables(store)
        else:
            saving.load(self, store)

    @property
    def shards(self):
        """The `Shards` of a built optimizer whose state is sharded, else None."""
        return self._sharded

    def summed_variables(self):
        """The variables whose sum over the replicas training depends on."""
        return _compat.accumulators(self) if self.gradient_accumulation_steps else []

    def get_config(self):
        config = super().get_config()
        method = self.aggregation_method
        config["aggregation_method"] = None if method is None else method.value
        config["accumulation_reduction"] = self.accumulation_reduction
        config["compression"] = compression_lib.serialize(self.compression)
        config["sparse_gradients"] = self.sparse_gradients
        config["shard_optimizer_state"] = self.shard_optimizer_state
        return saving.with_excluded_names(config, self)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return saving.restore_excluded_names(
            lambda config: super(Aggregating, cls).from_config(config, custom_objects), config
        )


def in_built_order(optimizer, grads, variables):
    """`grads` and `variables`, sorted by the variables' positions among
    those `optimizer` was built with."""
    order = sorted(range(len(variables)), key=lambda i: _compat.variable_index(optimizer, variables[i]))
    return [grads[i] for i in order], [variables[i] for i in order]


def check_strategy(optimizer):
    """Raises if `optimizer` is used under another strategy than its own."""
    # TensorFlow's own error ("Mixing different tf.distribute.Strategy
    # objects") does not say what to do.
    current = tf.distribute.get_strategy()
    created_under = _compat.creation_strategy(optimizer)
    if current is not created_under:
        raise ValueError(
            f"Optimizer {optimizer.name!r} was created under "
            f"{type(created_under).__name__} but is used "
            f"under {type(current).__name__}. Create it inside the "
            "`strategy.scope()` where the model is compiled."
        )


def _register(cls):
    return keras.saving.register_keras_serializable(package="tf_agn")(cls)


@_register
class SGD(Aggregating, keras.optimizers.SGD, _compat.InPlaceUpdates):
    """`keras.optimizers.SGD` with an `aggregation_method` (see `Aggregating`)."""


@_register
class Adam(Aggregating, keras.optimizers.Adam, _compat.InPlaceUpdates):
    """`keras.optimizers.Adam` with an `aggregation_method` (see `Aggregating`)."""


@_register
class AdamW(Aggregating, keras.optimizers.AdamW, _compat.InPlaceUpdates):
    """`keras.optimizers.AdamW` with an `aggregation_method` (see `Aggregating`)."""


@_register
class RMSprop(Aggregating, keras.optimizers.RMSprop, _compat.InPlaceUpdates):
    """`keras.optimizers.RMSprop` with an `aggregation_method` (see `Aggregating`)."""


_DROP_INS = {
    keras.optimizers.SGD: SGD,
    keras.optimizers.Adam: Adam,
    keras.optimizers.AdamW: AdamW,
    keras.optimizers.RMSprop: RMSprop,
}


@functools.cache
def aggregating_class(optimizer_class):
    """Returns `optimizer_class` with `Aggregating` mixed in.

    Args:
        optimizer_class: a subclass of `keras.optimizers.Optimizer`.

    Returns:
        The class itself if it already aggregates, tf_agn's drop-in for the
        four Keras classes it has one for, else a new subclass.
    """
    if issubclass(optimizer_class, Aggregating):
        return optimizer_class
    if optimizer_class in _DROP_INS:
        return _DROP_INS[optimizer_class]
    return type(
        optimizer_class.__name__,
        (Aggregating, optimizer_class, _compat.InPlaceUpdates),
        {"__doc__": optimizer_class.__doc__},
    )
