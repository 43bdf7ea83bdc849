"""What one replica holds for an optimizer and the weights it trains."""

import numpy as np
import tensorflow as tf


def memory_stats(weights, state, accumulators=(), compressor_state=()):
    """The bytes one replica holds: `{"weights", "gradients",
    "accumulators", "optimizer_state", "compressor_state"}`.

    `accumulators` and `compressor_state` may be among `state`; they are
    counted apart from it.
    """
    apart = {id(v) for v in (*accumulators, *compressor_state)}
    return {
        "weights": _bytes(weights),
        "gradients": _bytes(weights),
        "accumulators": _bytes(accumulators),
        "optimizer_state": _bytes([v for v in state if id(v) not in apart]),
        "compressor_state": _bytes(compressor_state),
    }


def _bytes(variables):
    # A variable's shape is one replica's: a sharded state's part.
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)
