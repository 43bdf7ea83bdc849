"""`CommitRules`: what a windowed optimizer's workers commit, and what
the commits do to the center and to the workers."""

from keras import ops


class CommitRules:
    """The update rules of a windowed optimizer, DOWNPOUR's by default.

    Override them to make a new algorithm (as AGN and its baselines do);
    keep each pure and working on one tensor at a time, as synchronous
    commits (`tf_agn.optimizers.WindowedOptimizer`), `tf_agn.strategies.fit`
    and `tf_agn.strategies.simulate` all run the same methods.

    Attributes:
        resets_to_center: whether a window starts from a fresh pull of the
            center (AGN, DOWNPOUR, DynSGD), or the worker keeps its own
            weights and pulls the center only to commit (the elastic
            methods).
    """

    resets_to_center = True

    def commit_delta(self, local, reference):
        """What a worker commits: Δ = θ − θ_ref (DOWNPOUR's rule).

        Args:
            local: the worker's weight θ after its local steps.
            reference: θ_ref, the center as the worker pulled it.

        Returns:
            The tensor Δ.
        """
        return ops.subtract(local, reference)

    def commit_scale(self, staleness):
        """The factor the server applies a commit with: 1.

        Args:
            staleness: the number of commits the server applied between the
                worker's pull and this commit, a scalar tensor (0 for a
                synchronous commit).

        Returns:
            A float32 scalar.
        """
        del staleness
        return ops.ones((), "float32")

    def local_after_commit(self, local, delta, center):
        """The worker's weight after its commit: the new center.

        Args:
            local: the worker's weight θ before the commit.
            delta: the Δ it committed.
            center: the center θ_c after the commit.

        Returns:
            The worker's new weight.
        """
        del local, delta
        return center
