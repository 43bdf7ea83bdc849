"""Running a test's worker script as every worker of a localhost
`MultiWorkerMirroredStrategy` cluster, and what those workers share.

Imported by the tests (`run_workers`, `worker_env`) and by the worker
scripts themselves (`wait_for_files`); it imports neither TensorFlow nor
conftest, which would split the CPU of a worker that must keep one replica.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from tf_agn.strategies.ports import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")


def worker_env(cluster, index):
    """The environment of worker `index` of `cluster`: its `TF_CONFIG`, one
    CPU replica, this checkout's tf_agn, and no proxy (gRPC would send
    localhost traffic to it)."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARIABLES}
    env.update(
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    return env


def _start(script, args, rundir, num_workers, timeout):
    """Runs the workers until all exit, one fails, or `timeout` s pass.

    Returns:
        Their exit codes (None for one still running at the deadline) and
        their output. No worker outlives this call, whatever happens.
    """
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(num_workers)]}
    processes, logs = [], [rundir / f"worker{i}.log" for i in range(num_workers)]
    try:
        for index, log_path in enumerate(logs):
            with open(log_path, "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, script, *map(str, args), str(rundir)],
                        env=worker_env(cluster, index),
                        cwd=str(rundir),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group, killed below
                    )
                )
        deadline = time.monotonic() + timeout
        # A worker that failed leaves its peers waiting on collectives.
        while any(p.poll() is None for p in processes) and not any(
            p.poll() for p in processes
        ):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        codes = [p.poll() for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return codes, [log.read_text(errors="replace") for log in logs]


def run_workers(script, args, workdir, num_workers, timeout, attempts=3):
    """Runs `script ARGS RUNDIR` as every worker of a fresh localhost
    cluster and returns what each wrote to RUNDIR/worker<i>.npz.

    Ports are free when chosen, but another process may take one before a
    worker binds it: then the cluster is started again on new ports.

    Raises:
        AssertionError (pytest's failure): with every worker's output, if
            one failed or the cluster outlasted `timeout` s.
    """
    import pytest  # Only the tests call this; worker scripts need no pytest.

    for attempt in range(attempts):
        rundir = workdir / f"attempt{attempt}"
        rundir.mkdir()
        codes, texts = _start(script, args, rundir, num_workers, timeout)
        if any(codes) and any("Could not start gRPC server" in t for t in texts):
            continue
        break
    if codes != [0] * num_workers:
        report = "\n".join(
            f"--- worker {i} (exit {code}) ---\n{text[-4000:]}"
            for i, (code, text) in enumerate(zip(codes, texts))
        )
        pytest.fail(
            f"workers failed or timed out after {timeout} s ({rundir}):\n{report}",
            pytrace=False,
        )
    results = []
    for index in range(num_workers):
        with np.load(rundir / f"worker{index}.npz") as npz:
            results.append(dict(npz))
    return results


def write_results(out_dir, index, results):
    """Writes worker `index`'s results atomically, for `run_workers`."""
    path = os.path.join(out_dir, f"worker{index}.npz")
    np.savez(path + ".partial.npz", **results)
    os.replace(path + ".partial.npz", path)


def wait_for_files(paths, timeout=60):
    """Returns once every path exists (or after `timeout` s): a worker
    waits for its peers' results, so that none still needs its collectives
    when it exits."""
    deadline = time.monotonic() + timeout
    while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
        time.sleep(0.05)
