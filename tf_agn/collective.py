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

import itertools
import threading

import tensorflow as tf

from tf_agn import _compat

TRANSPORTS = ("auto", "local", "collective")

# Each AggregatingAllReduce draws its collective group keys from a block of
# its own, so that two of them in one process never share a group (TF's
# default ops all start at group key 1, instance key 100, and collide).
# Workers of a cluster build their ops in the same order, so the keys agree
# across processes. The first block lies far above the keys TensorFlow's
# own strategies use.
_FIRST_GROUP_KEY = 1_000_000
_GROUP_KEYS_PER_OPS = 1_000
_key_blocks = itertools.count()
_key_blocks_lock = threading.Lock()


def new_collective_keys():
    """A `CollectiveKeys` whose group keys no other one in this process uses."""
    with _key_blocks_lock:
        block = next(_key_blocks)
    return _compat.CollectiveKeys(
        group_key_start=_FIRST_GROUP_KEY + block * _GROUP_KEYS_PER_OPS
    )


class CollectiveGroup:
    """This process's devices in one collective group that may span workers.

    Every collective call is made once per local replica, with that
    replica's tensor, on that replica's device; the calls of all replicas of
    all workers meet in one collective op.

    Args:
        devices: this process's replica devices, in replica order.
        group_size: the replicas of the whole group: `len(devices)` times
            the number of workers.
        first_replica: the global replica id of `devices[0]`.
        keys: the `CollectiveKeys` to draw the group and instance keys from.
    """

    def __init__(self, devices, group_size, first_replica, keys):
        self.devices = tuple(devices)
        self.size = group_size
        self.first_replica = first_replica
        self._group_key = keys.get_group_key(self.devices)
        self._launchers = [
            _compat.CollectiveReplicaLauncher(
                self._group_key,
                group_size,
                keys,
                device,
                tf.distribute.experimental.CommunicationOptions(),
            )
            for device in self.devices
        ]

    def all_reduce(self, replica, tensor, options):
        """Sums `tensor` over the group; call once per local replica."""
        return self._launchers[replica].all_reduce(tensor, options=options)

    def broadcast(self, replica, tensor, options):
        """Global replica 0's `tensor`, on every replica.

        Every replica passes a tensor of the shape and dtype to receive;
        only replica 0's values are read.
        """
        launcher = self._launchers[replica]
        instance_key = _compat.next_instance_key(launcher)
        hint = options.implementation.value
        timeout = options.timeout_seconds or 0
        if tensor.dtype == tf.bfloat16:
            # The broadcast ops take no bfloat16; they copy bits, so the
            # same 16 bits travel as float16 and come back unchanged.
            with tf.device(self.devices[replica]):
                as_half = tf.bitcast(tensor, tf.float16)
            received = self.broadcast(replica, as_half, options)
            with tf.device(self.devices[replica]):
                return tf.bitcast(received, tf.bfloat16)
        with tf.device(self.devices[replica]):
            if self.first_replica + replica == 0:
                return tf.raw_ops.CollectiveBcastSendV2(
                    input=tensor,
                    group_size=self.size,
                    group_key=self._group_key,
                    instance_key=instance_key,
                    communication_hint=hint.lower(),
                    timeout_seconds=timeout,
                )
            return tf.raw_ops.CollectiveBcastRecvV2(
                group_size=self.size,
                group_key=self._group_key,
                instance_key=instance_key,
                shape=tf.shape(tensor),
                T=tensor.dtype,
                communication_hint=hint.lower(),
                timeout_seconds=timeout,
            )

    def all_gather_slices(self, replica, slices, options):
        """Every replica's rows and indices of `slices`, concatenated."""
        return self._launchers[replica].all_reduce_indexed_slices(
            slices, options=options
        )


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
