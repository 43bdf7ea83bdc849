"""Runs this checkout's scripts in fresh processes, as a user would.

A fresh process imports this checkout's tf_agn, installed or not, and sets
up TensorFlow (devices, clusters) itself, whatever this process did.
"""

import os
import signal
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


def cluster_env(**extra):
    """`checkout_env` for a worker of a localhost cluster: one CPU replica,
    and no HTTP proxy (gRPC would send localhost traffic to it)."""
    env = checkout_env(CUDA_VISIBLE_DEVICES="", **extra)
    for name in list(env):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            del env[name]
    return env


def launch(launcher_args, command, env, timeout=240, after_start=None):
    """Runs `python -m tf_agn.strategies.launch LAUNCHER_ARGS -- COMMAND` in
    its own process group, killed with every worker whatever happens;
    `after_start(process)`, if given, runs once it started.

    Returns:
        (exit code, output).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_agn.strategies.launch", *launcher_args, "--", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        if after_start is not None:
            after_start(process)
        output, _ = process.communicate(timeout=timeout)
    finally:
        try:  # any worker the launcher left behind, or all of them
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if process.poll() is None:
            process.communicate()
    return process.returncode, output
