"""Putting values on devices, as tensors and as `Mirrored` values."""

import tensorflow as tf

from tf_agn import _compat


def on(device, value):
    """`value` (a tensor or `tf.IndexedSlices`) placed on `device`."""
    with tf.device(device):
        return tf.nest.map_structure(tf.identity, value, expand_composites=True)


def mirror(value, devices):
    """Places a copy of `value` on every device, as a `Mirrored` value.

    Between devices in host memory (logical CPUs) the identity shares the
    buffer, so nothing is copied; between GPUs it is the transfer.
    """
    copies = tuple(on(device, value) for device in devices)
    return _compat.regroup(copies, wrap_class=_compat.Mirrored)
