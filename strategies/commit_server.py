"""`CommitServer`: the parameter server's side of asynchronous training."""

import tensorflow as tf

from tf_agn import compression
from tf_agn.collectives.finite import all_finite

# What `CommitServer.apply` did with a commit.
APPLIED, REJECTED_NON_FINITE, DUPLICATE = 0, 1, 2


class CommitServer:
    """Holds the center θ_c and applies workers' commits to it, one at a time.

    The center is the model's trainable variables (on the parameter servers
    under `ParameterServerStrategy`). `apply` takes one commit atomically:
    with s = commits applied now − commits applied at the worker's pull, it
    rejects (and counts) a commit holding NaN or Inf, drops (and counts) one
    whose window was already applied, and otherwise applies
    Δ · `commit_scale(s)` with the optimizer's `apply_to_center`
    (AGN: θ_c + Δ). Every scheduled window is applied exactly once. With the
    optimizer's `compression`, commits arrive compressed
    (`tf_agn.strategies.worker.Worker.commit`); `bytes_per_commit` is what
    one sends, and `bytes_received` counts them.

    Args:
        optimizer: the `tf_agn.optimizers.WindowedOptimizer` whose rules
            apply.
        centers: the center variables (the model's trainable variables).
        num_windows: how many windows training schedules in all; window ids
            run from 0 to `num_windows - 1`.
        reject_non_finite: whether commits holding NaN or Inf are rejected.
            Turn it off only to study what a poisoned commit does.
    """

    def __init__(self, optimizer, centers, num_windows, reject_non_finite=True):
        self.optimizer = optimizer
        self.reject_non_finite = bool(reject_non_finite)
        self.centers = list(centers)
        self.commits = tf.Variable(0, dtype=tf.int64, trainable=False, name="commits")
        # Colocated variables are never partitioned, whatever the strategy's
        # `variable_partitioner`: the window record stays one variable,
        # indexed by window id, on the server that holds the counter.
        strategy = tf.distribute.get_strategy()
        with strategy.extended.colocate_vars_with(self.commits):
            self.rejected = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="rejected_commits"
            )
            self.duplicates = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="duplicate_commits"
            )
            self.applied_windows = tf.Variable(
                tf.zeros([num_windows], tf.int8),
                trainable=False,
                name="applied_windows",
            )
            self.bytes_received = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="commit_bytes_received"
            )
        # Reading the counter, applying the rule and counting the commit are
        # one atomic step under it: DynSGD's staleness needs exactly that.
        self._lock = tf.CriticalSection(name="commit_lock")
        optimizer.outer_optimizer.build(self.centers)
        self.compressor = optimizer.compressor
        self.bytes_per_commit = sum(
            commit_bytes(self.compressor, center) for center in self.centers
        )

    def pull(self):
        """Returns (copies of θ_c, the commit counter), for a worker."""
        return [tf.identity(center) for center in self.centers], tf.identity(
            self.commits
        )

    def apply(self, payloads, commits_at_pull, window_id):
        """Applies one commit atomically, as the class docstring says.

        Args:
            payloads: the commit Δ as `Worker.commit` sends it: for each
                center variable, a tuple of tensors (its Δ alone where
                nothing compresses it).
            commits_at_pull: the commit counter the worker pulled with.
            window_id: the window's id, an int64 scalar.

        Returns:
            (staleness, outcome): int64 scalars; outcome is `APPLIED`,
            `REJECTED_NON_FINITE` or `DUPLICATE`.
        """

        self.bytes_received.assign_add(self.bytes_per_commit)
        # Decompressed here, on each center's device, so that the compressed
        # payload is what crosses the network.
        deltas = [
            decode(self.compressor, payload, center)
            for payload, center in zip(payloads, self.centers)
        ]

        def locked():
            staleness = self.commits - commits_at_pull
            finite = all_finite(deltas)
            if not self.reject_non_finite:
                finite = tf.constant(True)
            # The coordinator re-runs a window whose worker died, and the
            # first run may have committed before dying.
            fresh = tf.equal(self.applied_windows[window_id], 0)

            def accept():
                scale = self.optimizer.commit_scale(staleness)
                self.optimizer.apply_to_center(
                    [delta * tf.cast(scale, delta.dtype) for delta in deltas],
                    self.centers,
                )
                self.applied_windows.scatter_nd_update(
                    [[window_id]], tf.ones([1], tf.int8)
                )
                self.commits.assign_add(1)
                return tf.constant(APPLIED, tf.int64)

            def reject():
                self.rejected.assign_add(1)
                return tf.constant(REJECTED_NON_FINITE, tf.int64)

            def drop():
                self.duplicates.assign_add(1)
                return tf.constant(DUPLICATE, tf.int64)

            outcome = tf.cond(fresh, lambda: tf.cond(finite, accept, reject), drop)
            return staleness, outcome

        return self._lock.execute(locked)

    def checkpoint_items(self):
        """What a checkpoint of the server holds, besides the model."""
        return {
            "commits": self.commits,
            "rejected_commits": self.rejected,
            "duplicate_commits": self.duplicates,
            "applied_windows": self.applied_windows,
            "commit_bytes_received": self.bytes_received,
            "outer_optimizer": self.optimizer.outer_optimizer,
        }


def commit_bytes(compressor, center):
    """The bytes a commit sends for `center`."""
    if compression.compresses(compressor, center):
        return compressor.wire_bytes([center])
    return tf.TensorShape(center.shape).num_elements() * tf.as_dtype(center.dtype).size


def decode(compressor, payload, center):
    """A commit's Δ for `center` from what the worker sent, decompressed
    on the center's device."""
    if not compression.compresses(compressor, center):
        return payload[0]
    # A sharded center (a `variable_partitioner`) has no one device: the
    # payload then goes where TensorFlow places the decompression.
    with tf.device(getattr(center.value, "device", None)):
        return compressor.decode(
            payload, tf.TensorShape(center.shape), tf.as_dtype(center.dtype)
        )
