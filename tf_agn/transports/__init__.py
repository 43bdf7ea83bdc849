"""Transports: the collective patterns by which replicas' values meet.

A transport serves some local replicas (all of this process's, or one) of
a group that may span workers. Each pattern takes one entry per local
replica and returns one per local replica, on its device:

| pattern                               | local replica r receives                     |
|---------------------------------------|----------------------------------------------|
| `all_reduce(packs, weights, cast)`    | Σ_j weights[j] · packs[j], tensor by tensor  |
| `reduce_scatter(tensors, sum_parts)`  | row rank(r) of Σ_j tensors[j]                |
| `all_gather(tensors)`                 | every tensor, concatenated in replica order  |
| `all_to_all(tensors)`                 | row rank(r) of every tensor, in replica order |
| `all_gather_rows(tensors)`            | as `all_gather`, for ragged rows             |
| `all_gather_slices(slices, weights)`  | every `tf.IndexedSlices`' rows and indices   |

and every transport has `devices` (the local replicas'), `size` (every
replica of every worker), `rank(r)` (local replica r's place among them),
`bytes_per_pack` and `jit_compile`. `tf_agn.combining.combine_replicas`
routes values to the patterns; compressors
(`tf_agn.compression`) are written against them. A new pattern is a
method of each transport:

- `LocalTransport`: one process; sums on one reduce device, in one
  XLA-compiled call per pack. On devices that share host memory (logical
  CPUs) nothing is copied. Between devices with memory of their own, the
  reduce device's link carries 2(n - 1) pack volumes per all-reduce.
- `CollectiveTransport`: TensorFlow's collective ops, NCCL on GPUs and a
  ring on CPUs and between workers. A ring sends and receives 2(n - 1)/n
  pack volumes per device, the same on every link.
- `ReplicaTransport`: what any strategy's replica context offers
  (`all_reduce` and `all_gather`), for strategies without tf_agn's
  cross-device ops.

`traffic` gives those volumes, and `python -m tf_agn.transports` prints
them as a table: they are why "auto" picks "collective" wherever
transfers are real copies (GPUs, and several workers).
"""

import tensorflow as tf

from tf_agn import devices as devices_lib
from tf_agn.transports.collective import CollectiveTransport
from tf_agn.transports.groups import DEFAULT_TIMEOUT_SECONDS
from tf_agn.transports.groups import CollectiveGroup
from tf_agn.transports.groups import collective_group
from tf_agn.transports.groups import default_implementation
from tf_agn.transports.local import LocalTransport
from tf_agn.transports.replica import ReplicaTransport

TRANSPORTS = ("auto", "local", "collective")


def choose_transport(devices, num_workers):
    """What "auto" means for these local devices and this many workers:
    "collective" across workers, and on GPUs where each logical GPU is a
    physical one (NCCL refuses two ranks on one GPU); "local" for devices
    of one process that share host memory."""
    if num_workers > 1:
        return "collective"
    if any(devices_lib.device_type(d) == "GPU" for d in devices):
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

    Raises:
        ValueError: for another transport.
    """
    n = num_replicas
    if transport == "local":
        return 2 * (n - 1), 2
    if transport == "collective":
        per_device = 4 * (n - 1) / n  # 2(n-1)/n sent, as much received
        return per_device, per_device
    raise ValueError(f"Unknown transport {transport!r}. Allowed: local, collective.")


def _print_traffic_table():
    print("| n | local: reduce device | local: others | collective: every device |")
    print("|---|---|---|---|")
    for n in (2, 4, 8, 16, 32, 64):
        busiest, other = traffic("local", n)
        ring, _ = traffic("collective", n)
        print(f"| {n} | {busiest} | {other} | {ring:.2f} |")


__all__ = [
    "CollectiveGroup",
    "CollectiveTransport",
    "DEFAULT_TIMEOUT_SECONDS",
    "LocalTransport",
    "ReplicaTransport",
    "TRANSPORTS",
    "choose_transport",
    "collective_group",
    "default_implementation",
    "traffic",
]
