"""Helpers for tests of parameter-server clusters."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def checkout_env(**extra):
    """The environment for a Python subprocess that imports this checkout's
    tf_agn, installed or not."""
    return dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        **extra,
    )


def run_in_fresh_process(script, *args, timeout=180):
    """Runs a Python script in a new process; returns its last output line
    parsed as JSON.

    Tests that connect a `ParameterServerStrategy` must run this way: the
    connection lasts as long as the process, and later `MirroredStrategy`
    tests in the same process would hang.

    Raises:
        AssertionError: with the script's output, if it fails.
    """
    result = subprocess.run(
        [sys.executable, script, *map(str, args)],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])
