"""Putting values on devices, and finding the devices values stand for."""

import tensorflow as tf

from tf_agn import _compat


def on(device, value):
    """`value` (a tensor or `tf.IndexedSlices`) placed on `device`."""
    with tf.device(device):
        return tf.nest.map_structure(tf.identity, value, expand_composites=True)


def mirror(value, devices):
    """A `Mirrored` copy of `value` on every device (on logical CPUs the
    identity shares the buffer)."""
    copies = tuple(on(device, value) for device in devices)
    return _compat.regroup(copies, wrap_class=_compat.Mirrored)


def replica_devices(value, ops, destinations=None):
    """The devices of a distributed `value`'s replicas.

    Values without a device of their own (made outside the replicas'
    scopes) take those of `destinations`, or else of the strategy in scope;
    raises ValueError where neither names as many.
    """
    devices = _compat.devices_of(value, ops)
    if all(devices) and len(set(devices)) == len(devices):
        return devices
    candidates = []
    if destinations is not None and _compat.check_destinations(destinations):
        candidates.append(_compat.devices_of(destinations, ops))
    if tf.distribute.has_strategy():
        candidates.append(tf.distribute.get_strategy().extended.worker_devices)
    for known in candidates:
        if len(known) == len(devices) and all(known) and len(set(known)) == len(known):
            return tuple(known)
    if all(devices):
        return devices  # Where they are, though it says nothing of replicas.
    raise ValueError(
        f"{len(devices)} values without a device, and neither the "
        "destinations nor a strategy in scope name as many devices: "
        "cannot tell where they are."
    )


def destination_devices(destinations, ops, value=None):
    """Where a `CrossDeviceOps` caller's results go: the devices
    `destinations` name, or else those of `value`'s replicas."""
    if destinations is not None and _compat.check_destinations(destinations):
        devices = _compat.devices_of(destinations, ops)
        if all(devices):
            return devices
    return replica_devices(value, ops, destinations)


def calling_replica_devices(tensors, ops, replica_id):
    """The replica devices of a replica-context all-reduce: the strategy's,
    or outside one, the single device of `tensors` (replica 0 only)."""
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy().extended.worker_devices
    devices = {device for t in tensors for device in _compat.devices_of(t, ops)}
    if replica_id != 0 or len(devices) != 1:
        raise ValueError(
            "Outside a strategy, _all_reduce serves one local replica, "
            "replica_id 0, with its values on one device; received "
            f"replica_id {replica_id!r} and values on {sorted(devices)}. "
            "Call it in a strategy's replica context for several."
        )
    return (devices.pop(),)
