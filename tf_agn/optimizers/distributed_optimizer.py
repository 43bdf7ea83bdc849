"""`DistributedOptimizer`: wraps any Keras 3 optimizer to choose how replicas'
gradients are combined."""

import keras

from tf_agn import compression as compression_lib
from tf_agn.aggregation import AggregationMethod
from tf_agn.optimizers.accumulation import check_accumulation_reduction
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.aggregating import aggregating_class
from tf_agn.optimizers.compression_state import check_sparse_gradients


@keras.saving.register_keras_serializable(package="tf_agn")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so replicas combine gradients by `aggregation_method`.

    The wrapped optimizer keeps its own update rule, state and
    hyperparameters; only the communication changes (see
    `tf_agn.optimizers.Aggregating` for the exact order of weight decay,
    aggregation, clipping and update). Like Keras' `LossScaleOptimizer`, this
    wrapper holds no hyperparameters of its own: `learning_rate` and
    `iterations` are the inner optimizer's.

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

    Wrap an optimizer before it is built (before training). Under mixed
    precision Keras puts its `LossScaleOptimizer` around this wrapper, which
    is the right order: the loss scale is undone before gradients travel.

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap. It is rebuilt
            from its config with the aggregation mixed in, so its class must
            round-trip through `get_config`/`from_config`.
        aggregation_method: an `AggregationMethod` or its name. None (the
            default) takes the wrapped optimizer's own, if it is one of
            tf_agn's and has one, else the `aggregation` of the strategy's
            `tf_agn.AggregatingAllReduce` (MEAN under other strategies), as
            tf_agn's drop-in optimizers do.
        gradient_accumulation_steps: None, or the micro-steps k per applied
            step, as Keras' argument of that name: given here, it is set on
            the wrapped optimizer, which must not have another. Horovod
            calls it `backward_passes_per_step`.
        accumulation_reduction: None (the wrapped optimizer's own if it is
            one of tf_agn's, else "mean"), "mean" or "sum"; see
            `tf_agn.optimizers.Aggregating`.
        compression: None (the wrapped optimizer's own if it is one of
            tf_agn's, else the strategy's), or how gradients travel:
            "fp16", "bf16", "int8", `tf_agn.compression.PowerSGD(rank=r)`
            or any `tf_agn.compression` compressor; see
            `tf_agn.optimizers.Aggregating`.
        sparse_gradients: None (the wrapped optimizer's own if it is one of
            tf_agn's), or a list of regular expressions naming the
            variables whose gradients are sparse, which get no compressor
            state; see `tf_agn.optimizers.Aggregating`.
        name: the wrapper's name.
        **kwargs: more arguments of `keras.optimizers.Optimizer` for the
            wrapper (`learning_rate` is refused).

    Raises:
        TypeError: if `optimizer` is not a Keras 3 optimizer, or given a
            `learning_rate` (the wrapped optimizer's is the one used).
        ValueError: if `optimizer` is already built, is a
            `LossScaleOptimizer`, `aggregation_method` or
            `accumulation_reduction`, `compression` or `sparse_gradients`
            is bad, one of these four differs from the wrapped
            optimizer's own, or
            `gradient_accumulation_steps` is bad or set twice.
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
        **kwargs,
    ):
        if "learning_rate" in kwargs:
            # Keras' own error would be "got multiple values for keyword
            # argument", from inside its constructor.
            raise TypeError(
                f"{type(self).__name__} takes no learning_rate: the optimizer "
                "it wraps has its own; received learning_rate="
                f"{kwargs['learning_rate']!r}."
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "DistributedOptimizer wraps a keras.optimizers.Optimizer "
                f"(Keras 3); received {optimizer!r} of type "
                f"{type(optimizer).__name__}."
            )
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "Wrap the inner optimizer, not a LossScaleOptimizer: Keras "
                "adds the LossScaleOptimizer around DistributedOptimizer "
                "itself under mixed precision."
            )
        if optimizer.built:
            raise ValueError(
                f"Optimizer {optimizer.name!r} is already built. Wrap it "
                "in DistributedOptimizer before training starts."
            )
        settings = {
            "aggregation_method": (aggregation_method, _method_value),
            "accumulation_reduction": (accumulation_reduction, check_accumulation_reduction),
            "compression": (compression, _compression_value),
            "sparse_gradients": (sparse_gradients, check_sparse_gradients),
        }
        config = optimizer.get_config()
        for setting, (value, canonical) in settings.items():
            config[setting] = self._setting_with(optimizer, setting, value, canonical)
        if config["accumulation_reduction"] is None:
            config["accumulation_reduction"] = "mean"
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self._wrapped_class = type(optimizer)
        if gradient_accumulation_steps is not None:
            own = optimizer.gradient_accumulation_steps
            if own not in (None, gradient_accumulation_steps):
                raise ValueError(
                    f"gradient_accumulation_steps={gradient_accumulation_steps!r} "
                    f"given to DistributedOptimizer, but {optimizer.name!r} has "
                    f"{own!r}: set it in one place."
                )
            config["gradient_accumulation_steps"] = gradient_accumulation_steps
        self.inner_optimizer = aggregating_class(type(optimizer)).from_config(config)

    def _setting_with(self, optimizer, setting, value, canonical):
        """The wrapper's `setting` around `optimizer`, as its config holds
        it: `value`, or the optimizer's own, which must not differ.

        Args:
            optimizer: the optimizer being wrapped.
            setting: "aggregation_method", "accumulation_reduction",
                "compression" or "sparse_gradients".
            value: what the wrapper was given, None for the optimizer's own
                (None again where it has none: the strategy's default).
            canonical: maps a given value to its config form; it raises for
                an unknown one.

        Returns:
            The config value; None for the strategy's default.
        """
        given = None if value is None else canonical(value)
        if not isinstance(optimizer, Aggregating):
            return given
        own = optimizer.get_config()[setting]
        if own is None:
            return given
        if given is None or given == own:
            return own
        raise ValueError(
            f"{type(self).__name__}'s {setting} must be None or that of the "
            f"optimizer it wraps, {optimizer.name!r}: {own!r}; received "
            f"{value!r}. Set it in one place."
        )

    @property
    def aggregation(self):
        """The `AggregationMethod` in force."""
        return self.inner_optimizer.resolved_aggregation

    def communication_stats(self):
        """See `tf_agn.optimizers.Aggregating.communication_stats`."""
        return self.inner_optimizer.communication_stats()

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return super().variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        self.inner_optimizer.apply(grads, trainable_variables)

    def all_replicas_finite(self, grads):
        """See `tf_agn.optimizers.Aggregating.all_replicas_finite`."""
        return self.inner_optimizer.all_replicas_finite(grads)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def loss_scale_factor(self):
        return self.inner_optimizer.loss_scale_factor

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # Keras' LossScaleOptimizer clears this on the optimizer it wraps.
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.loss_scale_factor = value

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def plain_inner_optimizer(self):
        """A new, unbuilt copy of the wrapped optimizer, of the user's class.

        Returns:
            A `keras.optimizers.Optimizer` with the inner optimizer's
            hyperparameters and none of its state.
        """
        inner_config = self.inner_optimizer.get_config()
        if not issubclass(self._wrapped_class, Aggregating):
            for setting in Aggregating.SETTINGS:
                del inner_config[setting]
        return self._wrapped_class.from_config(inner_config)

    def get_config(self):
        # Serialize the inner optimizer as the user's own class, so that
        # loading needs nothing but Keras and tf_agn.
        plain = self.plain_inner_optimizer()
        method = self.inner_optimizer.aggregation_method
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(plain),
            "aggregation_method": None if method is None else method.value,
            "accumulation_reduction": self.inner_optimizer.accumulation_reduction,
            "compression": compression_lib.serialize(self.inner_optimizer.compression),
            "sparse_gradients": self.inner_optimizer.sparse_gradients,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


def _method_value(method):
    return AggregationMethod.parse(method).value


def _compression_value(compression):
    return compression_lib.serialize(compression_lib.get(compression))

