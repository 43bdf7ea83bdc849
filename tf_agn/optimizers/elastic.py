"""`AEASGD` and `EAMSGD`: asynchronous elastic averaging."""

import keras
from keras import ops

from tf_agn.optimizers.windowed import WindowedOptimizer


@keras.saving.register_keras_serializable(package="tf_agn")
class AEASGD(WindowedOptimizer):
    """Asynchronous elastic averaging SGD (Zhang, Choromanska, LeCun, 2015).

    Workers keep their own weights θ. Every λ local steps a worker pulls
    θ_c, computes E = α(θ − θ_c) with α = ρη, and both sides move by it:
    θ ← θ − E, θ_c ← θ_c + E. Synchronously (EASGD) the replicas' E are
    summed onto the center. `.learning_rate` is the inner optimizer's.

    Args:
        optimizer: the inner optimizer; default `SGD(elastic_learning_rate)`.
        local_steps: λ, the steps between exchanges; default 32.
        rho: ρ, the elastic strength per unit learning rate.
        elastic_learning_rate: η, for α = ρη and the default inner optimizer.
        aggregation_method: how replicas' E are combined synchronously.
        outer_optimizer: applies E to the center; default `SGD(1.0)`.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every exchange.
        name: the optimizer's name.
        compression: how each exchange's E travels.
        **kwargs: more arguments of `tf_agn.optimizers.WindowedOptimizer`.

    Raises:
        TypeError: if given a `learning_rate` (η is `elastic_learning_rate`).
        ValueError: if α = ρη is not in (0, 1], or `local_steps` is not an
            int >= 1.
    """

    resets_to_center = False

    def __init__(
        self,
        optimizer=None,
        local_steps=32,
        rho=5.0,
        elastic_learning_rate=0.01,
        aggregation_method="sum",
        outer_optimizer=None,
        reset_inner_state=False,
        name=None,
        **kwargs,
    ):
        if "learning_rate" in kwargs:
            raise TypeError(
                f"{type(self).__name__} takes no learning_rate: η of the "
                "elastic force is elastic_learning_rate, and the inner "
                "optimizer's rate is set on that optimizer; received "
                f"learning_rate={kwargs['learning_rate']!r}."
            )
        moving_rate = float(rho) * float(elastic_learning_rate)
        # Above 1 the elastic move would overshoot the center.
        if not 0 < moving_rate <= 1:
            raise ValueError(
                "The elastic moving rate α = rho * elastic_learning_rate must "
                f"be in (0, 1]; received rho={rho!r}, elastic_learning_rate="
                f"{elastic_learning_rate!r} (α = {moving_rate})."
            )
        if optimizer is None:
            optimizer = self._default_inner_optimizer(elastic_learning_rate)
        super().__init__(
            optimizer,
            local_steps,
            aggregation_method=aggregation_method,
            outer_optimizer=outer_optimizer,
            reset_inner_state=reset_inner_state,
            name=name,
            **kwargs,
        )
        self.rho = float(rho)
        self.elastic_learning_rate = float(elastic_learning_rate)
        self.moving_rate = moving_rate

    @staticmethod
    def _default_inner_optimizer(learning_rate):
        """The inner optimizer when none is given: SGD(η)."""
        return keras.optimizers.SGD(learning_rate)

    def commit_delta(self, local, reference):
        """E = α(θ − θ_c), with θ_c pulled just before the exchange."""
        return ops.multiply(
            ops.cast(self.moving_rate, local.dtype),
            ops.subtract(local, reference),
        )

    def local_after_commit(self, local, delta, center):
        """θ ← θ − E: the worker moves towards the center it pulled."""
        del center
        return ops.subtract(local, delta)

    def get_config(self):
        config = super().get_config()
        config["rho"] = self.rho
        config["elastic_learning_rate"] = self.elastic_learning_rate
        return config


@keras.saving.register_keras_serializable(package="tf_agn")
class EAMSGD(AEASGD):
    """Elastic averaging momentum SGD: AEASGD with Nesterov momentum locally.

    Args: as `AEASGD`.
    """

    @staticmethod
    def _default_inner_optimizer(learning_rate):
        """SGD(η) with Nesterov momentum 0.9."""
        return keras.optimizers.SGD(learning_rate, momentum=0.9, nesterov=True)
