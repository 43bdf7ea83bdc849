"""Gradient compression: what values become on their way between replicas.

Pass `compression=` to any tf_agn optimizer, to
`tf_agn.optimizers.DistributedOptimizer`, or to a strategy builder:
None, "fp16", "bf16", "int8", "int4", `Int8(...)`, `Int4(...)` or
`PowerSGD(rank=r)`. Only what tf_agn's optimizers aggregate is compressed;
TensorFlow's own reductions (`strategy.reduce`, metrics, Keras's
optimizers) stay exact. Every
compressor implements `Compressor`; a user's own subclasses `Cast` (element
by element) or `ErrorFeedbackCompressor` (with per-replica state) and is
registered with `keras.saving.register_keras_serializable`.
"""

import keras

from tf_agn.compression.cast import BF16
from tf_agn.compression.cast import FP16
from tf_agn.compression.cast import Cast
from tf_agn.compression.compressor import Compressor
from tf_agn.compression.compressor import StateSpec
from tf_agn.compression.error_feedback import ErrorFeedbackCompressor
from tf_agn.compression.int8 import Int4
from tf_agn.compression.int8 import Int8
from tf_agn.compression.powersgd import PowerSGD

# Fresh objects: stateful compressors' compiled functions are cached per object.
BY_NAME = {"fp16": lambda: FP16, "bf16": lambda: BF16, "int8": Int8, "int4": Int4}


def get(identifier):
    """The compressor `identifier` names.

    Args:
        identifier: None (no compression), "fp16", "bf16", "int8", "int4", a
            `Compressor`, or the config dict `serialize` made of one.

    Returns:
        A compressor, or None for no compression.

    Raises:
        ValueError: for anything else, naming it and the allowed values.
    """
    if identifier is None or isinstance(identifier, Compressor):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in BY_NAME:
        return BY_NAME[identifier.lower()]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    allowed = ", ".join(repr(name) for name in BY_NAME)
    raise ValueError(
        f"Unknown compression {identifier!r}. Allowed: None, {allowed}, "
        "tf_agn.compression.PowerSGD(rank=...), or a "
        "tf_agn.compression.Compressor."
    )


def serialize(compressor):
    """What `get` turns back into `compressor`: None, a name, or a config dict."""
    if compressor is None or isinstance(compressor, Cast) and compressor.name in BY_NAME:
        return name_of(compressor)
    named = BY_NAME.get(name_of(compressor))
    if type(compressor) is named and compressor.get_config() == named().get_config():
        return compressor.name
    return keras.saving.serialize_keras_object(compressor)


def compresses(compressor, value):
    """Whether `compressor` (None: no compression) compresses `value`."""
    return compressor is not None and compressor.acts_on(value)


def name_of(compressor):
    """`compressor`'s name, or None for no compression."""
    return None if compressor is None else compressor.name
