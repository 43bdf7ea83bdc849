"""Checks of `DecoupledModel`'s arguments, and what it keeps of them: the
stages as Keras models, the devices as full logical device names."""

import keras
import tensorflow as tf

from tf_agn.utils import devices as devices_lib

REDUCTIONS = ("mean", "sum")


def stage_models(stages):
    """The K stages as Keras models, in order.

    Raises:
        ValueError: if `stages` is not a list or tuple, is empty or holds
            something else than models, layers or lists of layers.
    """
    if not isinstance(stages, (list, tuple)):
        hint = (
            " Cut a model into stages with tf_agn.decoupled.split_model"
            "(model, K) first."
            if isinstance(stages, keras.Model)
            else ""
        )
        raise ValueError(
            f"stages must be a list of the K stages; received {stages!r}."
            + hint
        )
    models = [_as_model(stage, k) for k, stage in enumerate(stages)]
    if not models:
        raise ValueError("stages must hold at least one stage; received [].")
    return models


def check_accumulation(accumulation_steps, reduction):
    """Raises a ValueError if M or the reduction of the accumulated
    gradients is not allowed."""
    if (
        isinstance(accumulation_steps, bool)
        or not isinstance(accumulation_steps, int)
        or accumulation_steps < 1
    ):
        raise ValueError(
            "accumulation_steps must be an int >= 1; received "
            f"{accumulation_steps!r}."
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"Unknown reduction {reduction!r}. Allowed: "
            f"{', '.join(REDUCTIONS)}."
        )


def resolve_devices(devices, num_stages):
    """One full logical device name per stage."""
    available = tf.config.list_logical_devices()
    if devices is None:
        for device_type in ("GPU", "CPU"):
            names = [d.name for d in available if d.device_type == device_type]
            if len(names) >= num_stages:
                return names[:num_stages]
        raise ValueError(
            f"{num_stages} stages need {num_stages} devices, one each; found "
            f"{[d.name for d in available]}. Split the CPU first, before "
            f"TensorFlow starts: tf_agn.strategies.split_cpu({num_stages}); "
            "or pass devices."
        )
    devices = list(devices)
    if len(devices) != num_stages:
        raise ValueError(
            f"devices must name one device per stage, {num_stages}; received "
            f"{len(devices)}: {devices}."
        )
    return [devices_lib.resolve(device, "devices") for device in devices]


def _as_model(stage, index):
    """Stage `index` as a Keras model."""
    if isinstance(stage, keras.Model):
        return stage
    if isinstance(stage, keras.layers.Layer):
        return keras.Sequential([stage])
    if isinstance(stage, (list, tuple)) and all(
        isinstance(layer, keras.layers.Layer) for layer in stage
    ):
        return keras.Sequential(list(stage))
    raise ValueError(
        f"Stage {index} must be a Keras model, a layer or a list of layers; "
        f"received {stage!r}."
    )
