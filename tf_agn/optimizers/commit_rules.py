"""`CommitRules`: a windowed optimizer's update rules."""

from keras import ops


class CommitRules:
    """The update rules of a windowed optimizer, DOWNPOUR's by default.

    Override them to make a new algorithm; keep each pure and per tensor,
    as synchronous commits, `tf_agn.strategies.fit` and `simulate` share them.

    Attributes:
        resets_to_center: whether a window starts from a fresh pull of the
            center, or the worker keeps its weights (the elastic methods).
    """

    resets_to_center = True

    def commit_delta(self, local, reference):
        """What a worker commits: Δ = `local` − `reference` (DOWNPOUR's rule)."""
        return ops.subtract(local, reference)

    def commit_scale(self, staleness):
        """The float32 factor a commit `staleness` commits old is applied with: 1."""
        del staleness
        return ops.ones((), "float32")

    def local_after_commit(self, local, delta, center):
        """The worker's weight after committing `delta`: the new `center`."""
        del local, delta
        return center
