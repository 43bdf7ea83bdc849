"""`DecoupledModel`: model-parallel training with delayed, accumulated
gradients (ADL), and its DDG and BP baselines on the same machinery.

Its arguments are checked in `tf_agn.decoupled.arguments`; its `compile`,
`fit`, `evaluate` and `predict` come from `tf_agn.decoupled.trainer`.
"""

from tf_agn.decoupled.arguments import check_accumulation
from tf_agn.decoupled.arguments import resolve_devices
from tf_agn.decoupled.arguments import stage_models
from tf_agn.decoupled.schedule import Schedule
from tf_agn.decoupled.trainer import Trainer


# Not a `keras.Model` driven by Keras' `fit`, on purpose: a tick is not a
# batch (every epoch fills and then drains the pipeline with ticks that feed
# nothing, so that validation and checkpoints see every batch applied), and
# the K stages keep K optimizers, one per device, where a `keras.Model` has
# one.
class DecoupledModel(Trainer):
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

    def staleness(self):
        """The staleness measured so far, per stage.

        A batch's staleness at stage k is the number of stage k's optimizer
        steps between its forward and its backward there.

        Returns:
            A list with, per stage, `{"delay": D_k, "mean": float or None
            before any backward pass, "histogram": {staleness: batches}}`.
        """
        if self._pipeline is None:
            return [
                {"delay": d, "mean": None, "histogram": {}}
                for d in self.schedule.delays
            ]
        return self._pipeline.accumulation.staleness()

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
