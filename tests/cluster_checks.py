"""Helpers for tests of parameter-server clusters."""

import json
import os
import signal
import socket
import time

from scripts import checkout_env  # noqa: F401 - for the cluster tests
from scripts import run_python


def default_sigint():
    """For `subprocess.Popen(preexec_fn=...)`: the child takes SIGINT as a
    terminal's Ctrl-C, whatever this process inherited (a shell ignores it
    in the jobs it starts in the background, and the child would too)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def port_is_free(port):
    """Whether a server could listen on `port` now.

    SO_REUSEADDR lets the bind ignore closed connections still in
    TIME_WAIT, but not a socket that still listens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
            sock.listen()
        except OSError:
            return False
    return True


def listening(port):
    """The local addresses with a socket listening on TCP `port`, from
    /proc/net/tcp and tcp6 ("0.0.0.0" or "::" for all interfaces)."""
    found = []
    for table, wildcard in (("/proc/net/tcp", "0.0.0.0"), ("/proc/net/tcp6", "::")):
        try:
            with open(table) as rows:
                next(rows)  # the header
                for row in rows:
                    local, state = row.split()[1], row.split()[3]
                    address, _, hex_port = local.partition(":")
                    if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                        found.append(wildcard if set(address) == {"0"} else address)
        except FileNotFoundError:
            continue
    return found


def run_in_fresh_process(script, *args, timeout=180):
    """Runs a Python script in a new process; returns its last output line
    parsed as JSON.

    Tests that connect a `ParameterServerStrategy` must run this way: the
    connection lasts as long as the process, and later `MirroredStrategy`
    tests in the same process would hang.

    Raises:
        AssertionError: with the script's output, if it fails.
    """
    result = run_python(script, *args, timeout=timeout)
    return json.loads(result.stdout.splitlines()[-1])


def alive(pid):
    """Whether process `pid` exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running_servers(server_script):
    """Ids of live processes running `server_script` (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if server_script.encode() in argv and alive(int(entry)):
            pids.append(int(entry))
    return pids


def own_servers(server_script):
    """`running_servers` started under this pytest-xdist worker (all of
    them without xdist): another worker's servers run at the same time and
    are its to check.

    A server is this worker's if its environment holds the worker's
    PYTEST_XDIST_WORKER, which it inherits from the worker through every
    process in between (if their environments derive from the parent's),
    even once its parent has died. conftest.py's check at the end of the
    session sees every server.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return running_servers(server_script)
    mark = f"PYTEST_XDIST_WORKER={worker}".encode()
    return [
        pid
        for pid in running_servers(server_script)
        if mark in _proc_entries(pid, "environ")
    ]


def command_line(pid):
    """Process `pid`'s command line, for messages."""
    return " ".join(
        arg.decode(errors="replace") for arg in _proc_entries(pid, "cmdline") if arg
    )


def _proc_entries(pid, name):
    """The NUL-separated entries of /proc/PID/NAME; none if it has exited."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def wait_for_no_servers(server_script, seconds=5):
    """The servers still running after `seconds`; servers that watch their
    parent exit about 0.5 s after it."""
    deadline = time.monotonic() + seconds
    while running_servers(server_script) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running_servers(server_script)
