"""`Staleness`: how far behind the center each applied commit was, as
`fit` and `simulate` record it."""

import collections

import keras
import numpy as np
import tensorflow as tf


class Staleness:
    """Per-commit staleness: server updates between a pull and its commit.

    `fit` and `simulate` record one sample per applied commit.

    Attributes:
        counts: `{staleness: number of applied commits}`.

    Example:

    ```python
    history = tf_agn.strategies.fit(model, dataset_fn, steps_per_epoch=40)
    values, counts = history.staleness.histogram()
    print(history.staleness.mean)
    ```
    """

    def __init__(self):
        self.counts = collections.Counter()

    def record(self, staleness):
        """Counts one applied commit of `staleness`."""
        self.counts[int(staleness)] += 1

    def histogram(self):
        """Returns `(staleness values, counts)` as sorted numpy arrays."""
        values = np.array(sorted(self.counts), dtype=np.int64)
        return values, np.array([self.counts[v] for v in values], np.int64)

    def values(self):
        """Every recorded staleness, one entry per applied commit."""
        values, counts = self.histogram()
        return np.repeat(values, counts)

    @property
    def mean(self):
        """The mean staleness; 0.0 before any commit."""
        values = self.values()
        return float(values.mean()) if values.size else 0.0


def write_staleness_histogram(callback_list, staleness, epoch):
    """Writes `staleness` as a histogram for each TensorBoard callback of
    `callback_list`, at step `epoch`."""
    for callback in callback_list.callbacks:
        if isinstance(callback, keras.callbacks.TensorBoard):
            writer = tf.summary.create_file_writer(callback.log_dir + "/train")
            with writer.as_default():
                tf.summary.histogram("staleness", staleness.values(), step=epoch)
            writer.flush()
