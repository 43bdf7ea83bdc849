"""`DecoupledModel`: model-parallel training with delayed, accumulated
gradients (ADL), and its DDG and BP baselines on the same machinery.

It is not a `keras.Model` driven by Keras' `fit`, on purpose: a tick is not
a batch (every epoch fills and then drains the pipeline with ticks that
feed nothing, so that validation and checkpoints see every batch applied),
and the K stages keep K optimizers, one per device, where a `keras.Model`
has one. Its `fit` runs the ticks, and `evaluate` its batches, in
`tf_agn.decoupled.loops`; its arguments are checked in
`tf_agn.decoupled.arguments`.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_agn import _compat
from tf_agn.decoupled import loops
from tf_agn.decoupled.arguments import check_accumulation
from tf_agn.decoupled.arguments import resolve_devices
from tf_agn.decoupled.arguments import stage_models
from tf_agn.decoupled.pipeline import Pipeline
from tf_agn.decoupled.schedule import Schedule


class DecoupledModel:
    """Trains K stages of a network, stage k on device k, decoupled.

    Accumulated Decoupled Learning (Zhuang, Lin and Toh, 2020, arXiv
    2012.03747) lets the K stages work at once: in every tick, stage k
    forwards the activation stage k − 1 sent it one tick earlier and
    backpropagates the batch it forwarded D_k = 2 (K − 1 − k) ticks earlier,
    with the gradient stage k + 1 sent back. It adds every backward pass to
    an accumulator and steps its own optimizer after M of them
    (`accumulation_steps`), which cuts the staleness of its gradients, the
    number of its weight updates between a batch's forward and backward,
    from D_k to about D_k / M; M >= 2 (K − 1) keeps it at most 1. With M = 1
    this is FDG. See `tf_agn.decoupled.schedule` for the timing of each
    schedule:

    - `"adl"`: decoupled forward and backward, as above.
    - `"ddg"`: decoupled backward only (Huo et al., 2018): one chained
      forward per tick, stage k's backward delayed by K − 1 − k ticks.
    - `"bp"`: ordinary backpropagation, the stages one after the other:
      exact, and the reference.

    The delayed backward of a stage stores the stage's input at forward
    time and recomputes its forward from it with the weights current at
    backward time, as ADL's official code does. Stored state, bounded:
    stage k keeps D_k inputs (a ring buffer of fixed batch size), one
    incoming activation and one incoming gradient batch, one accumulator
    per weight, and its optimizer's state. In all, ADL keeps K (K − 1) stage
    inputs plus K − 1 label batches; DDG K (K − 1) / 2; BP none.

    `mean` (the default `reduction`) applies the mean of the M accumulated
    gradients, so the learning rate means what it means for BP; the
    official code applies their sum (`reduction="sum"`), M times larger.

    Every stage has its own optimizer, a copy of the compiled one: an
    element-wise optimizer (SGD, Adam, ...) with M = 1 steps exactly as one
    optimizer over the whole model would; global-norm clipping clips each
    stage on its own.

    Example:

    ```python
    tf_agn.strategies.split_cpu(2)  # before TensorFlow starts
    stages = tf_agn.decoupled.split_model(model, 2)
    decoupled = tf_agn.decoupled.DecoupledModel(stages, accumulation_steps=2)
    decoupled.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    decoupled.fit(x_train, y_train, batch_size=128, epochs=3)
    decoupled.evaluate(x_test, y_test)
    decoupled.staleness()  # per stage: mean and histogram
    ```

    Args:
        stages: K stages, each a Keras model, a layer or a list of layers
            (made a `keras.Sequential`), stage k's output feeding stage
            k + 1; e.g. from `split_model`.
        devices: one device name per stage; None takes the first K logical
            GPUs, or else the first K logical CPUs.
        accumulation_steps: M, the backward passes a stage accumulates per
            optimizer step (an int >= 1).
        schedule: "adl", "ddg" or "bp" (in any case).
        reduction: "mean" or "sum" of the M accumulated gradients.

    Attributes:
        stages: the K stage models.
        devices: the full name of each stage's device.
        schedule: the `tf_agn.decoupled.schedule.Schedule`: each stage's
            forward lag and delay D_k.
        optimizers: each stage's optimizer, after `compile`.
        tick_trace: after `fit`, an int32 array `[tick, 2, K]`: the batch
            each stage forwarded (`[:, 0]`) and backpropagated (`[:, 1]`) in
            every tick of that `fit`, -1 for none, as the ids travelled
            through the buffers.
        history: the `keras.callbacks.History` of the last `fit`.

    Raises:
        ValueError: if `stages` is not a list or tuple (one model is split
            with `split_model` first), is empty or holds something else, a
            device is unknown or their number is not K, or
            `accumulation_steps`, `schedule` or `reduction` is not allowed.
    """

    def __init__(
        self,
        stages,
        devices=None,
        accumulation_steps=1,
        schedule="adl",
        reduction="mean",
    ):
        self.stages = stage_models(stages)
        num_stages = len(self.stages)
        check_accumulation(accumulation_steps, reduction)
        self.schedule = Schedule(schedule, num_stages)
        self.devices = resolve_devices(devices, num_stages)
        self.accumulation_steps = accumulation_steps
        self.reduction = reduction
        self.optimizers = None
        self.stop_training = False
        self.history = None
        self.tick_trace = None
        self._pipeline = None
        self._predict_function = None

    @property
    def num_stages(self):
        """K, the number of stages."""
        return len(self.stages)

    def compile(self, optimizer="rmsprop", loss=None, metrics=None):
        """Sets the optimizer every stage copies, the loss and the metrics.

        Args:
            optimizer: a Keras optimizer or its name; each stage gets a
                fresh copy from its config.
            loss: a Keras loss, its name or a function `(y_true, y_pred)`.
            metrics: a list of Keras metrics or their names, as for
                `keras.Model.compile`.
        """
        optimizer = keras.optimizers.get(optimizer)
        self.optimizers = [
            optimizer.__class__.from_config(optimizer.get_config()) for _ in self.stages
        ]
        loss = keras.losses.get(loss)
        self.loss = (
            loss if isinstance(loss, keras.losses.Loss) else _compat.LossFunctionWrapper(loss)
        )
        self._loss_tracker = keras.metrics.Mean(name="loss")
        self._compiled_metrics = _compat.CompileMetrics(metrics, None) if metrics else None
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

        Every epoch feeds its batches one per tick, then drains the pipeline
        (`Schedule.num_ticks`), so at the end of an epoch all its batches
        have been applied and validation, checkpoints and early stopping see
        a consistent model. Draining idles stages for up to 2 (K − 1) ticks
        per epoch. Accumulators are not flushed: fewer than M remaining
        backward passes wait for the next epoch.

        Args:
            x: the training inputs, a numpy array.
            y: the training labels.
            batch_size: examples per batch; a last partial batch is dropped,
                as the buffers hold a fixed batch size.
            epochs: passes over the data.
            verbose: 0 silent, 1 progress bar, 2 one line per epoch; "auto"
                is 1.
            callbacks: Keras callbacks; they see this model as their
                `model` (with `stop_training`, `get_weights`, ...).
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

        Returns:
            The loss if no metrics were compiled, else `[loss, *metrics]`,
            or a dict of them with `return_dict`.
        """
        self._check_compiled()
        logs = loops.evaluate(
            self, x, y, batch_size, verbose, (self._loss_tracker, self._compiled_metrics)
        )
        if return_dict:
            return logs
        return logs["loss"] if len(logs) == 1 else list(logs.values())

    def predict(self, x, batch_size=32, verbose=0):
        """The model's output on `x`, the stages run in sequence on their
        devices, in inference mode; `verbose` is accepted for Keras
        compatibility and ignored."""
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

    def staleness(self):
        """The staleness measured so far, per stage.

        A batch's staleness at stage k is the number of stage k's optimizer
        steps between its forward and its backward there, read from the
        step counters inside the tick function.

        Returns:
            A list with, per stage, `{"delay": D_k, "mean": float or None
            before any backward pass, "histogram": {staleness: batches}}`.
        """
        if self._pipeline is None:
            return [
                {"delay": d, "mean": None, "histogram": {}}
                for d in self.schedule.delays
            ]
        report = []
        for delay, histogram in zip(self.schedule.delays, self._pipeline.histograms):
            counts = histogram.numpy()
            total = counts.sum()
            report.append(
                {
                    "delay": delay,
                    "mean": (
                        float(counts @ np.arange(len(counts)) / total)
                        if total
                        else None
                    ),
                    "histogram": {s: int(c) for s, c in enumerate(counts) if c},
                }
            )
        return report

    def get_weights(self):
        """The weights of every stage, in order, as numpy arrays."""
        return [w for stage in self.stages for w in stage.get_weights()]

    def set_weights(self, weights):
        """Sets the weights of every stage from `get_weights`' list."""
        weights = list(weights)
        for stage in self.stages:
            count = len(stage.weights)
            stage.set_weights(weights[:count])
            weights = weights[count:]

    def _check_compiled(self):
        if self.optimizers is None:
            raise RuntimeError(
                "Call compile(optimizer, loss, metrics) before fit or evaluate."
            )

    def _pipeline_for(self, x_batch, y_batch):
        """The pipeline for this batch size, built on first use.

        Runs one batch through the stages eagerly (in inference mode) to
        build them and learn the shape of every activation.
        """
        batch_size = len(x_batch)
        if self._pipeline is not None and self._pipeline.batch_size == batch_size:
            return self._pipeline
        specs = [tf.TensorSpec(x_batch.shape[1:], tf.as_dtype(x_batch.dtype))]
        activation = x_batch
        for stage, device, optimizer in zip(self.stages, self.devices, self.optimizers):
            with tf.device(device):
                activation = stage(activation, training=False)
                optimizer.build(stage.trainable_variables)
            specs.append(tf.TensorSpec(activation.shape[1:], activation.dtype))
        if self._compiled_metrics is not None and not self._compiled_metrics.built:
            self._compiled_metrics.build(y_batch, activation)
        self._pipeline = Pipeline(
            self.stages,
            self.devices,
            self.optimizers,
            self.schedule,
            self.accumulation_steps,
            self.reduction,
            self.loss,
            (self._loss_tracker, self._compiled_metrics),
            batch_size,
            specs,
            tf.TensorSpec(y_batch.shape[1:], tf.as_dtype(y_batch.dtype)),
        )
        return self._pipeline
