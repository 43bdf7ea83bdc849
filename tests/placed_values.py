"""Per-replica test values, each on its replica's device."""

import tensorflow as tf


def per_replica(strategy, devices, arrays):
    """A `PerReplica` value holding `arrays[r]` on `devices[r]`.

    MirroredStrategy calls the value function without a device scope, and
    an eager constant lives on CPU:0 in any scope: the identity moves it.
    """

    def value_fn(context):
        replica = context.replica_id_in_sync_group
        with tf.device(devices[replica]):
            return tf.identity(tf.constant(arrays[replica]))

    return strategy.experimental_distribute_values_from_function(value_fn)
