"""`all_finite`: the one inf/NaN test of every tf_agn path."""

import tensorflow as tf


def all_finite(values):
    """A boolean scalar: every element of `values` (tensors,
    `tf.IndexedSlices`, None skipped) is finite."""
    tensors = [v.values if isinstance(v, tf.IndexedSlices) else v for v in values if v is not None]
    if not tensors:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
