"""Transports: the collective patterns by which replicas' values meet.

A transport serves some local replicas (all of this process's, or one) of
a group that may span workers. Each pattern takes one entry per local
replica and returns one per local replica, on its device:

| pattern                               | local replica r receives                     |
|---------------------------------------|----------------------------------------------|
| `all_reduce(tensors, weights, cast)`  | Σ_j weights[j] · tensors[j], tensor by tensor |
| `reduce_scatter(tensors, weights, sum_parts)` | row rank(r) of Σ_j weights[j] · tensors[j] |
| `all_gather(tensors)`                 | every tensor, concatenated in replica order  |
| `all_to_all(tensors)`                 | row rank(r) of every tensor, in replica order |
| `all_gather_rows(tensors)`            | as `all_gather`, for ragged rows             |
| `all_gather_slices(slices, weights)`  | every `tf.IndexedSlices`' rows and indices   |

and every transport has `devices` (the local replicas'), `size` (every
replica of every worker), `rank(r)`, `bytes_per_pack` and `jit_compile`:

- `LocalTransport`: one process; sums on one reduce device.
- `CollectiveTransport`: TensorFlow's collective ops (NCCL, or a ring).
- `ReplicaTransport`: what any strategy's replica context offers.

`python -m tf_agn.transports` prints each one's `traffic`.
"""

import tensorflow as tf

from tf_agn.transports.collective import CollectiveTransport
from tf_agn.transports.groups import DEFAULT_TIMEOUT_SECONDS
from tf_agn.transports.groups import CollectiveGroup
from tf_agn.transports.groups import collective_group
from tf_agn.transports.groups import default_implementation
from tf_agn.transports.local import LocalTransport
from tf_agn.transports.replica import ReplicaTransport
from tf_agn.utils import devices as devices_lib

TRANSPORTS = ("auto", "local", "collective")


def choose_transport(devices, num_workers):
    """What "auto" means for these local devices and this many workers."""
    # NCCL refuses two ranks on one GPU: "collective" needs physical GPUs.
    if num_workers > 1:
        return "collective"
    if any(devices_lib.device_type(d) == "GPU" for d in devices):
        logical = tf.config.list_logical_devices("GPU")
        physical = tf.config.list_physical_devices("GPU")
        if len(logical) == len(physical):
            return "collective"
    return "local"


def traffic(transport, num_replicas):
    """`(busiest, other)`: the pack volumes one all-reduce among
    `num_replicas` sends plus receives on the busiest device and on the
    others, for "local" or "collective" `transport`."""
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
