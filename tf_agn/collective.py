"""The collective transport: TensorFlow's collective ops, on tf_agn's packs.

`AggregatingAllReduce` moves a pack between replicas in one of two ways:

- "local": every replica's part of the pack goes to one reduce device,
  which sums it and sends the result back. On devices that share host
  memory (logical CPUs of one process) nothing is copied, so this is the
  fastest way there is. Between devices with memory of their own, the
  reduce device's link carries 2(n - 1) pack volumes per all-reduce.
- "collective": every replica calls TensorFlow's collective all-reduce
  (`CollectiveReduceV2`), the op `MultiWorkerMirroredStrategy` uses: NCCL
  on GPUs, a ring on CPUs and across workers. A ring sends and receives
  2(n - 1)/n pack volumes per device, the same on every link.

`traffic` gives those volumes, and `python -m tf_agn.collective` prints
them as a table. They are why "auto" picks "collective" wherever transfers
are real copies: GPUs, and several workers.
"""

import hashlib
import threading

import tensorflow as tf

from tf_agn import _compat

TRANSPORTS = ("auto", "local", "collective")

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
    """The collective group key of a group, derived from what every worker
    of the group shares: its size and the local device names (job and task
    aside), never from how many objects a process made before.

    Args:
        devices: this process's devices in the group.
        group_size: the devices of the whole group, on every worker.

    Returns:
        An int32 key above the range TensorFlow's own strategies use.
    """
    local = ",".join(_local_name(device) for device in devices)
    digest = hashlib.sha256(f"tf_agn/{group_size}/{local}".encode()).digest()
    return _FIRST_GROUP_KEY + int.from_bytes(digest[:8], "big") % _GROUP_KEY_RANGE


