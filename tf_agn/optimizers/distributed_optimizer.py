"""`DistributedOptimizer`: wraps any Keras 3 optimizer to choose how replicas'
gradients are combined."""

import keras

from tf_agn import compression as compression_lib
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.optimizers.accumulation import check_accumulation_reduction
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.compressor_state import check_sparse_gradients
from tf_agn.optimizers.wrapping import WrappingOptimizer
from tf_agn.optimizers.wrapping import check_wrappable


@keras.saving.register_keras_serializable(package="tf_agn")
class DistributedOptimizer(WrappingOptimizer):
    """Wraps a Keras optimizer so replicas combine gradients by `aggregation_method`.

    The wrapped optimizer keeps its update rule, state and hyperparameters;
    only the communication changes. Wrap it before it is built.

    Example:

    ```python
    strategy = tf_agn.strategies.mirrored()
    with strategy.scope():
        model = make_model()
        model.compile(
            optimizer=tf_agn.optimizers.DistributedOptimizer(
                keras.optimizers.Adam(1e-3), aggregation_method="sum"
            ),
            loss="sparse_categorical_crossentropy",
        )
    ```

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap; its class must
            round-trip through `get_config`/`from_config`.
        aggregation_method: as `tf_agn.optimizers.Aggregating`'s. This and
            the settings below, when None, take the wrapped optimizer's own
            where it is one of tf_agn's, else the default.
        gradient_accumulation_steps: the micro-steps per applied step.
        accumulation_reduction: "mean" or "sum".
        compression: how gradients travel.
        sparse_gradients: regular expressions naming sparse variables.
        shard_optimizer_state: whether each replica keeps 1/n of the state.
        name: the wrapper's name.
        **kwargs: more arguments of `keras.optimizers.Optimizer` for the
            wrapper (`learning_rate` is refused).

    Raises:
        TypeError: if `optimizer` is not a Keras 3 optimizer, or given a
            `learning_rate` (the wrapped optimizer's is the one used).
        ValueError: if `optimizer` is built or is a `LossScaleOptimizer`,
            or a setting is invalid or differs from the wrapped optimizer's.
    """

    def __init__(
        self,
        optimizer,
        aggregation_method=None,
        name=None,
        gradient_accumulation_steps=None,
        accumulation_reduction=None,
        compression=None,
        sparse_gradients=None,
        shard_optimizer_state=None,
        **kwargs,
    ):
        check_wrappable(type(self).__name__, optimizer, kwargs)
        given = {
            "aggregation_method": (aggregation_method, _method_value),
            "accumulation_reduction": (accumulation_reduction, check_accumulation_reduction),
            "compression": (compression, _compression_value),
            "sparse_gradients": (sparse_gradients, check_sparse_gradients),
            "shard_optimizer_state": (shard_optimizer_state, bool),
        }
        settings = {
            setting: _setting_with(optimizer, setting, value, canonical)
            for setting, (value, canonical) in given.items()
        }
        if settings["accumulation_reduction"] is None:
            settings["accumulation_reduction"] = "mean"
        if settings["shard_optimizer_state"] is None:
            settings["shard_optimizer_state"] = False
        if gradient_accumulation_steps is not None:
            own = getattr(optimizer, "gradient_accumulation_steps", None)
            if own not in (None, gradient_accumulation_steps):
                raise ValueError(
                    f"gradient_accumulation_steps={gradient_accumulation_steps!r} "
                    f"given to DistributedOptimizer, but {optimizer.name!r} has "
                    f"{own!r}: set it in one place."
                )
            settings["gradient_accumulation_steps"] = gradient_accumulation_steps
        super().__init__(optimizer, settings, name=name, **kwargs)

    @property
    def aggregation(self):
        """The `AggregationMethod` in force."""
        return self.inner_optimizer.aggregation

    def communication_stats(self):
        """See `tf_agn.optimizers.Aggregating.communication_stats`."""
        return self.inner_optimizer.communication_stats()

    def memory_stats(self):
        """See `tf_agn.optimizers.Aggregating.memory_stats`."""
        return self.inner_optimizer.memory_stats()

    def apply(self, grads, trainable_variables=None):
        self.inner_optimizer.apply(grads, trainable_variables)

    def all_replicas_finite(self, grads):
        """See `tf_agn.optimizers.Aggregating.all_replicas_finite`."""
        return self.inner_optimizer.all_replicas_finite(grads)

    def apply_loss_scaled(self, apply, loss_scale):
        """See `tf_agn.optimizers.Aggregating.apply_loss_scaled`."""
        return self.inner_optimizer.apply_loss_scaled(apply, loss_scale)

    def get_config(self):
        inner = self.inner_optimizer
        method = inner.aggregation_method
        return {
            **super().get_config(),
            "aggregation_method": None if method is None else method.value,
            "accumulation_reduction": inner.accumulation_reduction,
            "compression": compression_lib.serialize(inner.compression),
            "sparse_gradients": inner.sparse_gradients,
            "shard_optimizer_state": inner.shard_optimizer_state,
        }


def _setting_with(optimizer, setting, value, canonical):
    """`canonical(value)`, or `optimizer`'s own `setting`; raises if they differ."""
    given = None if value is None else canonical(value)
    if not isinstance(optimizer, Aggregating):
        return given
    own = optimizer.get_config()[setting]
    if own is None or own is False:
        return given
    if given is None or given == own:
        return own
    raise ValueError(
        f"DistributedOptimizer's {setting} must be None or that of the "
        f"optimizer it wraps, {optimizer.name!r}: {own!r}; received "
        f"{value!r}. Set it in one place."
    )


def _method_value(method):
    """`method`'s config form."""
    return AggregationMethod.parse(method).value


def _compression_value(compression):
    """`compression`'s config form."""
    return compression_lib.serialize(compression_lib.get(compression))
