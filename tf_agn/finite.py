"""`all_finite`: whether a step's values hold no inf or NaN, the one test
of loss scaling, gradient accumulation, error feedback and a parameter
server's commits."""

import tensorflow as tf


def all_finite(values):
    """Whether every element of `values` is finite.

    Args:
        values: tensors, `tf.IndexedSlices` (their values are tested) or
            None (skipped).

    Returns:
        A scalar boolean tensor; True when there is nothing to test.

    Example:

    >>> bool(all_finite([tf.ones(2), None, tf.constant([1.0, float("inf")])]))
    False
    """
    tensors = [v.values if isinstance(v, tf.IndexedSlices) else v for v in values if v is not None]
    if not tensors:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
