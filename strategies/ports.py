"""Finding free ports and waiting for addresses to accept connections.

A TensorFlow task that cannot reach another one does not fail: it retries,
so `ParameterServerStrategy` hangs on a typo in a cluster spec or on a task
that never started. These helpers let tf_agn check first, with a deadline.
"""

import socket
import time

# How long one connection attempt may take, and the pause between rounds
# of attempts, while waiting for tasks that may still be starting.
_ATTEMPT_TIMEOUT_S = 1.0
_RETRY_PAUSE_S = 0.1


def free_ports(count):
    """Returns `count` distinct TCP ports that nothing on this host listens on.

    The operating system picks them (binding to port 0); all are bound at
    once, so they differ. Each then stays reserved for about a minute, for
    the caller's server to bind: a connection to it is closed from its side
    first, which leaves the port in TIME_WAIT. Binds to port 0 skip such
    ports (in any process, other `free_ports` calls included), while a
    server that sets SO_REUSEADDR, as TensorFlow's gRPC servers do, binds
    it at once. A process that binds the port by its number with
    SO_REUSEADDR may still take it first.

    Args:
        count: how many ports.

    Returns:
        A list of port numbers.
    """
    listeners = []
    try:
        for _ in range(count):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listeners.append(listener)
            # The TIME_WAIT socket inherits it; without it, the server's
            # bind would conflict with the reservation too.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), _ATTEMPT_TIMEOUT_S):
                accepted, _ = listener.accept()
                accepted.close()  # Closing first puts this end in TIME_WAIT.
        return [listener.getsockname()[1] for listener in listeners]
    finally:
        for listener in listeners:
            listener.close()


def host_and_port(address):
    """Splits `"host:port"` (optionally `"grpc://host:port"` or
    `"[::1]:port"`) into its host and integer port.

    Raises:
        ValueError: if `address` has no integer port.
    """
    _, _, host_port = str(address).rpartition("://")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"Address {address!r} is not of the form 'host:port', "
            "e.g. 'localhost:2222'."
        )
    return host.strip("[]"), int(port)


def accepts(address, timeout=_ATTEMPT_TIMEOUT_S):
    """Whether a TCP connection to `address` succeeds within `timeout` s."""
    try:
        with socket.create_connection(host_and_port(address), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable(addresses, timeout, poll=None):
    """Waits until every address accepts TCP connections, up to `timeout` s.

    Tasks that are still starting refuse connections, so each address is
    tried again until it accepts or the deadline passes.

    Args:
        addresses: `"host:port"` strings.
        timeout: seconds to wait in all.
        poll: an optional callable run between rounds of attempts; it may
            raise to stop waiting early (for example when a server process
            has already exited).

    Returns:
        The addresses that never accepted a connection, in the given order;
        empty if all did.

    Raises:
        ValueError: if an address is not `"host:port"`.
    """
    for address in addresses:
        host_and_port(address)  # A malformed address should fail at once.
    pending = list(addresses)
    deadline = time.monotonic() + timeout
    while True:
        pending = [
            address
            for address in pending
            if not accepts(address, _attempt_timeout(deadline))
        ]
        if not pending or time.monotonic() >= deadline:
            return pending
        if poll is not None:
            poll()
        time.sleep(_RETRY_PAUSE_S)


def _attempt_timeout(deadline):
    # At least a short attempt even past the deadline: every address gets
    # one real try, however small the timeout.
    return max(0.05, min(_ATTEMPT_TIMEOUT_S, deadline - time.monotonic()))