def collective_group(devices, group_size, first_replica):
    """This process's `CollectiveGroup` over `devices`.

    Every ops object of the process that reduces over the same devices
    (however their names are spelled) shares it, and with it one sequence
    of instance keys, so that building one more ops object (on one worker
    only, say) changes no key.
    """
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

    Every collective call is made once per local replica, with that
    replica's tensor, on that replica's device; the calls of all replicas of
    all workers meet in one collective op.

    Two things keep the calls of all replicas matched:

    - Instance keys are drawn when the step runs, from a counter per
      replica (a variable on its host), not when a function is traced. All
      replicas run the same collectives in the same order, so their
      counters agree, whenever and however often a worker retraces, inside
      `tf.while_loop`s (`steps_per_execution`) and `tf.cond`s alike.
    - Every collective of a replica takes that replica's ordering token, so
      automatic control dependencies launch them in program order: NCCL
      deadlocks when two GPUs start the same two collectives in different
      orders.

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

    def _state(self, replica):
        """Replica `replica`'s instance-key counter and ordering token,
        made on first use, outside any function or strategy."""
        with self._lock:
            if self._instance_counters[replica] is None:
                device = self.devices[replica]
                self._instance_counters[replica] = _compat.plain_variable(
                    _FIRST_INSTANCE_KEY, tf.int32, _host_of(device)
                )
                self._ordering_tokens[replica] = _compat.plain_variable(
                    0.0, tf.float32, device
                )
        return self._instance_counters[replica], self._ordering_tokens[replica]

    def _launch(self, replica):
        """The next instance key and the ordering token of `replica`."""
        counter, token = self._state(replica)
        with tf.device(counter.device):
            instance_key = counter.assign_add(1) - 1
        return instance_key, [token.handle]

    def all_reduce(self, replica, tensor, options):
        """Sums `tensor` over the group; call once per local replica."""
        return self._collective(
            tf.raw_ops.CollectiveReduceV2, replica, tensor, options,
            merge_op="Add", final_op="Id",
        )

    def all_gather(self, replica, tensor, options):
        """Every replica's `tensor`, concatenated along the first axis in
        global replica order; every replica passes the same shape."""
        return self._collective(tf.raw_ops.CollectiveGatherV2, replica, tensor, options)

    def all_to_all(self, replica, tensor, options):
        """Row j of `tensor` (whose first dimension is the group's size) to
        global replica j; returns every replica's row for this one, in
        global replica order. TensorFlow's CPU collectives carry float and
        int32/int64 values only."""
        return self._collective(tf.raw_ops.CollectiveAllToAllV2, replica, tensor, options)

    def _collective(self, op, replica, tensor, options, **attributes):
        """Replica `replica`'s part of the collective `op` on `tensor`, with
        the next instance key and this replica's ordering token."""
        instance_key, ordering_token = self._launch(replica)
        with tf.device(self.devices[replica]):
            return op(
                input=tensor,
                group_size=self.size,
                group_key=self.key,
                instance_key=instance_key,
                ordering_token=ordering_token,
                communication_hint=_hint(options),
                timeout_seconds=options.timeout_seconds or 0,
                **attributes,
            )

    def all_gather_rows(self, replica, tensors, options):
        """Every replica's rows of each of `tensors`, concatenated in
        global replica order.

        The tensors of one replica share their number of rows (the first
        dimension), which may differ between replicas: the counts travel
        first, then every replica's rows padded to the longest.

        Returns:
            One tensor per entry of `tensors`.
        """
        device = self.devices[replica]
        with tf.device(device):
            count = tf.shape(tensors[0], out_type=tf.int32)[:1]
        counts = self.all_gather(replica, count, options)
        gathered = []
        with tf.device(device):
            longest = tf.reduce_max(counts)
            keep = tf.reshape(tf.range(longest)[None, :] < counts[:, None], [-1])
        for tensor in tensors:
            with tf.device(device):
                padding = [[0, longest - count[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
                padded = tf.pad(tensor, padding)
            rows = self.all_gather(replica, padded, options)
            with tf.device(device):
                gathered.append(tf.boolean_mask(rows, keep))
        return gathered

    def all_gather_slices(self, replica, slices, options):
        """Every replica's rows and indices of `slices`, concatenated."""
        values, indices = self.all_gather_rows(
            replica, [slices.values, slices.indices], options
        )
        return tf.IndexedSlices(values, indices, slices.dense_shape)


def _hint(options):
    return options.implementation.value.lower()


def _local_name(device):
    """`device` without its job, replica and task: the same on every worker."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


def _host_of(device):
    """The CPU of `device`'s task, where collectives read instance keys."""
    return tf.DeviceSpec.from_string(device).replace(
        device_type="CPU", device_index=0
    ).to_string()


def default_implementation(devices):
    """NCCL where every device is a GPU, a ring otherwise."""
    implementation = tf.distribute.experimental.CommunicationImplementation
    if all(_device_type(d) == "GPU" for d in devices):
        return implementation.NCCL
    return implementation.RING


def choose_transport(devices, num_workers):
    """What "auto" means for these local devices and this many workers.

    "collective" across workers, and on GPUs where each logical GPU is a
    physical one (NCCL refuses two ranks on one GPU); "local" for devices
    of one process that share host memory.
    """
    if num_workers > 1:
        return "collective"
    if any(_device_type(d) == "GPU" for d in devices):
        logical = tf.config.list_logical_devices("GPU")
        physical = tf.config.list_physical_devices("GPU")
        if len(logical) == len(physical):
            return "collective"
    return "local"


def traffic(transport, num_replicas):
    """Pack volumes one all-reduce moves, sent plus received, per device.

    Args:
        transport: "local" (gather to one device, sum, send back) or
            "collective" (a ring: reduce-scatter, then all-gather).
        num_replicas: n, the replicas taking part.

    Returns:
        `(busiest, other)`: what the busiest device and every other device
        send plus receive, in units of one pack.
    """
    n = num_replicas
    if transport == "local":
        return 2 * (n - 1), 2
    if transport == "collective":
        per_device = 4 * (n - 1) / n  # 2(n-1)/n sent, as much received
        return per_device, per_device
    raise ValueError(f"Unknown transport {transport!r}. Allowed: local, collective.")


def _device_type(device):
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()


def _print_traffic_table():
    print("| n | local: reduce device | local: others | collective: every device |")
    print("|---|---|---|---|")
    for n in (2, 4, 8, 16, 32, 64):
        busiest, other = traffic("local", n)
        ring, _ = traffic("collective", n)
        print(f"| {n} | {busiest} | {other} | {ring:.2f} |")


if __name__ == "__main__":
    _print_traffic_table()
