"""`Trainer`: the Keras-like `compile`, `fit`, `evaluate` and `predict` of
a `DecoupledModel`."""

import keras
import numpy as np
import tensorflow as tf

from tf_agn import _compat
from tf_agn.decoupled import loops
from tf_agn.decoupled.metrics import Metrics
from tf_agn.decoupled.pipeline import Pipeline
from tf_agn.decoupled.pipeline import build_stages


class Trainer:
    """`compile`, `fit`, `evaluate` and `predict`, as `keras.Model` has them."""

    def compile(self, optimizer="rmsprop", loss=None, metrics=None):
        """Sets the optimizer every stage copies, the loss and the metrics.

        Args:
            optimizer: a Keras optimizer or its name; each stage gets a
                fresh copy from its config.
            loss: a Keras loss, its name or a function `(y_true, y_pred)`.
            metrics: a list of Keras metrics or their names.
        """
        optimizer = keras.optimizers.get(optimizer)
        self.optimizers = [
            optimizer.__class__.from_config(optimizer.get_config()) for _ in self.stages
        ]
        loss = keras.losses.get(loss)
        self.loss = (
            loss if isinstance(loss, keras.losses.Loss) else _compat.LossFunctionWrapper(loss)
        )
        self._metrics = Metrics(metrics)
        self._pipeline = None
        self._predict_function = None

    def fit(
        self,
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_data=None,
        shuffle=True,
    ):
        """Trains for `epochs` passes over `(x, y)`, like `keras.Model.fit`.

        Every epoch feeds its batches one per tick, then drains the
        pipeline, so callbacks see all its batches applied. Accumulators are
        not flushed: fewer than M remaining backward passes wait.

        Args:
            x: the training inputs, a numpy array.
            y: the training labels.
            batch_size: examples per batch; a last partial batch is dropped.
            epochs: passes over the data.
            verbose: 0 silent, 1 progress bar, 2 one line per epoch; "auto"
                is 1.
            callbacks: Keras callbacks; their `model` is this model.
            validation_data: `(x_val, y_val)`, evaluated after every epoch.
            shuffle: reshuffle the training data every epoch.

        Returns:
            The `keras.callbacks.History` of the run.

        Raises:
            RuntimeError: if the model is not compiled.
            ValueError: if there are fewer examples than `batch_size`.
        """
        self._check_compiled()
        x, y = np.asarray(x), np.asarray(y)
        num_batches = len(x) // batch_size
        if num_batches < 1:
            raise ValueError(
                f"fit needs at least batch_size={batch_size} examples; "
                f"received {len(x)}."
            )
        pipeline = self._pipeline_for(x[:batch_size], y[:batch_size])
        return loops.fit(
            self, pipeline, x, y, num_batches, batch_size,
            epochs, verbose, callbacks, validation_data, shuffle,
        )

    def evaluate(self, x, y, batch_size=32, verbose=0, return_dict=False):
        """The loss and metrics on `(x, y)`, the stages run in sequence.

        Args:
            x: the inputs, a numpy array.
            y: their labels.
            batch_size: examples per batch.
            verbose: accepted for Keras compatibility, and ignored.
            return_dict: return a dict of the loss and metrics.

        Returns:
            The loss if no metrics were compiled, else `[loss, *metrics]`,
            or a dict of them with `return_dict`.

        Raises:
            RuntimeError: if the model is not compiled.
        """
        self._check_compiled()
        logs = loops.evaluate(self, x, y, batch_size, verbose, self._metrics)
        if return_dict:
            return logs
        return logs["loss"] if len(logs) == 1 else list(logs.values())

    def predict(self, x, batch_size=32, verbose=0):
        """The model's output on `x`, in inference mode.

        Args:
            x: the inputs, a numpy array.
            batch_size: examples per batch.
            verbose: accepted for Keras compatibility, and ignored.

        Returns:
            The outputs, a numpy array.
        """
        del verbose
        if self._predict_function is None:
            self._predict_function = tf.function(self._forward, reduce_retracing=True)
        outputs = [
            self._predict_function(x[start : start + batch_size])
            for start in range(0, len(x), batch_size)
        ]
        return np.concatenate([keras.ops.convert_to_numpy(o) for o in outputs])

    def _forward(self, x, training=False):
        for stage, device in zip(self.stages, self.devices):
            with tf.device(device):
                x = stage(x, training=training)
        return x

    def _check_compiled(self):
        if self.optimizers is None:
            raise RuntimeError(
                "Call compile(optimizer, loss, metrics) before fit or evaluate."
            )

    def _pipeline_for(self, x_batch, y_batch):
        """The pipeline for this batch size, built on first use."""
        batch_size = len(x_batch)
        if self._pipeline is not None and self._pipeline.batch_size == batch_size:
            return self._pipeline
        specs, predictions = build_stages(
            self.stages, self.devices, self.optimizers, x_batch
        )
        self._metrics.build(y_batch, predictions)
        self._pipeline = Pipeline(
            self.stages,
            self.devices,
            self.optimizers,
            self.schedule,
            self.accumulation_steps,
            self.reduction,
            self.loss,
            self._metrics,
            batch_size,
            specs,
            tf.TensorSpec(y_batch.shape[1:], tf.as_dtype(y_batch.dtype)),
        )
        return self._pipeline
