"""Every private TensorFlow and Keras API tf_agn's transports rely on.

Private modules change without notice between releases. Reaching them from
one module means the next release breaks one place, and `tests/test_compat.py`
checks each name below, so that the break is a clear test failure rather
than a wrong number in training.

What we need, and why:

- `cross_device_utils.CollectiveKeys` and `CollectiveReplicaLauncher`: the
  group and instance keys, ordering tokens (which keep NCCL launches in one
  order on every device) and `all_reduce`/`all_reduce_indexed_slices`
  wrappers that `MultiWorkerMirroredStrategy` itself runs on. Writing our
  own would repeat TensorFlow's call-time instance keys, which keep workers
  in step even when one retraces a function later than another.
- `next_instance_key`: a collective broadcast needs the same kind of key as
  the launcher's all-reduce, and the launcher only hands it out privately.
- `cross_device_ops.check_destinations`, `get_devices_from` and
  `_make_tensor_into_per_replica`: how TensorFlow's own cross-device ops
  read the `destinations` and values they are given.
- `distribute_utils.regroup` and `values.Mirrored`: building the
  per-replica results a `CrossDeviceOps` must return.
- `CollectiveAllReduceExtended._cross_device_ops`: where a
  `MultiWorkerMirroredStrategy` keeps its all-reduce; there is no public
  argument to give it another (`replace_cross_device_ops`), nor to read it
  (`cross_device_ops`, for benchmarks that compare against it).
"""

from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops
from tensorflow.python.distribute import cross_device_utils as _tf_cross_device_utils
from tensorflow.python.distribute import distribute_utils as _tf_distribute_utils
from tensorflow.python.distribute import values as _tf_values

CollectiveKeys = _tf_cross_device_utils.CollectiveKeys
CollectiveReplicaLauncher = _tf_cross_device_utils.CollectiveReplicaLauncher
Mirrored = _tf_values.Mirrored
check_destinations = _tf_cross_device_ops.check_destinations
get_devices_from = _tf_cross_device_ops.get_devices_from
make_tensor_into_per_replica = _tf_cross_device_ops._make_tensor_into_per_replica
regroup = _tf_distribute_utils.regroup


def next_instance_key(launcher):
    """The next collective instance key of `launcher`'s group and device."""
    return launcher._next_instance_key()


def cross_device_ops(extended):
    """The `CrossDeviceOps` a strategy's `extended` reduces with.

    Raises:
        RuntimeError: if this TensorFlow keeps them elsewhere.
    """
    ops = getattr(extended, "_cross_device_ops", None)
    if not isinstance(ops, _tf_cross_device_ops.CrossDeviceOps):
        raise RuntimeError(
            f"This TensorFlow's {type(extended).__name__} keeps no "
            "CrossDeviceOps in `_cross_device_ops`; tf_agn cannot read or "
            "install its all-reduce. Use a tested TensorFlow version."
        )
    return ops


def replace_cross_device_ops(extended, ops):
    """Makes `extended` (a `MultiWorkerMirroredStrategy`'s) reduce over its
    compute devices with the `CrossDeviceOps` `ops` instead of the ones it has
    (TensorFlow's `CollectiveAllReduce`, unless replaced before).
    Host-tensor reductions keep TensorFlow's ops."""
    cross_device_ops(extended)  # raises if TensorFlow moved them
    extended._cross_device_ops = ops
