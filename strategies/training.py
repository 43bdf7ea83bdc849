"""`fit`: asynchronous parameter-server training of a Keras 3 model.

Keras 3's `model.fit` does not run under `ParameterServerStrategy`, so this
module schedules windows on a `ClusterCoordinator` itself, inside the
callback, progress-bar and `History` skeleton it shares with ADL
(`tf_agn.training_loop.run_epochs`).
"""

import collections
import math

import keras
import numpy as np
import tensorflow as tf

from tf_agn import _compat
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.training_loop import run_epochs
from tf_agn.strategies.commit_server import APPLIED
from tf_agn.strategies.commit_server import CommitServer
from tf_agn.strategies.commit_server import REJECTED_NON_FINITE
from tf_agn.strategies.worker import Worker
from tf_agn.strategies.worker import window_function


class Staleness:
    """Per-commit staleness: server updates between a pull and its commit.

    Attributes:
        counts: `{staleness: number of applied commits}`.
    """

    def __init__(self):
        self.counts = collections.Counter()

    def record(self, staleness):
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
        values = self.values()
        return float(values.mean()) if values.size else 0.0


def fit(
    model,
    dataset_fn,
    epochs=1,
    steps_per_epoch=None,
    callbacks=None,
    validation_data=None,
    verbose="auto",
    checkpoint_dir=None,
    checkpoint_every=None,
    reject_non_finite=True,
):
    """Trains `model` asynchronously on a `ParameterServerStrategy` cluster.

    Keras 3's `model.fit` does not run under `ParameterServerStrategy`; this
    is its asynchronous counterpart. The model must be built and compiled
    under the strategy's scope with a `tf_agn.optimizers.WindowedOptimizer`
    (AGN, DOWNPOUR, DynSGD, AEASGD, EAMSGD). Each scheduled window runs on
    whichever worker is free: it pulls the center, takes λ = `local_steps`
    steps on the worker's own weights and optimizer state, and commits; the
    parameter servers apply commits as they arrive (see
    `tf_agn.strategies.commit_server.CommitServer`).

    Delivery is exactly once per window: a worker that dies has its window
    re-run elsewhere by the `ClusterCoordinator`, and the server drops a
    second commit for a window it already applied. A commit holding NaN or
    Inf is rejected, counted (`rejected_commits` in the logs) and never
    reaches the center.

    Keras callbacks run as under `model.fit`, with one "batch" per window:
    the History is returned, a progress bar shows with `verbose`, and
    `validation_data` is evaluated on the center at every epoch's end
    (`val_` logs, with the compiled metrics; training logs the workers'
    mean loss). The logs also carry `staleness` (the epoch's mean) and
    `commits`; `history.staleness` is a `Staleness` over the run, and a
    `keras.callbacks.TensorBoard` among the callbacks gets its histogram.

    With `checkpoint_dir`, the center, the server's counters and the
    record of applied windows are saved with `tf.train.CheckpointManager`
    every `checkpoint_every` windows (and at every epoch's end); a run
    restarted with the same `checkpoint_dir` (for example after a
    parameter-server failure) resumes from the latest checkpoint and
    re-runs only the windows it had not applied, so it loses at most one
    interval. Each save waits for the windows scheduled before it, so that
    the checkpoint is consistent.

    Args:
        model: a compiled Keras model, created under the strategy's scope.
        dataset_fn: `fn(input_context) -> tf.data.Dataset` of `(x, y)`
            batches, repeated, TensorFlow's convention: every worker builds
            its own, given a `tf.distribute.InputContext`. As under
            TensorFlow's `ParameterServerStrategy`, workers are not in
            step, so every worker is pipeline 0 of 1: shuffle unseeded, or
            the workers see the same order.
        epochs: the number of epochs.
        steps_per_epoch: local steps per epoch, over all workers; an epoch
            is `ceil(steps_per_epoch / local_steps)` windows.
        callbacks: Keras callbacks.
        validation_data: a `tf.data.Dataset` of `(x, y)` batches, or an
            `(x, y)` tuple, evaluated on the center.
        verbose: 0, 1, 2 or "auto" (1), as in `model.fit`.
        checkpoint_dir: where to checkpoint the center; None for no
            checkpoints.
        checkpoint_every: windows between checkpoints; None for epoch ends
            only.
        reject_non_finite: whether the server rejects commits holding NaN
            or Inf (the default).

    Returns:
        A `keras.callbacks.History`, with a `staleness` attribute.

    Raises:
        ValueError: if the strategy, the optimizer or an argument does not
            fit asynchronous training.
    """
    strategy = model.distribute_strategy
    optimizer = check_model(model, strategy)
    if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(
            "steps_per_epoch must be an int >= 1 (the dataset repeats); "
            f"received {steps_per_epoch!r}."
        )
    if checkpoint_every is not None and (
        not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
        raise ValueError(
            f"checkpoint_every must be None or an int >= 1; received "
            f"{checkpoint_every!r}."
        )
    local_steps = optimizer.local_steps
    windows_per_epoch = math.ceil(steps_per_epoch / local_steps)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        server = CommitServer(
            optimizer,
            model.trainable_variables,
            epochs * windows_per_epoch,
            reject_non_finite,
        )
        worker = Worker(model, optimizer, server, strategy)
    input_context = tf.distribute.InputContext(
        num_input_pipelines=1,
        input_pipeline_id=0,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )
    build_compiled_metrics(model, dataset_from(dataset_fn, input_context, model))
    manager = _checkpoint_manager(model, server, checkpoint_dir)
    applied = server.applied_windows.numpy().astype(bool)

    per_worker_dataset = coordinator.create_per_worker_dataset(
        lambda: dataset_from(dataset_fn, input_context, model)
    )
    iterator = iter(per_worker_dataset)
    run_window = window_function(worker, local_steps)

    staleness = Staleness()

    def schedule(window):
        return coordinator.schedule(run_window, args=(iterator, tf.constant(window, tf.int64)))

    def run_epoch(epoch, callback_list):
        first = epoch * windows_per_epoch
        pending = [w for w in range(first, first + windows_per_epoch) if not applied[w]]
        epoch_staleness = Staleness()
        losses = []
        chunk = checkpoint_every or len(pending)
        for start in range(0, len(pending), chunk):
            scheduled = [(w, schedule(w)) for w in pending[start : start + chunk]]
            for window, result in scheduled:
                callback_list.on_train_batch_begin(window - first)
                loss, window_staleness, outcome = _fetch(result, lambda: schedule(window))
                if outcome == APPLIED:
                    staleness.record(window_staleness)
                    epoch_staleness.record(window_staleness)
                if outcome != REJECTED_NON_FINITE:
                    losses.append(float(loss))
                callback_list.on_train_batch_end(
                    window - first, {"loss": _mean(losses)}
                )
            if manager is not None:
                manager.save()
        _write_staleness_histogram(callback_list, staleness, epoch)
        return {
            "loss": _mean(losses),
            "staleness": epoch_staleness.mean,
            "commits": int(server.commits.numpy()),
            "rejected_commits": int(server.rejected.numpy()),
        }

    def restored(epoch):
        # Every window of the epoch was applied before a checkpoint.
        first = epoch * windows_per_epoch
        return bool(applied[first : first + windows_per_epoch].all())

    history = run_epochs(
        model,
        epochs,
        windows_per_epoch,
        run_epoch,
        callbacks=callbacks,
        verbose=verbose,
        validate=None if validation_data is None else lambda: evaluate(model, validation_data),
        skip_epoch=restored,
    )
    history.staleness = staleness
    history.server = server
    return history


def _fetch(result, reschedule, attempts=3):
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


def evaluate(model, data):
    """Evaluates the center: the model's own (parameter-server) weights.

    Args:
        model: the compiled Keras model.
        data: a `tf.data.Dataset` of `(x, y)` batches, or an `(x, y)` tuple.

    Returns:
        `{"loss": float, <compiled metric>: float, ...}`.
    """
    if isinstance(data, tuple):
        data = tf.data.Dataset.from_tensor_slices(data).batch(256)
    model.reset_metrics()
    loss, metrics = _compat.compiled_loss(model), _compat.compiled_metrics(model)
    total, count = 0.0, 0
    for batch in data:
        x, y = batch[:2]
        y_pred = model(x, training=False)
        size = int(tf.shape(y_pred)[0])
        total += float(loss(y, y_pred)) * size
        count += size
        if metrics is not None:
            metrics.update_state(y, y_pred)
    results = {"loss": total / max(count, 1)}
    results.update(_metric_results(model))
    return results


def check_model(model, strategy):
    """Checks `model` can train asynchronously; returns its optimizer.

    Raises:
        ValueError: if the strategy is not a `ParameterServerStrategy`, the
            optimizer is not windowed, or the model is not built.
    """
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "tf_agn.strategies.fit trains asynchronously on a "
            "ParameterServerStrategy; the model was created under "
            f"{type(strategy).__name__}. Build and compile it under "
            "tf_agn.strategies.parameter_server(...).scope(), or use "
            "model.fit for synchronous training."
        )
    return check_optimizer(model)


