"""Free TCP ports, and waiting with a deadline for addresses to accept
connections (`free_ports`, `unreachable`)."""

import socket
import time

# How long one connection attempt may take, and the pause between rounds
# of attempts, while waiting for tasks that may still be starting.
_ATTEMPT_TIMEOUT_S = 1.0
_RETRY_PAUSE_S = 0.1


def free_ports(count):
    """Returns `count` distinct TCP ports that nothing on this host listens on.

    Each stays reserved for about a minute against binds to port 0 (other
    `free_ports` calls included), for the caller's server to bind with
    SO_REUSEADDR, as TensorFlow's gRPC servers do. A process that binds it
    by number with SO_REUSEADDR may still take it first.

    Args:
        count: how many ports.

    Returns:
        A list of port numbers.
    """
    # The operating system picks each (a bind to port 0); all are bound at
    # once, so they differ. Closing a connection to the port from its side
    # first leaves it in TIME_WAIT, which binds to port 0 (in any process)
    # skip, while a bind with SO_REUSEADDR takes it at once.
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
    # A TensorFlow task that cannot reach another one retries for ever
    # (`ParameterServerStrategy` hangs on a typo in a cluster spec), so
    # tf_agn checks first, with a deadline. Tasks still starting refuse
    # connections: each address is tried again until it accepts or the
    # deadline passes.
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
