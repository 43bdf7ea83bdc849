"""`WrappingOptimizer`: steps with the Keras optimizer it wraps."""

import keras

from tf_agn import _compat
from tf_agn.optimizers import saving
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.aggregating import aggregating_class


class WrappingOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer that steps with the optimizer it wraps.

    `learning_rate` and `iterations` are the wrapped optimizer's, which is
    `inner_optimizer`, rebuilt with `tf_agn.optimizers.Aggregating` mixed in.

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap, not built yet.
        settings: the inner optimizer's config entries that differ from
            `optimizer`'s.
        name: the wrapper's name.
        **kwargs: more arguments of `keras.optimizers.Optimizer` for the
            wrapper (`learning_rate` is refused).

    Raises:
        TypeError: if `optimizer` is not a Keras 3 optimizer, or given a
            `learning_rate`.
        ValueError: if `optimizer` is built already, or is a
            `LossScaleOptimizer`.
    """

    def __init__(self, optimizer, settings, name=None, **kwargs):
        check_wrappable(type(self).__name__, optimizer, kwargs)
        config = dict(optimizer.get_config(), **settings)
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self._wrapped_class = type(optimizer)
        self.inner_optimizer = aggregating_class(type(optimizer)).from_config(config)
        _compat.copy_weight_decay_exclusions(optimizer, self.inner_optimizer)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the wrapped optimizer's weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return super().variables + self.inner_optimizer.variables

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

    def save_own_variables(self, store):
        saving.save(self, store)

    def load_own_variables(self, store):
        if saving.sharded_within(self):
            saving.load(self, store)
        else:
            super().load_own_variables(store)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def plain_inner_optimizer(self):
        """A new, unbuilt copy of the wrapped optimizer, of the user's class."""
        config = self.inner_optimizer.get_config()
        if not issubclass(self._wrapped_class, Aggregating):
            for setting in Aggregating.SETTINGS:
                del config[setting]
            config.pop(saving.EXCLUDED_NAMES, None)
        plain = self._wrapped_class.from_config(config)
        _compat.copy_weight_decay_exclusions(self.inner_optimizer, plain)
        return plain

    def get_config(self):
        # As the user's own class: loading needs nothing but Keras and tf_agn.
        config = {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.plain_inner_optimizer()),
        }
        return saving.with_excluded_names(config, self.inner_optimizer)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return saving.restore_excluded_names(lambda config: cls(**config), config)


def check_wrappable(owner, optimizer, kwargs):
    """Raises unless `optimizer` can be wrapped by `owner` with `kwargs`."""
    if "learning_rate" in kwargs:
        raise TypeError(
            f"{owner} takes no learning_rate: the optimizer it wraps has its "
            f"own; received learning_rate={kwargs['learning_rate']!r}."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"{owner} wraps a keras.optimizers.Optimizer (Keras 3); received "
            f"{optimizer!r} of type {type(optimizer).__name__}."
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"Wrap the inner optimizer, not a LossScaleOptimizer: Keras adds "
            f"the LossScaleOptimizer around {owner} itself under mixed precision."
        )
    if isinstance(optimizer, WrappingOptimizer):
        raise ValueError(
            f"{owner} wraps a Keras optimizer, not {type(optimizer).__name__} "
            f"{optimizer.name!r}, which wraps one itself: pass its settings to "
            f"{owner} (aggregation_method, compression, ...) around the Keras "
            "optimizer."
        )
    if optimizer.built:
        raise ValueError(
            f"Optimizer {optimizer.name!r} is already built. Wrap it in {owner} "
            "before training starts."
        )
