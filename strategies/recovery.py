"""How `fit` survives a worker's death (`fetch_window`: no window is lost)
and a parameter server's (`checkpoint_manager`: at most one checkpoint
interval is lost).
"""

import tensorflow as tf


def fetch_window(result, reschedule, attempts=3):
    """A window's `(loss, staleness, outcome)`, surviving its worker's death.

    Args:
        result: the window's `RemoteValue`.
        reschedule: a callable that schedules the window again and returns
            its new `RemoteValue`.
        attempts: how many fetches to try before re-raising.
    """
    for attempt in range(attempts):
        try:
            return result.fetch()
        except tf.errors.UnavailableError:
            # A window's return values stay on its worker until fetched. If
            # that worker died after the window finished, the
            # ClusterCoordinator does not re-run it, and the fetch fails
            # although the commit is on the servers. The rerun elsewhere is
            # answered DUPLICATE (never applied twice) with the rerun's loss;
            # only that commit's staleness sample is lost.
            if attempt == attempts - 1:
                raise
            result = reschedule()


def checkpoint_manager(model, server, checkpoint_dir):
    """A `tf.train.CheckpointManager` of the center, the server's counters
    and its record of applied windows, restored from the latest checkpoint
    in `checkpoint_dir`; None without a `checkpoint_dir`."""
    if checkpoint_dir is None:
        return None
    checkpoint = tf.train.Checkpoint(model=model, **server.checkpoint_items())
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
    return manager
