"""Gradient compression: what values become on their way between replicas.

Pass `compression=` to any tf_agn optimizer (or to
`tf_agn.optimizers.DistributedOptimizer`, or to the strategy builders, as
the default of every tf_agn optimizer under that strategy):

| compression            | on the wire, per float32           | state per replica     |
|------------------------|------------------------------------|-----------------------|
| None                   | 4 bytes                            | none                  |
| "fp16", "bf16"         | 2 bytes (a cast)                   | none                  |
| "int8", `Int8(...)`    | 1 byte, plus a scale per chunk     | a residual            |
| `PowerSGD(rank=r)`     | (rows + cols) r floats per matrix  | a residual (as M, P^, Q_w) and Q |

Compression touches only what tf_agn's optimizers send through
`AggregatingAllReduce.aggregate`: gradients, and the windowed optimizers'
commits (and their asynchronous commits to a parameter server, through
each compressor's `encode` and `decode`). TensorFlow's own entry points (`strategy.reduce`,
`batch_reduce_to`, Keras's loss and metric logs, on-read variables,
`replica_context.all_reduce`, and so Keras's own optimizers) stay exact:
a metric total past 65504 or a count past 2048 would not survive float16.
Nothing is compressed where nothing travels: with one replica, or with
aggregation NONE. With ONLY_FIRST_REPLICA only replica 0's value (and the
others' residuals, which are 0 unless an int8 sum's rounding left some
with them) travels.

Int8 and PowerSGD keep error feedback
(`tf_agn.compression.ErrorFeedbackCompressor`): each replica's residual,
what compression dropped, is sent with the next step, so nothing is lost.
Their state is optimizer state (see `tf_agn.optimizers.Aggregating`).
Sparse gradients (`tf.IndexedSlices`) always travel uncompressed: name
their variables in the optimizer's `sparse_gradients` and no state is
made for them (`tf_agn.optimizers.compression_state`).

A user's own compressor subclasses `Compressor` (stateless, element by
element) or `ErrorFeedbackCompressor` (stateful); register it with
`keras.saving.register_keras_serializable` so that a `.keras` file can
name it.
"""

import keras

from tf_agn.compression.cast import BF16
from tf_agn.compression.cast import FP16
from tf_agn.compression.cast import Cast
from tf_agn.compression.cast import Compressor
from tf_agn.compression.error_feedback import ErrorFeedbackCompressor
from tf_agn.compression.int8 import Int8
from tf_agn.compression.powersgd import PowerSGD

# The compressions `get` accepts by name, each a fresh object: stateful
# compressors' compiled functions are cached per object.
BY_NAME = {"fp16": lambda: FP16, "bf16": lambda: BF16, "int8": Int8}


def get(identifier):
    """The compressor `identifier` names.

    Args:
        identifier: None (no compression), "fp16", "bf16", "int8", a
            `Compressor` or `ErrorFeedbackCompressor`, or the config dict
            `serialize` made of one.

    Returns:
        A compressor, or None for no compression.

    Raises:
        ValueError: for anything else, naming it and the allowed values.
    """
    if identifier is None or isinstance(identifier, (Compressor, ErrorFeedbackCompressor)):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in BY_NAME:
        return BY_NAME[identifier.lower()]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    allowed = ", ".join(repr(name) for name in BY_NAME)
    raise ValueError(
        f"Unknown compression {identifier!r}. Allowed: None, {allowed}, "
        "tf_agn.compression.PowerSGD(rank=...), or a "
        "tf_agn.compression.Compressor or ErrorFeedbackCompressor."
    )


def serialize(compressor):
    """What `get` turns back into `compressor`: None, a built-in's name, or
    a Keras config dict."""
    if compressor is None or isinstance(compressor, Cast) and compressor.name in BY_NAME:
        return name_of(compressor)
    if isinstance(compressor, Int8) and compressor.get_config() == Int8().get_config():
        return compressor.name
    return keras.saving.serialize_keras_object(compressor)


def is_stateful(compressor):
    """Whether `compressor` keeps per-replica state."""
    return isinstance(compressor, ErrorFeedbackCompressor)


def acting_on(compressor, dtype):
    """`compressor` if it is a cast that compresses `dtype` values, else None."""
    if compressor is None or compressor.wire_dtype(dtype) == dtype:
        return None
    return compressor


def name_of(compressor):
    """`compressor`'s name, or None for no compression."""
    return None if compressor is None else compressor.name
