"""Reading device names, and finding this process's devices by name."""

import tensorflow as tf


def device_type(device):
    """The upper-case type of `device` ("CPU" when the name has none)."""
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()


def local_name(device):
    """`device` without job, replica and task ("GPU:1")."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{device_type(device)}:{spec.device_index or 0}"


def host_of(device):
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def resolve(device, argument="device"):
    """The full name of this process's logical device that `device` names
    ("GPU" is the first GPU; "localhost" is this process); raises a
    ValueError naming `argument` otherwise."""
    spec = tf.DeviceSpec.from_string(device)
    available = tf.config.list_logical_devices()
    for candidate in available:
        other = tf.DeviceSpec.from_string(candidate.name)
        if (
            spec.job in (None, other.job, "localhost" if other.job is None else None)
            and spec.device_type is not None
            and spec.device_type.upper() == other.device_type
            and spec.device_index in (None, other.device_index)
        ):
            return candidate.name
    names = ", ".join(candidate.name for candidate in available)
    raise ValueError(
        f"{argument} must name devices this process has ({names}); "
        f"received {device!r}."
    )
