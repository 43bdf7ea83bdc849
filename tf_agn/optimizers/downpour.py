"""`DOWNPOUR` and `DynSGD`: commits of the raw accumulated change."""

import keras
from keras import ops

from tf_agn.optimizers.windowed import WindowedOptimizer


@keras.saving.register_keras_serializable(package="tf_agn")
class DOWNPOUR(WindowedOptimizer):
    """DOWNPOUR (Dean et al., 2012): commit the whole accumulated change.

    A worker takes λ local steps from the center θ_c and commits
    Δ = θ − θ_c, undivided (unlike AGN), so it overshoots as asynchronous
    workers are added.

    Args:
        optimizer: the inner Keras optimizer; default `Adam()`.
        local_steps: λ; default 5.
        aggregation_method: how replicas' Δ are combined synchronously.
        outer_optimizer: applies a commit; default `SGD(1.0)`.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        name: the optimizer's name.
        compression: how each commit's Δ travels.
        **kwargs: more arguments of `tf_agn.optimizers.WindowedOptimizer`.

    Raises:
        TypeError: if an optimizer is not a Keras 3 optimizer.
        ValueError: if `local_steps` is not an int >= 1 or `aggregation_method` is
            unknown.
    """

    def __init__(
        self,
        optimizer=None,
        local_steps=5,
        aggregation_method="sum",
        outer_optimizer=None,
        reset_inner_state=False,
        name=None,
        **kwargs,
    ):
        super().__init__(
            optimizer if optimizer is not None else keras.optimizers.Adam(),
            local_steps,
            aggregation_method=aggregation_method,
            outer_optimizer=outer_optimizer,
            reset_inner_state=reset_inner_state,
            name=name,
            **kwargs,
        )


@keras.saving.register_keras_serializable(package="tf_agn")
class DynSGD(DOWNPOUR):
    """DynSGD (Jiang et al., 2017): DOWNPOUR with staleness-aware commits.

    A commit s commits stale is applied as θ_c ← θ_c + Δ / (s + 1);
    synchronously this is DOWNPOUR.

    Args: as `DOWNPOUR`.
    """

    def commit_scale(self, staleness):
        """1 / (staleness + 1)."""
        return ops.divide(1.0, ops.add(ops.cast(staleness, "float32"), 1.0))