def check_optimizer(model):
    """Returns `model`'s windowed optimizer.

    Raises:
        ValueError: if the optimizer is not windowed or the model is not
            built.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, WindowedOptimizer):
        raise ValueError(
            "Asynchronous training needs one of tf_agn's windowed optimizers "
            "(AGN, DOWNPOUR, DynSGD, AEASGD, EAMSGD); the model was compiled "
            f"with {optimizer!r}."
        )
    if not model.built:
        raise ValueError(
            "Build the model (e.g. with keras.Input) before training, under "
            "the strategy's scope, so that its weights are the center."
        )
    return optimizer


def dataset_from(dataset_fn, input_context, model):
    """Calls a user's `dataset_fn(input_context)` and checks its dataset.

    Args:
        dataset_fn: `fn(input_context) -> tf.data.Dataset` of `(x, y)`
            batches.
        input_context: the `tf.distribute.InputContext` to pass.
        model: the model the batches are for.

    Returns:
        The dataset `dataset_fn` returns.

    Raises:
        TypeError: if it returns anything but a `tf.data.Dataset`.
        ValueError: if its elements are not `(x, y)` tuples, or its x are
            single examples where `model` takes batches.
    """
    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "dataset_fn must return a tf.data.Dataset of (x, y) batches; "
            f"received {dataset!r}."
        )
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) < 2:
        raise ValueError(
            "dataset_fn's dataset must hold (x, y) or (x, y, sample_weight) "
            f"tuples; received elements {spec!r}."
        )
    _check_batched(spec[0], model)
    return dataset


def _check_batched(x_spec, model):
    """Raises if `x_spec` is one example of what `model` takes a batch of.

    Keras' own error for it ("Invalid input shape") does not say that the
    dataset lacks a `.batch`.
    """
    inputs = getattr(model, "inputs", None) or []
    x_specs = tf.nest.flatten(x_spec)
    if len(x_specs) != len(inputs):
        return
    for spec, model_input in zip(x_specs, inputs):
        example_shape = tf.TensorShape(model_input.shape[1:])
        if spec.shape.rank is not None and example_shape.is_compatible_with(spec.shape):
            raise ValueError(
                "dataset_fn's dataset must hold batches: the model takes x "
                f"of shape {tuple(model_input.shape)}; received elements of "
                f"shape {tuple(spec.shape)}, single examples. Call "
                ".batch(batch_size) on the dataset."
            )


def build_compiled_metrics(model, dataset):
    """Builds the compiled loss and metrics eagerly, from one batch of
    `dataset`.

    Workers use the loss inside traced functions, where variables cannot be
    created.
    """
    x, y = next(iter(dataset))[:2]
    with model.distribute_strategy.scope():
        y_pred = model(x, training=False)
        _compat.compiled_loss(model)(y, y_pred)
        metrics = _compat.compiled_metrics(model)
        if metrics is not None:
            metrics.update_state(y, y_pred)
    model.reset_metrics()


def _checkpoint_manager(model, server, checkpoint_dir):
    if checkpoint_dir is None:
        return None
    checkpoint = tf.train.Checkpoint(model=model, **server.checkpoint_items())
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
    return manager


def _metric_results(model):
    metrics = _compat.compiled_metrics(model)
    if metrics is None:
        return {}
    return {name: float(value) for name, value in metrics.result().items()}


def _mean(values):
    return float(np.mean(values)) if values else float("nan")


def _write_staleness_histogram(callback_list, staleness, epoch):
    for callback in callback_list.callbacks:
        if isinstance(callback, keras.callbacks.TensorBoard):
            writer = tf.summary.create_file_writer(callback.log_dir + "/train")
            with writer.as_default():
                tf.summary.histogram("staleness", staleness.values(), step=epoch)
            writer.flush()
