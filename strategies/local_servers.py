"""Starting and supervising the servers of a `LocalCluster`, in this
process or in subprocesses.

Server subprocesses never outlive this process: `LocalServers.stop()` also
runs at interpreter exit and on SIGTERM, and each server exits by itself
once its parent is gone (even after a SIGKILL).
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

import tensorflow as tf

from tf_agn.strategies.ports import unreachable
from tf_agn.strategies.server import SERVING
from tf_agn.strategies.server import start_server

# How much of a failed server's output an error message shows.
_LOG_TAIL_CHARS = 3000

# Servers with live subprocesses, for the interpreter-exit and SIGTERM
# clean-up.
_running = set()


class _ServerProcess(NamedTuple):
    job: str
    index: int
    address: str
    process: subprocess.Popen
    log: object  # the temporary file its output goes to


class LocalServers:
    """One `tf.distribute.Server` per task, each watched until it serves.

    Args:
        mode: "threads" (servers in this process, which cannot be stopped)
            or "processes" (one subprocess per server), as `LocalCluster`'s.
        jobs: the jobs whose tasks get a server, e.g. `("worker", "ps")`.
    """

    def __init__(self, mode, jobs):
        self._mode = mode
        self._jobs = jobs
        self._in_process = []  # "threads" mode: never freed
        self._processes = []  # "processes" mode: `_ServerProcess`es

    @property
    def pids(self):
        """Job name -> ids of its server processes, also once stopped."""
        return {
            job: [started.process.pid for started in self._processes if started.job == job]
            for job in self._jobs
        }

    def start(self, script, tasks, timeout):
        """Starts a server per task and waits until each accepts connections.

        Args:
            script: the server's script (tf_agn/strategies/server.py), for
                "processes" mode.
            tasks: `(job, index, address, tf_config)` of each task; its
                server gets `tf_config` as its `TF_CONFIG`.
            timeout: seconds to wait for every server.

        Raises:
            TimeoutError: if a server does not accept connections within
                `timeout`; it names the addresses.
            RuntimeError: if a server fails to start, with its output.
        """
        tasks = list(tasks)
        if self._mode == "threads":
            self._start_in_process(tasks)
        else:
            _running.add(self)
            _stop_on_sigterm()
            self._start_processes(script, tasks)
        self._wait_until_serving([address for _, _, address, _ in tasks], timeout)

    def kill(self, job, index):
        """Kills the process of task `index` of `job` (SIGKILL) and waits for it.

        Raises:
            IndexError: if there is no such task.
        """
        processes = [started.process for started in self._processes if started.job == job]
        if not 0 <= index < len(processes):
            raise IndexError(
                f"No {job} {index}: the cluster has {len(processes)} {job} task(s)."
            )
        _kill(processes[index])

    def stop(self):
        """Kills and reaps every server process. Safe to call repeatedly."""
        for started in self._processes:
            _kill(started.process)
        for started in self._processes:
            started.log.close()
        _running.discard(self)
        if not _running:
            _default_on_sigterm()

    def _start_in_process(self, tasks):
        # TensorFlow cannot stop an in-process server (`TF_ServerStop`
        # answers "Clean shutdown is not currently implemented"): these keep
        # their threads and ports until the interpreter exits.
        for job, index, address, tf_config in tasks:
            try:
                self._in_process.append(start_server(tf_config))
            except tf.errors.UnknownError as error:
                raise RuntimeError(
                    f"The {job} {index} server could not start at {address} "
                    f"({error.message}); another process probably took the "
                    "port. Try again."
                ) from error

    def _start_processes(self, script, tasks):
        for job, index, address, tf_config in tasks:
            # Open until stop(): the server writes to it while it runs.
            log = tempfile.TemporaryFile()  # noqa: SIM115
            try:
                process = subprocess.Popen(
                    [sys.executable, script, "--parent_pid", str(os.getpid())],
                    env=_server_env(tf_config),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Out of the terminal's process group, so that Ctrl-C
                    # reaches this process only; `stop()` ends the servers.
                    start_new_session=True,
                )
            except BaseException:
                log.close()
                raise
            self._processes.append(_ServerProcess(job, index, address, process, log))

    def _wait_until_serving(self, addresses, timeout):
        deadline = time.monotonic() + timeout
        missing = unreachable(addresses, timeout, poll=self._check_alive)
        if not missing and self._mode == "processes":
            # Another process's server may answer on a port that one of ours
            # then fails to bind (free_ports holds ports only against binds
            # to port 0, not against one by number); only our servers' word
            # counts.
            missing = self._not_serving(deadline)
        if missing:
            raise TimeoutError(
                f"{', '.join(missing)} did not accept connections within "
                f"{timeout} s ({self._mode} mode)."
            )

    def _not_serving(self, deadline):
        """Waits until every server process has said it serves, up to
        `deadline`; returns the addresses of those that have not."""
        while True:
            self._check_alive()
            silent = [
                started.address
                for started in self._processes
                if SERVING not in _read(started.log)
            ]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.1)

    def _check_alive(self):
        """Raises if a server process has exited while starting."""
        for job, index, address, process, log in self._processes:
            if process.poll() is not None:
                tail = _read(log)[-_LOG_TAIL_CHARS:]
                hint = ""
                if "Could not start gRPC server" in tail:
                    hint = " Another process probably took its port; try again."
                raise RuntimeError(
                    f"The {job} {index} server ({address}) exited with code "
                    f"{process.returncode} while starting.{hint} Its output "
                    f"ends with:\n{tail}"
                )


def _server_env(tf_config):
    """The environment of a server process for `tf_config`'s task."""
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
    for name in list(env):
        # gRPC would send even localhost traffic through a proxy.
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            del env[name]
    # Several servers may share one GPU; none should take all its memory.
    env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    return env


def _read(log):
    """Everything a server has written to its log file so far."""
    log.seek(0)
    return log.read().decode("utf-8", "replace")


def _kill(process):
    """Kills `process` (SIGKILL) unless it has exited, and reaps it."""
    if process.poll() is None:
        process.kill()
    process.wait()


def _stop_all():
    """Stops the servers of every `LocalServers` still running."""
    for local_servers in list(_running):
        local_servers.stop()


def _stop_on_sigterm():
    """On SIGTERM, stops every server process, then terminates as SIGTERM
    would; only if SIGTERM still has its default action."""
    # Signal handlers can only be set from the main thread.
    if threading.current_thread() is not threading.main_thread():
        return
    # The default action skips `atexit`; a handler the program installed
    # itself is left alone.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_then_terminate)


def _default_on_sigterm():
    """Puts SIGTERM's default action back once no server runs, so that the
    handler outlives no cluster (a later `fit` sees the program's own)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _stop_then_terminate
    ):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_then_terminate(signum, frame):
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_stop_all)
