"""Keras callbacks for tf_agn's optimizers and fault-tolerant training."""

import keras

from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.resuming.backup_and_restore import BackupAndRestore  # noqa: F401
from tf_agn.resuming.preemption import PREEMPTED_EXIT_CODE  # noqa: F401
from tf_agn.resuming.preemption import Preempted  # noqa: F401


def _unwrap(optimizer, cls):
    """The `cls` optimizer inside wrappers such as LossScaleOptimizer."""
    while optimizer is not None and not isinstance(optimizer, cls):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer


class EvaluateAtCenter(keras.callbacks.Callback):
    """Evaluates and predicts with the center weights, not replica copies.

    For a `tf_agn.optimizers.WindowedOptimizer`: its center is swapped in
    for evaluation and prediction and swapped back exactly after, as Keras's
    `SwapEMAWeights` does.

    Example:

    ```python
    model.fit(x, y, validation_data=(x_val, y_val),
              callbacks=[tf_agn.callbacks.EvaluateAtCenter()])
    model.evaluate(x_val, y_val, callbacks=[tf_agn.callbacks.EvaluateAtCenter()])
    ```

    Raises:
        ValueError: when the model's optimizer is not (and does not wrap)
            a `WindowedOptimizer`.
    """

    def _windowed(self):
        windowed = _unwrap(self.model.optimizer, WindowedOptimizer)
        if windowed is None:
            raise ValueError(
                "EvaluateAtCenter needs a model compiled with a "
                "tf_agn.optimizers.WindowedOptimizer (AGN, DOWNPOUR, DynSGD, "
                "AEASGD, EAMSGD); its optimizer is "
                f"{type(self.model.optimizer).__name__}."
            )
        return windowed

    def _swap(self, logs=None):
        self._windowed().swap_weights_and_center()

    on_test_begin = on_test_end = _swap
    on_predict_begin = on_predict_end = _swap


class CommunicationLogger(keras.callbacks.Callback):
    """Adds the optimizer's `communication_stats()` to the epoch logs.

    Put it before `TensorBoard` or `CSVLogger` so that they see them.

    Example:

    ```python
    model.fit(x, y, epochs=2, callbacks=[tf_agn.callbacks.CommunicationLogger()])
    ```

    Raises:
        ValueError: if the model's optimizer is not (and does not wrap) a
            tf_agn optimizer.
    """

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        while not hasattr(optimizer, "communication_stats"):
            optimizer = getattr(optimizer, "inner_optimizer", None)
            if optimizer is None:
                raise ValueError(
                    "CommunicationLogger needs a tf_agn optimizer; the model "
                    f"is compiled with {type(self.model.optimizer).__name__}."
                )
        if logs is not None:
            logs.update(optimizer.communication_stats())
