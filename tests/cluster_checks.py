"""Helpers that test_cluster.py and test_launch.py share."""

import os
import socket

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
