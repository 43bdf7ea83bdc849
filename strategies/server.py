"""One worker or parameter-server task: `python -m tf_agn.strategies.server`.

Reads the task and its cluster from the `TF_CONFIG` environment variable,
starts a `tf.distribute.Server` for it and serves until the process is
killed. Run one on every worker and ps machine of a cluster; the
coordinator (task type "chief") runs the training script instead, which
builds its strategy with `tf_agn.strategies.parameter_server()`.

Start them before the coordinator. Every address must be reachable from
every machine, the coordinator's too (the workers connect back to it).
`TF_CONFIG` for the first worker of a cluster with one coordinator, two
workers and one parameter server:

```json
{"cluster": {"chief": ["host0:2222"],
             "worker": ["host1:2222", "host2:2222"],
             "ps": ["host3:2222"]},
 "task": {"type": "worker", "index": 0}}
```
"""

# Nothing from tf_agn: `LocalCluster` runs this module as a plain script,
# whose servers then skip importing Keras.
import argparse
import json
import os
import threading
import time

import tensorflow as tf

# How often a server started with --parent_pid checks that its parent lives.
_PARENT_POLL_S = 0.5
# What a server prints once it has bound its port; LocalCluster waits for it.
SERVING = "serving at"


def example_tf_config(task_type):
    """A valid `TF_CONFIG` for a task of `task_type`, for error messages."""
    return {
        "cluster": {
            "chief": ["host0:2222"],
            "worker": ["host1:2222", "host2:2222"],
            "ps": ["host3:2222"],
        },
        "task": {"type": task_type, "index": 0},
    }


def read_tf_config(task_types, environ=os.environ):
    """Reads and checks the `TF_CONFIG` of a task of one of `task_types`.

    Args:
        task_types: the task types this process may be, e.g. `("chief",)`
            for a coordinator.
        environ: the environment to read `TF_CONFIG` from.

    Returns:
        The `TF_CONFIG` dict. Its cluster has at least one "worker" and one
        "ps" task, and its task is one of the cluster's tasks.

    Raises:
        ValueError: naming what is wrong, with an example of a valid one.
    """
    text = environ.get("TF_CONFIG", "")
    try:
        tf_config = json.loads(text) if text.strip() else None
        problem = _tf_config_problem(tf_config, task_types)
    except json.JSONDecodeError as error:
        problem = f"TF_CONFIG is not valid JSON ({error})"
    if problem:
        example = json.dumps(example_tf_config(task_types[0]))
        raise ValueError(f"{problem}. A valid TF_CONFIG looks like: {example}")
    return tf_config


def _tf_config_problem(tf_config, task_types):
    """What is wrong with a parsed `TF_CONFIG`, or None."""
    if tf_config is None:
        return "TF_CONFIG is not set"
    cluster = tf_config.get("cluster") if isinstance(tf_config, dict) else None
    if not isinstance(cluster, dict):
        return 'TF_CONFIG has no "cluster" dict of job name -> addresses'
    for job in ("worker", "ps"):
        tasks = cluster.get(job)
        if not isinstance(tasks, list) or not tasks:
            return f'TF_CONFIG\'s cluster has no "{job}" job (a list of "host:port")'
    task = tf_config.get("task")
    if not isinstance(task, dict) or task.get("type") not in task_types:
        return (
            f"TF_CONFIG's task is {task!r}; this process needs a task of type "
            f"{' or '.join(map(repr, task_types))}"
        )
    index = task.get("index", 0)
    tasks = cluster.get(task["type"])
    if not isinstance(tasks, list) or not isinstance(index, int):
        return f'TF_CONFIG\'s cluster has no "{task["type"]}" job for its task'
    if not 0 <= index < len(tasks):
        return (
            f"TF_CONFIG's task index {index} is out of range: the cluster "
            f'has {len(tasks)} "{task["type"]}" task(s)'
        )
    return None


def server_config(task_type, num_workers):
    """The `ConfigProto` for a task's `tf.distribute.Server`.

    Args:
        task_type: "worker" or "ps".
        num_workers: how many workers the cluster has.

    Returns:
        A `tf.compat.v1.ConfigProto`.
    """
    config = tf.compat.v1.ConfigProto()
    if task_type == "worker":
        # With fewer inter-op threads than workers + 1, functions that
        # ClusterCoordinator schedules can wait forever on each other's
        # variable reads (b/172296720; TF's own in-process test clusters
        # set this). The default is one thread per core: 2 on a small VM.
        config.inter_op_parallelism_threads = max(os.cpu_count() or 1, num_workers + 1)
    return config


def exposure_notice(addresses):
    """The line printed when servers start: which ports TensorFlow's gRPC
    servers open to every network interface, and what that allows.

    Args:
        addresses: the servers' "host:port" or "grpc://host:port".
    """
    # `tf.distribute.Server` binds the wildcard address whatever host its
    # cluster spec names, and runs any op for anyone who connects.
    ports = ", ".join(address.rpartition(":")[2] for address in addresses)
    return (
        "tf_agn: TensorFlow gRPC servers listen on all network interfaces, "
        f"without authentication, on port(s) {ports}: keep them behind a "
        "firewall (README, Security)."
    )


def start_server(tf_config):
    """Starts the `tf.distribute.Server` of `tf_config`'s task.

    Args:
        tf_config: a `TF_CONFIG` dict, as `read_tf_config` returns it.

    Returns:
        The started `tf.distribute.Server`.

    Raises:
        tf.errors.UnknownError: if the server cannot bind its port.
    """
    task = tf_config["task"]
    cluster = tf_config["cluster"]
    return tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=task["type"],
        task_index=task.get("index", 0),
        protocol=tf_config.get("rpc_layer", "grpc"),
        config=server_config(task["type"], len(cluster["worker"])),
        start=True,
    )


def _exit_with_parent(parent_pid):
    """Ends this process once `parent_pid` is no longer its parent."""

    # A server blocked in `join()` never returns to Python, so it cannot
    # react to signals its parent did not send; this watcher makes it exit
    # even when its parent was killed without cleaning up.
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv=None):
    """Serves the task `TF_CONFIG` describes until the process is killed."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_agn.strategies.server",
        description="Serves the worker or ps task that TF_CONFIG describes.",
    )
    parser.add_argument(
        "--parent_pid",
        type=int,
        help="exit as soon as the process with this id is no longer the "
        "parent (LocalCluster passes its own)",
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    try:
        tf_config = read_tf_config(("worker", "ps"))
    except ValueError as error:
        parser.error(str(error))
    server = start_server(tf_config)
    task = tf_config["task"]
    print(exposure_notice([server.target]), flush=True)
    print(
        f"{task['type']} {task.get('index', 0)} {SERVING} {server.target}", flush=True
    )
    server.join()


if __name__ == "__main__":
    main()
