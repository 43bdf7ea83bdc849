"""Runs this checkout's scripts in fresh processes, as a user would.

A fresh process imports this checkout's tf_agn, installed or not, and sets
up TensorFlow (devices, clusters) itself, whatever this process did.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra):
    """The environment for a Python subprocess that imports this checkout."""
    return dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        **extra,
    )


def run_python(*args, timeout=300, returncode=0, **env):
    """Runs `python *args`; returns the `subprocess.CompletedProcess`.

    Args:
        *args: the interpreter's arguments: a script and its flags, or
            "-m" and a module.
        timeout: seconds before the process is killed.
        returncode: the exit code to assert, with the output on failure;
            None to assert nothing.
        **env: extra environment variables.
    """
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env=checkout_env(**env),
        timeout=timeout,
    )
    if returncode is not None:
        assert result.returncode == returncode, result.stdout + result.stderr
    return result
