"""Every private TensorFlow name tf_agn reaches through `tf_agn._compat`
still exists and behaves as we rely on. A failure here means this
TensorFlow changed an internal: update `_compat`, nowhere else."""

import pytest
import tensorflow as tf

from conftest import DEVICES
from tf_agn import _compat


def test_collective_keys_give_distinct_groups_and_per_device_instances():
    keys = _compat.CollectiveKeys(group_key_start=5)
    first = keys.get_group_key(DEVICES[:2])
    assert keys.get_group_key(DEVICES[:2]) == first
    assert keys.get_group_key(DEVICES[2:]) == first + 1
    launcher = _compat.CollectiveReplicaLauncher(
        first, 2, keys, DEVICES[0], tf.distribute.experimental.CommunicationOptions()
    )
    # Eagerly outside a function the key is a plain int that advances.
    key = int(_compat.next_instance_key(launcher))
    assert int(_compat.next_instance_key(launcher)) == key + 1
    for name in ("all_reduce", "all_reduce_indexed_slices"):
        assert callable(getattr(launcher, name)), name


def test_per_replica_helpers():
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(1.0)
    )
    assert _compat.check_destinations(value)
    assert len(_compat.get_devices_from(value, True)) == len(DEVICES)
    single = _compat.make_tensor_into_per_replica(tf.constant(2.0))
    assert len(single.values) == 1
    mirrored = _compat.regroup(tuple(value.values), wrap_class=_compat.Mirrored)
    assert isinstance(mirrored, _compat.Mirrored)


def test_cross_device_ops_reads_and_replaces_a_strategys_ops():
    ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    assert _compat.cross_device_ops(strategy.extended) is ops
    other = tf.distribute.ReductionToOneDevice()
    _compat.replace_cross_device_ops(strategy.extended, other)
    assert _compat.cross_device_ops(strategy.extended) is other
    one_device = tf.distribute.OneDeviceStrategy(DEVICES[0])
    with pytest.raises(RuntimeError, match="keeps no CrossDeviceOps"):
        _compat.cross_device_ops(one_device.extended)
