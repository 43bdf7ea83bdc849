"""What one replica holds for an optimizer and the weights it trains."""

import numpy as np
import tensorflow as tf


def memory_stats(weights, state, accumulators=(), compressor_state=()):
    """The bytes one replica holds, by kind.

    Args:
        weights: the trainable variables (every replica holds them whole,
            and their gradients while a step runs).
        state: the optimizer's other variables: its update rule's state
            (one replica's part where it is sharded) and its counters.
        accumulators: the gradient accumulators, among `state` or not.
        compressor_state: the compressor's per-replica state, among
            `state` or not.

    Returns:
        `{"weights", "gradients", "accumulators", "optimizer_state",
        "compressor_state"}`, each a number of bytes.

    Example:

    >>> memory_stats([tf.Variable(tf.zeros([4]))], [tf.Variable(tf.zeros([2]))])["optimizer_state"]
    8
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
