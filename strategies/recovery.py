"""How `fit` survives failures: of a worker, and of a parameter server.

A worker's death loses no window: the `ClusterCoordinator` re-runs it
elsewhere, and `fetch_window` re-runs one whose result was lost with its
worker. A parameter server's death loses at most one checkpoint interval:
`checkpoint_manager` saves the center, the server's counters and the record
of applied windows, and a restarted run resumes from them.
"""

import tensorflow as tf


def fetch_window(result, reschedule, attempts=3):
    """A window's `(loss, staleness, outcome)`, surviving its worker's death.

    A window's return values stay on the worker that ran it until fetched.
    If that worker dies after the window finished, TensorFlow does not run
    it again, and the fetch fails although the commit is on the servers.
    The window is then run again elsewhere: the server answers DUPLICATE
    (never applying it twice) with the rerun's loss, and only that
    commit's staleness sample is lost.
    """
    for attempt in range(attempts):
        try:
            return result.fetch()
        except tf.errors.UnavailableError:
            if attempt == attempts - 1:
                raise
            result = reschedule()


def checkpoint_manager(model, server, checkpoint_dir):
    """A `tf.train.CheckpointManager` of the center and `server`'s state,
    restored from the latest checkpoint in `checkpoint_dir`; None without
    a `checkpoint_dir`."""
    if checkpoint_dir is None:
        return None
    checkpoint = tf.train.Checkpoint(model=model, **server.checkpoint_items())
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
    return manager
