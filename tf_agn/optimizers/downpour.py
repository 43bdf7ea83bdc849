"""`DOWNPOUR` and `DynSGD`: commits of the raw accumulated change."""

import keras
from keras import ops

from tf_agn.optimizers.windowed import WindowedOptimizer


# Its commit is `CommitRules.commit_delta`'s, undivided: with n asynchronous
# workers the center moves by about n windows' worth of stale exploration at
# once, and the AGN paper shows it diverging at 20 workers where 10 converge.
@keras.saving.register_keras_serializable(package="tf_agn")
class DOWNPOUR(WindowedOptimizer):
    """DOWNPOUR (Dean et al., 2012): commit the whole accumulated change.

    A worker pulls the center θ_c, takes λ local steps, and commits
    Δ = θ − θ_c, which the server adds: θ_c ← θ_c + Δ. Unlike AGN, Δ is not
    divided by λ, so it overshoots as asynchronous workers are added.

    Args:
        optimizer: the inner Keras optimizer; default `Adam()`.
        local_steps: λ; default 5.
        aggregation_method: how replicas' Δ_r are combined synchronously; default
            SUM, as n asynchronous commits would add up.
        outer_optimizer: applies a commit to the center; default
            `SGD(1.0)`.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        name: the optimizer's name.
        compression: how each commit's Δ travels, synchronously and to a
            parameter server; see `tf_agn.optimizers.WindowedOptimizer`.
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

    The server applies a commit that s other commits overtook since its
    worker's pull as θ_c ← θ_c + Δ / (s + 1). Synchronously every commit
    has staleness 0, so it is DOWNPOUR.

    Args: as `DOWNPOUR`.
    """

    def commit_scale(self, staleness):
        """1 / (staleness + 1)."""
        # staleness = u_now − u_pull: the pull returns the server's commit
        # counter, and the server reads it and applies the commit in one
        # atomic step.
        return ops.divide(1.0, ops.add(ops.cast(staleness, "float32"), 1.0))
