"""Checks, shared by `fit` and `simulate`, of the model and its optimizer,
the user's datasets and `fit`'s arguments. Each raises before any window
runs, saying what to change.
"""

import tensorflow as tf

from tf_agn.optimizers.streaming_diloco import StreamingDiLoCo
from tf_agn.optimizers.windowed import WindowedOptimizer


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
        ValueError: if the optimizer is not windowed, is
            `StreamingDiLoCo`, or the model is not built.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, WindowedOptimizer):
        raise ValueError(
            "Asynchronous training needs one of tf_agn's windowed optimizers "
            "(AGN, DOWNPOUR, DynSGD, AEASGD, EAMSGD); the model was compiled "
            f"with {optimizer!r}."
        )
    if isinstance(optimizer, StreamingDiLoCo):
        raise ValueError(
            "StreamingDiLoCo's fragments and delayed exchanges are synchronous: "
            "train it with model.fit under MirroredStrategy. Asynchronously, "
            "DiLoCo is AGN(normalize=False) with an outer Nesterov optimizer."
        )
    if not model.built:
        raise ValueError(
            "Build the model (e.g. with keras.Input) before training, under "
            "the strategy's scope, so that its weights are the center."
        )
    return optimizer


def check_fit_arguments(steps_per_epoch, checkpoint_every):
    """Checks `fit`'s `steps_per_epoch` and `checkpoint_every`.

    Raises:
        ValueError: if either is not an int >= 1 (`checkpoint_every` may be
            None).
    """
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
    """Raises if `x_spec` is one example of what `model` takes a batch of."""
    # Keras' own error for it ("Invalid input shape"), raised later, does
    # not say that the dataset lacks a `.batch`.
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
