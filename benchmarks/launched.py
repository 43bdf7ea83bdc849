"""What the benchmarks that drive `python -m tf_agn.strategies.launch` as a
subprocess share: the workers' environment, and finding the workers."""

import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cluster_env():
    """This checkout on the path, quiet TensorFlow, one CPU replica per
    worker, and no HTTP proxy (gRPC would send localhost traffic to it)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in list(env):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            del env[name]
    return env


def launcher_workers(launcher_pid):
    """The launcher's worker processes now, from /proc: {pid: the worker
    index its `TF_CONFIG` names, or None for a warm standby that became a
    worker (strategies/standby.py: its /proc/<pid>/environ is the
    standby's, its standard input /dev/null)}. A standby still starting or
    waiting, its standard input the launcher's pipe, is left out."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(i.split(b"=", 1) for i in f.read().split(b"\0") if b"=" in i)
            stdin = os.readlink(f"/proc/{pid}/fd/0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"TF_CONFIG" in environ:
            found[int(pid)] = json.loads(environ[b"TF_CONFIG"])["task"]["index"]
        elif stdin == os.devnull:
            found[int(pid)] = None
    return found


def mlp_job(strategy, units, batch_size, make_optimizer):
    """A worker's job in the preemption and rescue-cost benchmarks: an MLP
    784-`units`-10 compiled with `make_optimizer()` in `strategy`'s scope, and an
    endless dataset of 8 random batches of `batch_size`. Returns
    (model, dataset)."""
    import numpy as np  # a worker's imports: the launcher side needs none
    import tensorflow as tf

    import tf_agn

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size * 8, 784)).astype("float32")
    y = rng.integers(0, 10, len(x))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch_size)
    with strategy.scope():
        model = tf_agn.models.mlp((784,), 10, hidden_units=[int(u) for u in units])
        model.compile(optimizer=make_optimizer(), loss="sparse_categorical_crossentropy")
    return model, dataset
