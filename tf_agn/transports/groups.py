"""`CollectiveGroup`: this process's part of one TensorFlow collective group."""

import hashlib
import threading

import tensorflow as tf

from tf_agn import _compat
from tf_agn.utils import devices as devices_lib

# No timeout by default: TensorFlow keeps a sleeping thread per collective
# call for the whole timeout (50 calls/s under 600 s: 30,000 threads), and
# its health check already aborts collectives about 11 s after a peer dies.
DEFAULT_TIMEOUT_SECONDS = None

# Far above the keys TensorFlow's own strategies count up from 1; int32.
_FIRST_GROUP_KEY = 1_000_000
_GROUP_KEY_RANGE = 2**31 - 1 - _FIRST_GROUP_KEY
_FIRST_INSTANCE_KEY = 1

_groups = {}
_groups_lock = threading.Lock()


def group_key(devices, group_size):
    """The collective group key of `devices` (this process's) in a group of
    `group_size`."""
    # From what every worker shares, never from a count of objects made.
    local = ",".join(devices_lib.local_name(device) for device in devices)
    digest = hashlib.sha256(f"tf_agn/{group_size}/{local}".encode()).digest()
    return _FIRST_GROUP_KEY + int.from_bytes(digest[:8], "big") % _GROUP_KEY_RANGE


def collective_group(devices, group_size, first_replica):
    """This process's `CollectiveGroup` over `devices`, made on first use;
    a ValueError if it exists with another `first_replica`."""
    # Shared by every ops object over these devices, so that one more ops
    # object (on one worker only, say) changes no instance key.
    key = group_key(devices, group_size)
    with _groups_lock:
        group = _groups.get(key)
        if group is None:
            group = _groups[key] = CollectiveGroup(devices, group_size, first_replica)
        elif group.first_replica != first_replica:
            raise ValueError(
                f"Devices {tuple(devices)} are already in a collective group "
                f"whose first replica is {group.first_replica}; received "
                f"{first_replica}."
            )
        return group


class CollectiveGroup:
    """This process's devices in one collective group that may span workers.

    Args:
        devices: this process's replica devices, in replica order.
        group_size: the replicas of the whole group, on every worker.
        first_replica: the global replica id of `devices[0]`.
    """

    def __init__(self, devices, group_size, first_replica):
        self.devices = tuple(devices)
        self.size = group_size
        self.first_replica = first_replica
        self.key = group_key(self.devices, group_size)
        self._instance_counters = [None] * len(self.devices)
        self._ordering_tokens = [None] * len(self.devices)
        self._lock = threading.Lock()
        # Two threads' eager calls must not interleave: they could pair
        # different collectives on two devices.
        self.eager_functions = {}
        self.eager_lock = threading.Lock()

    def next_collective(self, replica, options):
        """The arguments every `tf.raw_ops` collective op takes, for replica
        `replica`'s next one, under `options` (`CommunicationOptions`).

        Example:

        ```python
        arguments = group.next_collective(0, options)
        with tf.device(group.devices[0]):
            gathered = tf.raw_ops.CollectiveGatherV2(input=tensor, **arguments)
        ```
        """
        counter, token = self._counter_and_token(replica)
        # Instance keys are drawn when the step runs, not when traced, so
        # replicas agree however often a worker retraces.
        with tf.device(counter.device):
            instance_key = counter.assign_add(1) - 1
        return {
            "group_size": self.size,
            "group_key": self.key,
            "instance_key": instance_key,
            # Program order per replica: NCCL deadlocks when two GPUs
            # start two collectives in different orders.
            "ordering_token": [token.handle],
            "communication_hint": options.implementation.value.lower(),
            "timeout_seconds": options.timeout_seconds or 0,
        }

    def _counter_and_token(self, replica):
        """Replica `replica`'s instance-key counter and ordering token."""
        with self._lock:
            if self._instance_counters[replica] is None:
                device = self.devices[replica]
                self._instance_counters[replica] = _compat.plain_variable(
                    _FIRST_INSTANCE_KEY, tf.int32, devices_lib.host_of(device)
                )
                self._ordering_tokens[replica] = _compat.plain_variable(
                    0.0, tf.float32, device
                )
        return self._instance_counters[replica], self._ordering_tokens[replica]


def default_implementation(devices):
    """NCCL where every device is a GPU, a ring otherwise."""
    implementation = tf.distribute.experimental.CommunicationImplementation
    if all(devices_lib.device_type(d) == "GPU" for d in devices):
        return implementation.NCCL
    return implementation.RING
