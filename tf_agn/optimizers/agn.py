"""`AGN`: Accumulated Gradient Normalization."""

import keras
from keras import ops

from tf_agn.optimizers.windowed import WindowedOptimizer


@keras.saving.register_keras_serializable(package="tf_agn")
class AGN(WindowedOptimizer):
    """Accumulated Gradient Normalization (Hermans et al., 2017).

    Every replica or worker takes λ = `local_steps` steps from the center
    θ_c, then commits Δ = (θ − θ_c) / λ. Synchronously the replicas' Δ are
    combined once per window and `outer_optimizer` applies the result (with
    outer Nesterov momentum, DiLoCo); asynchronously
    (`tf_agn.strategies.fit`) each commit is applied as it arrives.

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
        optimizer: the inner Keras optimizer; default `Adam()`, the paper's.
        local_steps: λ, the local steps per window (the paper suggests
            λ ≈ (workers + layers) / 2).
        aggregation_method: how replicas' Δ are combined synchronously.
        outer_optimizer: applies the combined Δ; default `SGD(1.0)`.
        normalize: whether Δ is divided by λ; False is DOWNPOUR's commit.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        staleness_scaling: whether the server scales a commit τ commits
            stale by min(1, λ / (τ + 1)); for more asynchronous workers than λ.
        name: the optimizer's name.
        compression: how each commit's Δ travels.
        **kwargs: more arguments of `tf_agn.optimizers.WindowedOptimizer`.

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: if `local_steps` is not an int >= 1, the outer learning
            rate is not positive, or `aggregation_method` is unknown.
    """

    def __init__(
        self,
        optimizer=None,
        local_steps=12,
        aggregation_method="mean",
        outer_optimizer=None,
        normalize=True,
        reset_inner_state=False,
        staleness_scaling=False,
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
        self.normalize = bool(normalize)
        self.staleness_scaling = bool(staleness_scaling)

    def commit_delta(self, local, reference):
        """Δ = (θ − θ_ref) / λ, or θ − θ_ref with `normalize=False`."""
        # Dividing by λ keeps many workers' stale commits from overshooting.
        delta = super().commit_delta(local, reference)
        if not self.normalize:
            return delta
        return ops.divide(delta, ops.cast(self.local_steps, delta.dtype))

    def commit_scale(self, staleness):
        """1, or min(1, λ / (staleness + 1)) with `staleness_scaling`."""
        if not self.staleness_scaling:
            return super().commit_scale(staleness)
        # Ours, not the paper's: n workers' commits are about n − 1 stale and
        # a round moves the center about n steps, which overshoots once n > λ
        # (benchmarks/README.md); this caps a round at about λ steps.
        return ops.minimum(
            1.0,
            ops.divide(
                float(self.local_steps), ops.add(ops.cast(staleness, "float32"), 1.0)
            ),
        )

    def get_config(self):
        config = super().get_config()
        config["normalize"] = self.normalize
        config["staleness_scaling"] = self.staleness_scaling
        return config
