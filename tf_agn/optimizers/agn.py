"""`AGN`: Accumulated Gradient Normalization."""

import keras
from keras import ops

from tf_agn.optimizers.windowed import WindowedOptimizer


@keras.saving.register_keras_serializable(package="tf_agn")
class AGN(WindowedOptimizer):
    """Accumulated Gradient Normalization (Hermans et al., 2017).

    Every replica or worker takes `local_steps` = λ steps from the center
    θ_c it pulled, then commits its change averaged over the window,
    Δ = (θ − θ_c) / λ, which the server adds: θ_c ← θ_c + Δ.

    Synchronously (`MirroredStrategy`) the replicas' Δ_r are combined with
    `aggregation_method` once per window and `outer_optimizer` applies the
    result; with outer Nesterov momentum this is DiLoCo (Douillard et al.,
    2023), and with λ = 1, an SGD(η) inner optimizer, the default outer
    optimizer and MEAN, synchronous SGD(η). Asynchronously
    (`tf_agn.strategies.fit` under `ParameterServerStrategy`) each commit
    is applied as it arrives.

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
        local_steps: λ, the local steps per window; default 12 (the paper's
            heuristic is λ ≈ (workers + layers) / 2).
        aggregation_method: how replicas' Δ_r are combined synchronously; default
            MEAN.
        outer_optimizer: applies the combined Δ to the center; default
            `SGD(1.0)`.
        normalize: whether Δ is divided by λ; False is DOWNPOUR's commit.
        reset_inner_state: whether the inner optimizer's state is cleared at
            every commit.
        staleness_scaling: whether the server scales a commit τ commits
            stale by min(1, λ / (τ + 1)), which helps when asynchronous
            workers outnumber λ; default False, the paper's AGN.
        name: the optimizer's name.
        compression: how each commit's Δ travels, synchronously and to a
            parameter server; see `tf_agn.optimizers.WindowedOptimizer`.
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
        # Dividing by λ makes a commit weigh like one well-informed step
        # whatever λ is, which keeps stale commits from many asynchronous
        # workers from overshooting (DOWNPOUR's undivided commit diverges as
        # workers are added).
        delta = super().commit_delta(local, reference)
        if not self.normalize:
            return delta
        return ops.divide(delta, ops.cast(self.local_steps, delta.dtype))

    def commit_scale(self, staleness):
        """1, or min(1, λ / (staleness + 1)) with `staleness_scaling`."""
        if not self.staleness_scaling:
            return super().commit_scale(staleness)
        # Ours, not the paper's. With n asynchronous workers a commit is about
        # τ = n − 1 commits stale, and a round of n commits moves the center
        # by about n normalized steps, computed from centers up to n − 1
        # commits old: once n exceeds λ that overshoots (MNIST, Adam(1e-3),
        # n = 20, λ = 10: 0.39 test accuracy, where n = 10 reaches 0.93 and
        # staleness-scaled AGN 0.91; benchmarks/README.md). The factor caps
        # a round's movement at about λ steps: the paper's advice to grow λ
        # with n (λ ≈ (n + layers) / 2), applied by the server. Commits less
        # than λ stale, and every synchronous commit, are unchanged.
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
