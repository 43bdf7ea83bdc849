"""Reading device names, and finding this process's devices by name."""

import tensorflow as tf


def device_type(device):
    """The upper-case type of `device` ("CPU", "GPU", "TPU"); "CPU" when
    the name has none.

    Example:

    >>> device_type("/job:worker/replica:0/task:1/device:gpu:0")
    'GPU'
    """
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()


def local_name(device):
    """`device` without its job, replica and task ("GPU:1"): the same on
    every worker."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{device_type(device)}:{spec.device_index or 0}"


def host_of(device):
    """The first CPU of `device`'s task."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def resolve(device, argument="device"):
    """The full name of the logical device of this process that `device`
    names.

    A name without a job, or without an index, matches any ("GPU" is the
    first GPU), and "localhost" matches this process's devices, whose names
    have no job; types match in any case.

    Args:
        device: a device name, such as "/gpu:1", "GPU:1" or "GPU".
        argument: what named it, for the error message.

    Returns:
        A name from `tf.config.list_logical_devices()`, e.g.
        "/device:GPU:1".

    Raises:
        ValueError: naming `device` and the devices this process has.

    Example:

    >>> resolve("cpu:0")
    '/device:CPU:0'
    """
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
