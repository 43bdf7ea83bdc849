"""`wait_for_peers`: waiting, with a deadline and interruptibly, for every
worker of a multi-worker cluster to answer on its port, before TensorFlow
connects them."""

import contextlib
import socket
import time

from tf_agn.strategies import ports

# How long `multi_worker_mirrored` waits for every peer by default: workers
# of one job are usually started together, but a scheduler may start them
# minutes apart (pulling images, waiting for machines).
DEFAULT_CONNECT_TIMEOUT_SECONDS = 600


def peers_of(cluster_resolver):
    """The other workers of the cluster, as `(name, address)` pairs, and
    this worker's address.

    Returns:
        `(peers, own_address)`; own_address is None for a process that is
        not a task of the cluster (a single worker without `TF_CONFIG`).
    """
    jobs = cluster_resolver.cluster_spec().as_dict()
    own = (cluster_resolver.task_type, cluster_resolver.task_id)
    peers, own_address = [], None
    for job in ("chief", "worker"):
        for index, address in _indexed(jobs.get(job, [])):
            if (job, index) == (own[0], int(own[1] or 0)):
                own_address = address
            else:
                peers.append((f"{job} {index}", address))
    return peers, own_address


def wait_for_peers(cluster_resolver, timeout_seconds):
    """Returns once every peer of this worker answers on its cluster port.

    Meanwhile this worker listens on its own port, so that its peers see it.

    Args:
        cluster_resolver: the cluster and this worker's place in it.
        timeout_seconds: how long to wait in all.

    Raises:
        TimeoutError: naming each peer (task and address) that did not
            answer within `timeout_seconds`.
        KeyboardInterrupt: on Ctrl-C, at any time.
    """
    # `MultiWorkerMirroredStrategy` connects the workers in TensorFlow's C++
    # runtime: a peer that never comes keeps worker 0 there for ever, and
    # neither Ctrl-C nor SIGTERM reaches Python meanwhile (TensorFlow's
    # coordination service catches SIGTERM for its own preemption notices).
    # Here, in Python, waiting is bounded and interruptible. A peer that
    # fails between this meeting and TensorFlow's connection (the few
    # seconds the constructor takes) can still hold worker 0 up.
    peers, own_address = peers_of(cluster_resolver)
    if not peers:
        return
    # Our own port listens with a plain socket, so that peers waiting too
    # see us before our TensorFlow server (which takes the port over
    # afterwards) exists; a peer answers through its socket or its
    # TensorFlow server. The socket is closed before TensorFlow binds.
    with listening(own_address):
        missing = ports.unreachable([address for _, address in peers], timeout_seconds)
    if missing:
        names = ", ".join(f"{name} ({address})" for name, address in peers if address in missing)
        raise TimeoutError(
            f"No answer within {timeout_seconds} s from {names}. Start every "
            "worker of TF_CONFIG's cluster (the same program on each), check "
            "that the addresses are reachable from this machine, or give "
            "multi_worker_mirrored a longer connect_timeout_seconds."
        )


@contextlib.contextmanager
def listening(address):
    """Listens on `address`'s port while active, unless something (this
    process's TensorFlow server, from an earlier strategy) already does.

    Yields:
        The listening socket, or None if the port was taken (or `address`
        is None).
    """
    if address is None:
        yield None
        return
    _, port = ports.host_and_port(address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            # All interfaces, as TensorFlow's server will: peers on other
            # machines connect to it. Unless its user accepts, the kernel
            # completes peers' connections in its backlog.
            sock.bind(("", port))
            sock.listen(64)
        except OSError:
            yield None
            return
        yield sock
    finally:
        sock.close()
        # Peers' connections to the closed socket are reset; give the port
        # a moment before TensorFlow binds it.
        time.sleep(0.05)


def _indexed(tasks):
    """`(index, address)` pairs of a job's tasks, a list or a sparse dict."""
    if isinstance(tasks, dict):
        return sorted((int(index), address) for index, address in tasks.items())
    return list(enumerate(tasks))
