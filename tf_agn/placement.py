"""Putting values on devices, and finding the devices values stand for."""

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


def replica_devices(value, ops, destinations=None):
    """The devices of a distributed `value`'s replicas.

    A value made outside the replicas' device scopes (a function input, an
    eager dataset element) has no device: it stands for its replica, on
    the device of the same index among the `destinations`, or else among
    the devices of the strategy in scope.

    Args:
        value: a distributed value, or a tensor for one replica.
        ops: the `tf.distribute.CrossDeviceOps` that reduce it, whose
            device canonicalization applies.
        destinations: where a `CrossDeviceOps` caller wants results, or
            None.

    Returns:
        A tuple of device names, one per replica.

    Raises:
        ValueError: if values without a device stand for replicas that
            neither the destinations nor a strategy name.
    """
    devices = _compat.devices_of(value, ops)
    # Replicas on one device (values made eagerly outside the replicas'
    # scopes, all on the default device) do not say where they belong.
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
    """This process's replica devices, for a replica-context all-reduce of
    replica `replica_id`'s `tensors`: the strategy's in scope; outside any
    strategy, the one device of `tensors` (TensorFlow's default replica
    context has one replica).

    Raises:
        ValueError: outside a strategy, for a `replica_id` other than 0
            or tensors on several devices.
    """
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy().extended.worker_devices
    # A tensor without a device resolves to the device scope it is reduced
    # in, as TensorFlow's own ops read destinations.
    devices = {device for t in tensors for device in _compat.devices_of(t, ops)}
    if replica_id != 0 or len(devices) != 1:
        raise ValueError(
            "Outside a strategy, _all_reduce serves one local replica, "
            "replica_id 0, with its values on one device; received "
            f"replica_id {replica_id!r} and values on {sorted(devices)}. "
            "Call it in a strategy's replica context for several."
        )
    return (devices.pop(),)
