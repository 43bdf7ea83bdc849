"""`LocalCluster`: a parameter-server cluster on this machine."""

import tensorflow as tf

from tf_agn.strategies import server
from tf_agn.strategies.local_servers import LocalServers
from tf_agn.strategies.ports import free_ports

_MODES = ("threads", "processes")
_SERVER_JOBS = ("worker", "ps")
# Run as a plain script, not with `-m tf_agn...`: importing only TensorFlow
# saves each server process the seconds that importing Keras takes.
_SERVER_SCRIPT = server.__file__


class LocalCluster:
    """Worker and ps servers on localhost, for this process to coordinate.

    One `tf.distribute.Server` per worker and ps task, on free ports of
    localhost; this process is the coordinator ("chief"). Server processes
    never outlive this process: `stop()` runs on leaving the `with` block
    (exceptions and Ctrl-C included), at interpreter exit and on SIGTERM.

    Example:

    ```python
    with tf_agn.strategies.LocalCluster(num_workers=2, mode="processes") as cluster:
        strategy = tf_agn.strategies.parameter_server(cluster)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        ...
    ```

    Args:
        num_workers: how many worker tasks (at least 1).
        num_ps: how many parameter-server tasks (at least 1).
        mode: "threads": every server runs inside this process, which
            starts fast, but the servers cannot be stopped: their threads
            and ports stay until the interpreter exits. "processes": one
            subprocess per server; `stop()` kills them and frees every
            port, and `kill_worker` and `kill_ps` kill one, to test
            failures.
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
        self._servers = LocalServers(mode, _SERVER_JOBS)
        self._state = "new"

    @property
    def mode(self):
        """"threads" or "processes", as given."""
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
        return self._servers.pids

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
            self._servers.start(_SERVER_SCRIPT, self._tasks(), self._start_timeout)
        except BaseException:  # Ctrl-C included: leave nothing behind.
            self.stop()
            raise
        return self

    def stop(self):
        """Kills and reaps every server process. Safe to call repeatedly.

        In "threads" mode the servers keep running, and their ports stay
        taken, until the interpreter exits.
        """
        # TensorFlow cannot stop in-process servers (see LocalServers).
        self._state = "stopped"
        self._servers.stop()

    def kill_worker(self, index):
        """Kills worker `index`'s server process (SIGKILL) and waits for it.

        Raises:
            RuntimeError: in "threads" mode, or if the cluster is not running.
            IndexError: if there is no such worker.
        """
        self._kill("worker", index)

    def kill_ps(self, index):
        """Kills ps `index`'s server process (SIGKILL) and waits for it.

        Raises:
            RuntimeError: in "threads" mode, or if the cluster is not running.
            IndexError: if there is no such ps.
        """
        self._kill("ps", index)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def _tasks(self):
        """`(job, index, address, TF_CONFIG)` of every worker and ps task."""
        for job in _SERVER_JOBS:
            for index, address in enumerate(self._addresses[job]):
                yield job, index, address, self.tf_config(job, index)

    def _kill(self, job, index):
        """Kills the server of task `index` of `job`, or raises."""
        if self._mode != "processes":
            raise RuntimeError(
                f"Killing a {job} needs mode='processes': TensorFlow cannot stop "
                "the in-process servers of mode='threads'."
            )
        if self._state != "running":
            raise RuntimeError(f"The cluster is {self._state}, not running.")
        self._servers.kill(job, index)
