"""`DecoupledModel`: model-parallel training with delayed, accumulated
gradients (ADL), and its DDG and BP baselines."""

from tf_agn.decoupled.arguments import check_accumulation
from tf_agn.decoupled.arguments import resolve_devices
from tf_agn.decoupled.arguments import stage_models
from tf_agn.decoupled.schedule import Schedule
from tf_agn.decoupled.trainer import Trainer


# Not a `keras.Model`: a tick is not a batch (each epoch fills and drains
# the pipeline), and the K stages keep K optimizers.
class DecoupledModel(Trainer):
    """Trains K stages of a network, stage k on device k, decoupled.

    Accumulated Decoupled Learning (Zhuang, Lin and Toh, 2020, arXiv
    2012.03747): in every tick, stage k forwards what stage k − 1 sent one
    tick earlier and backpropagates the batch it forwarded D_k = 2 (K − 1 −
    k) ticks earlier, recomputing its forward from the stored input. Each
    stage steps its own optimizer (a copy of the compiled one) after M
    accumulated backward passes, cutting staleness from D_k to about
    D_k / M. Schedules (`tf_agn.decoupled.schedule`):

    - `"adl"`: decoupled forward and backward, as above.
    - `"ddg"`: decoupled backward only (Huo et al., 2018).
    - `"bp"`: ordinary backpropagation: exact, the reference.

    Example:

    ```python
    tf_agn.strategies.split_cpu(2)  # before TensorFlow starts
    stages = tf_agn.decoupled.split_model(model, 2)
    decoupled = tf_agn.decoupled.DecoupledModel(stages, accumulation_steps=2)
    decoupled.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    decoupled.fit(x_train, y_train, batch_size=128, epochs=3)
    decoupled.staleness()  # per stage: mean and histogram
    ```

    Args:
        stages: K stages, each a Keras model, a layer or a list of layers,
            stage k's output feeding stage k + 1; e.g. from `split_model`.
        devices: one device name per stage; None takes the first K logical
            GPUs, or else the first K logical CPUs.
        accumulation_steps: M, the backward passes a stage accumulates per
            optimizer step (an int >= 1).
        schedule: "adl", "ddg" or "bp" (in any case).
        reduction: "mean" or "sum" (as ADL's official code) of the M
            accumulated gradients.

    Attributes:
        stages: the K stage models.
        devices: the full name of each stage's device.
        schedule: the `tf_agn.decoupled.schedule.Schedule`.
        optimizers: each stage's optimizer, after `compile`.
        tick_trace: after `fit`, an int32 array `[tick, 2, K]`: the batch
            each stage forwarded and backpropagated per tick, -1 for none.
        history: the `keras.callbacks.History` of the last `fit`.

    Raises:
        ValueError: for `stages` that is not a non-empty list or tuple of
            models or layers, unknown devices or not K of them, or an
            `accumulation_steps`, `schedule` or `reduction` not allowed.
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
        """Per stage, `{"delay": D_k, "mean": float or None, "histogram":
        {staleness: batches}}`: the optimizer steps measured between each
        batch's forward and backward there."""
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
