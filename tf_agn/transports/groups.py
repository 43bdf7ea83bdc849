"""`CollectiveGroup`: this process's part of one TensorFlow collective group.

`tf_agn.transports.CollectiveTransport` launches its collectives through
the group, which draws their instance keys and orders them.
"""

import hashlib
import threading

import tensorflow as tf

from tf_agn import _compat
from tf_agn import devices as devices_lib

# How long a collective waits for its peers before it fails with
# `DeadlineExceededError`, unless a caller says otherwise: for ever, as in
# TensorFlow. TensorFlow implements a collective's timeout with a thread
# that sleeps for the whole timeout, one per collective call (measured: 2
# threads per all-reduce step of 2 replicas, alive for the timeout), so a
# job making 50 collectives a second under a 600 s timeout holds 30,000
# threads and reaches the kernel's limit. A lost peer needs no timeout:
# TensorFlow's health check aborts the survivors' collectives about 11 s
# after a worker dies. What a timeout adds is an error, rather than a hang,
# for a program that calls collectives in another order on one worker.
DEFAULT_TIMEOUT_SECONDS = None

# Group keys lie far above the small ones TensorFlow's own strategies
# count up from 1, and within int32.
_FIRST_GROUP_KEY = 1_000_000
_GROUP_KEY_RANGE = 2**31 - 1 - _FIRST_GROUP_KEY
# Instance keys count up from here on every replica of a group.
_FIRST_INSTANCE_KEY = 1

_groups = {}
_groups_lock = threading.Lock()


def group_key(devices, group_size):
    """The collective group key of a group.

    Args:
        devices: this process's devices in the group.
        group_size: the devices of the whole group, on every worker.

    Returns:
        An int32 key above the range TensorFlow's own strategies use.
    """
    # Derived from what every worker of the group shares (its size and the
    # local device names, job and task aside), never from how many objects
    # a process made before.
    local = ",".join(devices_lib.local_name(device) for device in devices)
    digest = hashlib.sha256(f"tf_agn/{group_size}/{local}".encode()).digest()
    return _FIRST_GROUP_KEY + int.from_bytes(digest[:8], "big") % _GROUP_KEY_RANGE


def collective_group(devices, group_size, first_replica):
    """This process's `CollectiveGroup` over `devices`.

    Args:
        devices: this process's replica devices, in replica order.
        group_size: the replicas of the whole group, on every worker.
        first_replica: the global replica id of `devices[0]`.

    Returns:
        The `CollectiveGroup`, made on first use.

    Raises:
        ValueError: if the devices are already in a group with another
            `first_replica`.
    """
    # Every ops object of the process that reduces over the same devices
    # (however their names are spelled) shares the group, and with it one
    # sequence of instance keys: building one more ops object (on one
    # worker only, say) changes no key.
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

    Every collective is launched once per local replica, with that
    replica's tensor, on that replica's device; the launches of all
    replicas of all workers meet in one collective op.

    Args:
        devices: this process's replica devices, in replica order.
        group_size: the replicas of the whole group: `len(devices)` times
            the number of workers.
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
        # Eager calls (`CollectiveTransport.eager`): their graph functions,
        # and a lock so that two threads' calls never interleave, which
        # could pair different collectives on two devices.
        self.eager_functions = {}
        self.eager_lock = threading.Lock()

    def launch(self, op, replica, tensor, options, **attributes):
        """Local replica `replica`'s part of the collective `op` on `tensor`.

        Args:
            op: a `tf.raw_ops` collective (`CollectiveReduceV2`,
                `CollectiveGatherV2`, `CollectiveAllToAllV2`,
                `CollectiveReduceScatterV2`).
            replica: the replica's index among `devices`.
            tensor: its input.
            options: `CommunicationOptions`, every field resolved.
            **attributes: the op's own attributes (`merge_op`, ...).

        Returns:
            The op's output, on the replica's device.
        """
        counter, token = self._state(replica)
        # Instance keys are drawn when the step runs, from a counter per
        # replica, not when a function is traced: all replicas run the same
        # collectives in the same order, so their counters agree however
        # often a worker retraces, inside `tf.while_loop`s
        # (`steps_per_execution`) and `tf.cond`s alike.
        with tf.device(counter.device):
            instance_key = counter.assign_add(1) - 1
        with tf.device(self.devices[replica]):
            return op(
                input=tensor,
                group_size=self.size,
                group_key=self.key,
                instance_key=instance_key,
                # One token per replica: automatic control dependencies then
                # launch its collectives in program order. NCCL deadlocks
                # when two GPUs start the same two collectives in different
                # orders.
                ordering_token=[token.handle],
                communication_hint=options.implementation.value.lower(),
                timeout_seconds=options.timeout_seconds or 0,
                **attributes,
            )

    def _state(self, replica):
        """Replica `replica`'s instance-key counter and ordering token,
        made on first use, outside any function or strategy."""
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
