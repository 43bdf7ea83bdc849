"""`LocalCluster`: a parameter-server cluster on this machine.

It starts one `tf.distribute.Server` per worker and ps task, on free ports
of localhost, and leaves the coordinator ("chief") role to this process:

```python
with tf_agn.strategies.LocalCluster(num_workers=2, mode="processes") as cluster:
    strategy = tf_agn.strategies.parameter_server(cluster)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    ...
```

Two modes:

- "threads": every server runs inside this process, as TensorFlow's own
  tests do. It starts fast, but TensorFlow cannot stop an in-process server
  (`TF_ServerStop` answers "Clean shutdown is not currently implemented"),
  so its threads and ports stay until the interpreter exits; `stop()` only
  marks the cluster stopped.
- "processes": every server runs in a subprocess
  (tf_agn/strategies/server.py). `stop()` kills them and frees every port,
  and single workers or ps can be killed to test failures.

The subprocesses never outlive this process: `stop()` runs on leaving the
`with` block (exceptions and Ctrl-C included), at interpreter exit and on
SIGTERM, and each server exits by itself once its parent is gone (even
after a SIGKILL).
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

import tensorflow as tf

from tf_agn.strategies import server
from tf_agn.strategies.ports import free_ports
from tf_agn.strategies.ports import unreachable

_MODES = ("threads", "processes")
_SERVER_JOBS = ("worker", "ps")
# Run as a plain script, not with `-m tf_agn...`: importing only TensorFlow
# saves each server process the seconds that importing Keras takes.
_SERVER_SCRIPT = server.__file__
# How much of a failed server's output an error message shows.
_LOG_TAIL_CHARS = 3000

# Clusters with live subprocesses, for the interpreter-exit and SIGTERM
# clean-up.
_running = set()


class LocalCluster:
    """Worker and ps servers on localhost, for this process to coordinate.

    Args:
        num_workers: how many worker tasks (at least 1).
        num_ps: how many parameter-server tasks (at least 1).
        mode: "threads" (servers in this process; cannot be stopped) or
            "processes" (one subprocess per server; stopped by `stop()`).
        start_timeout: seconds `start()` waits for every server to accept
            connections.

    Raises:
        ValueError: for a bad argument.
    """

    def __init__(self, num_workers, num_ps=1, mode="threads", start_timeout=60.0):
        for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; received {value!r}.")
        if mode not in _MODES:
            raise ValueError(
                f"mode must be one of {', '.join(map(repr, _MODES))}; "
                f"received {mode!r}."
            )
        if not start_timeout > 0:
            raise ValueError(
                f"start_timeout must be a number of seconds > 0; received "
                f"{start_timeout!r}."
            )
        self._mode = mode
        self._start_timeout = start_timeout
        ports = iter(free_ports(num_workers + num_ps + 1))
        counts = {"worker": num_workers, "ps": num_ps, "chief": 1}
        self._addresses = {
            job: [f"localhost:{next(ports)}" for _ in range(count)]
            for job, count in counts.items()
        }
        self._servers = []  # "threads" mode: in-process servers, never freed
        self._processes = {job: [] for job in _SERVER_JOBS}
        self._logs = []
        self._state = "new"

    @property
    def mode(self):
        return self._mode

    @property
    def addresses(self):
        """Job name ("worker", "ps", "chief") -> list of "localhost:port"."""
        return {job: list(tasks) for job, tasks in self._addresses.items()}

    @property
    def cluster_spec(self):
        """The `tf.train.ClusterSpec` of the workers, ps and chief."""
        return tf.train.ClusterSpec(self.addresses)

    @property
    def cluster_resolver(self):
        """A resolver that makes this process the cluster's chief."""
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.cluster_spec, rpc_layer="grpc", task_type="chief", task_id=0
        )

    @property
    def pids(self):
        """Job name -> ids of its server processes ("processes" mode; empty
        lists in "threads" mode). They stay listed after `stop()`."""
        return {job: [p.pid for p in procs] for job, procs in self._processes.items()}

    def tf_config(self, task_type="chief", task_id=0):
        """The `TF_CONFIG` dict of one task of this cluster.

        Raises:
            ValueError: if the cluster has no such task.
        """
        tasks = self._addresses.get(task_type, [])
        if not 0 <= task_id < len(tasks):
            raise ValueError(
                f"No task {task_type!r} {task_id}: the cluster has "
                + ", ".join(f"{len(t)} {j!r}" for j, t in self._addresses.items())
                + " task(s)."
            )
        return {
            "cluster": self.addresses,
            "task": {"type": task_type, "index": task_id},
            "rpc_layer": "grpc",
        }

    def start(self):
        """Starts every worker and ps server and waits until each accepts
        connections. Does nothing if the cluster is already running.

        Returns:
            This cluster.

        Raises:
            TimeoutError: if a server does not accept connections within
                `start_timeout`; it names the addresses.
            RuntimeError: if a server fails to start (e.g. another process
                took its port), with the server's output; or if the cluster
                was stopped (start a new one instead).
        """
        if self._state == "running":
            return self
        if self._state == "stopped":
            raise RuntimeError("This LocalCluster was stopped; create a new one.")
        self._state = "running"
        # The chief's port opens too, when a strategy connects to the cluster.
        print(
            server.exposure_notice([a for tasks in self._addresses.values() for a in tasks]),
            flush=True,
        )
        try:
            if self._mode == "threads":
                self._start_in_process()
            else:
                _running.add(self)
                _stop_on_sigterm()
                self._start_processes()
            self._wait_until_reachable()
        except BaseException:  # Ctrl-C included: leave nothing behind.
            self.stop()
            raise
        return self

    def stop(self):
        """Kills and reaps every server process. Safe to call repeatedly.

        In "threads" mode the servers keep running (TensorFlow cannot stop
        them) and their ports stay taken until the interpreter exits.
        """
        self._state = "stopped"
        for procs in self._processes.values():
            for process in procs:
                _kill(process)
        for log in self._logs:
            log.close()
        self._logs = []
        _running.discard(self)

    def kill_worker(self, index):
        """Kills worker `index`'s server process (SIGKILL) and waits for it.

        Raises:
            RuntimeError: in "threads" mode, or if the cluster is not running.
            IndexError: if there is no such worker.
        """
        _kill(self._process("worker", index))

    def kill_ps(self, index):
        """Kills ps `index`'s server process (SIGKILL) and waits for it.

        Raises:
            RuntimeError: in "threads" mode, or if the cluster is not running.
            IndexError: if there is no such ps.
        """
        _kill(self._process("ps", index))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def _tasks(self):
        for job in _SERVER_JOBS:
            for index, address in enumerate(self._addresses[job]):
                yield job, index, address

    def _start_in_process(self):
        for job, index, address in self._tasks():
            try:
                self._servers.append(server.start_server(self.tf_config(job, index)))
            except tf.errors.UnknownError as error:
                raise RuntimeError(
                    f"The {job} {index} server could not start at {address} "
                    f"({error.message}); another process probably took the "
                    "port. Try again."
                ) from error

    def _start_processes(self):
        for job, index, _ in self._tasks():
            # Open until stop(): the server writes to it while it runs.
            log = tempfile.TemporaryFile()  # noqa: SIM115
            self._logs.append(log)
            self._processes[job].append(
                subprocess.Popen(
                    [sys.executable, _SERVER_SCRIPT, "--parent_pid", str(os.getpid())],
                    env=self._server_env(job, index),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Out of the terminal's process group, so that Ctrl-C
                    # reaches this process only; `stop()` ends the servers.
                    start_new_session=True,
                )
            )

    def _server_env(self, job, index):
        env = dict(os.environ, TF_CONFIG=json.dumps(self.tf_config(job, index)))
        for name in list(env):
            # gRPC would send even localhost traffic through a proxy.
            if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
                del env[name]
        # Several servers may share one GPU; none should take all its memory.
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        return env

    def _wait_until_reachable(self):
        addresses = [address for _, _, address in self._tasks()]
        deadline = time.monotonic() + self._start_timeout
        missing = unreachable(addresses, self._start_timeout, poll=self._check_alive)
        if not missing and self._mode == "processes":
            # Another process's server may answer on a port that one of ours
            # then fails to bind (free_ports holds ports only against binds
            # to port 0, not against one by number); only our servers' word
            # counts.
            missing = self._not_serving(deadline)
        if missing:
            raise TimeoutError(
                f"{', '.join(missing)} did not accept connections within "
                f"{self._start_timeout} s ({self._mode} mode)."
            )

    def _not_serving(self, deadline):
        """Waits until every server process has said it serves, up to
        `deadline`; returns the addresses of those that have not."""
        while True:
            self._check_alive()
            silent = [
                address
                for (_, _, address), log in zip(self._tasks(), self._logs)
                if server.SERVING not in _read(log)
            ]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.1)

    def _check_alive(self):
        """Raises if a server process has exited while starting."""
        for (job, index, address), log in zip(self._tasks(), self._logs):
            process = self._processes[job][index]
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

    def _process(self, job, index):
        if self._mode != "processes":
            raise RuntimeError(
                f"Killing a {job} needs mode='processes': TensorFlow cannot stop "
                "the in-process servers of mode='threads'."
            )
        if self._state != "running":
            raise RuntimeError(f"The cluster is {self._state}, not running.")
        processes = self._processes[job]
        if not 0 <= index < len(processes):
            raise IndexError(
                f"No {job} {index}: the cluster has {len(processes)} {job} task(s)."
            )
        return processes[index]


def _read(log):
    """Everything a server has written to its log file so far."""
    log.seek(0)
    return log.read().decode("utf-8", "replace")


def _kill(process):
    if process.poll() is None:
        process.kill()
    process.wait()


def _stop_all():
    for cluster in list(_running):
        cluster.stop()


def _stop_on_sigterm():
    """On SIGTERM, stops every cluster, then terminates as SIGTERM would.

    Only if SIGTERM still has its default action, which skips `atexit`;
    a handler the program installed itself is left alone. Signal handlers
    can only be set from the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def stop_then_terminate(signum, frame):
        _stop_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stop_then_terminate)


atexit.register(_stop_all)
