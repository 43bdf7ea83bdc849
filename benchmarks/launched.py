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
    index its `TF_CONFIG` names}."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(i.split(b"=", 1) for i in f.read().split(b"\0") if b"=" in i)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if parent == launcher_pid and b"TF_CONFIG" in environ:
            found[int(pid)] = json.loads(environ[b"TF_CONFIG"])["task"]["index"]
    return found
