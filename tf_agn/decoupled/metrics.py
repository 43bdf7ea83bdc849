"""`Metrics`: the loss and metrics a `DecoupledModel` reports."""

import keras

from tf_agn import _compat


class Metrics:
    """The mean loss and the compiled metrics of a `DecoupledModel`.

    `metrics`: a list of Keras metrics or their names, or None.
    """

    def __init__(self, metrics):
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.compiled_metrics = _compat.CompileMetrics(metrics, None) if metrics else None

    def build(self, y_true, y_pred):
        """Builds the compiled metrics for batches like these, once."""
        if self.compiled_metrics is not None and not self.compiled_metrics.built:
            self.compiled_metrics.build(y_true, y_pred)

    def update(self, loss, y_true, y_pred, sample_weight=None):
        """Adds one batch: its loss, weighted by `sample_weight`, and its
        labels and predictions."""
        self.loss_tracker.update_state(loss, sample_weight=sample_weight)
        if self.compiled_metrics is not None:
            self.compiled_metrics.update_state(y_true, y_pred)

    def reset(self):
        """Forgets every batch added so far."""
        self.loss_tracker.reset_state()
        if self.compiled_metrics is not None:
            self.compiled_metrics.reset_state()

    def logs(self):
        """`{"loss": float, <compiled metric>: float, ...}`."""
        logs = {"loss": self.loss_tracker.result()}
        if self.compiled_metrics is not None:
            logs.update(self.compiled_metrics.result())
        return {name: float(value) for name, value in logs.items()}
