"""tf_agn's aggregating optimizers under a real 2-worker
`MultiWorkerMirroredStrategy`: two processes on localhost, one CPU replica
each, so gradients travel through TensorFlow's collective ops, not
tf_agn's, and `aggregate_gradients` takes its weighted all_reduce(SUM) path.

Both workers (tests/multi_worker_worker.py) train the test MLP of
test_optimizers.py once per aggregation method in a single cluster start;
the checks below compare what each wrote with the numpy reference.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tf_agn
from reference import sgd_trajectory
from mlp import BATCH
from mlp import LEARNING_RATE
from mlp import METHODS
from mlp import build_mlp
from mlp import data
from mlp import initial_params

NUM_WORKERS = 2
STEPS = 3
TIMEOUT_S = 120
WORKER_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "multi_worker_worker.py"
)
# As test_optimizers.py's assert_replicas_close. The workers match the
# reference to ~1e-7; a 2x-off gradient or another replica's shard moves
# these weights by more than 0.1 in 3 steps (_assert_matches checks that
# such wrong references fall outside the tolerance).
RTOL, ATOL = 1e-4, 1e-5


def _free_ports(count):
    """Ports nothing listens on now: bound to port 0 together (so they are
    distinct), then released for the workers' gRPC servers."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _worker_env(cluster, index):
    env = dict(os.environ)
    for name in list(env):  # gRPC would send localhost traffic to a proxy
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            del env[name]
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(tf_agn.__file__)))
    env.update(
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",  # CPU only: one replica per worker
        # The tf_agn this test imported (checkout or Bazel runfiles).
        PYTHONPATH=os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")])),
    )
    return env


def _tail(path, limit=4000):
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    return text[-limit:]


def _start_workers(workdir, args):
    """Starts the cluster's workers and waits up to TIMEOUT_S for them.

    Returns their exit codes and log paths, and whether they timed out.
    Whatever happens, no worker outlives this call.
    """
    cluster = {"worker": [f"localhost:{port}" for port in _free_ports(NUM_WORKERS)]}
    processes, logs = [], []
    timed_out = False
    try:
        for index in range(NUM_WORKERS):
            logs.append(workdir / f"worker{index}.log")
            with open(logs[-1], "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, WORKER_SCRIPT, *args, str(workdir)],
                        env=_worker_env(cluster, index),
                        cwd=str(workdir),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group, killed below
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in processes):
            # A worker that failed leaves its peers waiting on collectives.
            if any(p.returncode not in (None, 0) for p in processes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return [p.returncode for p in processes], logs, timed_out


def _run_cluster(workdir, attempts=3):
    """Runs both workers to completion and returns their results."""
    x, y = data(STEPS)
    inputs = str(workdir / "inputs.npz")
    np.savez(
        inputs, x=x, y=y, batch_size=BATCH, learning_rate=LEARNING_RATE,
        methods=np.array(METHODS),
    )
    model = str(workdir / "mlp.keras")
    build_mlp(initial_params()).save(model)

    for attempt in range(attempts):
        rundir = workdir / f"attempt{attempt}"
        rundir.mkdir()
        codes, logs, timed_out = _start_workers(rundir, [inputs, model])
        if not timed_out and not any(codes):
            break
        texts = [_tail(log) for log in logs]
        # Another process took a port between _free_ports and the worker's
        # bind: pick new ones.
        if timed_out or not any("Could not start gRPC server" in t for t in texts):
            break
    if timed_out or any(codes):
        report = "\n".join(
            f"--- worker {i} (exit {code}) ---\n{text}"
            for i, (code, text) in enumerate(zip(codes, texts))
        )
        reason = f"timed out after {TIMEOUT_S} s" if timed_out else "failed"
        pytest.fail(
            f"MultiWorkerMirroredStrategy workers {reason} ({rundir}):\n{report}",
            pytrace=False,
        )
    results = []
    for index in range(NUM_WORKERS):
        with np.load(rundir / f"worker{index}.npz") as npz:
            results.append(dict(npz))
    return results


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return _run_cluster(tmp_path_factory.mktemp("multi_worker"))


def _weights(result, method):
    count = len(initial_params())
    return [result[f"{method}/{i}"] for i in range(count)]


def _close(got, want):
    return all(
        np.allclose(g, w, rtol=RTOL, atol=ATOL) for g, w in zip(got, want, strict=True)
    )


def _assert_matches(got, want, wrong, message):
    """`got` matches `want`, and the tolerance is tight enough that none of
    the `wrong` references (other scale, other replica) would have."""
    for name, alternative in wrong.items():
        assert not _close(alternative, want), f"{message}: {name} is indistinguishable"
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(
            g, w, rtol=RTOL, atol=ATOL, err_msg=f"{message}, weight {index}"
        )


def _swap_replica_shards(x):
    """`x` with the two halves of every global batch swapped, so that
    replica 0 of the reference sees what replica 1 saw."""
    half = BATCH // 2
    batches = x.reshape(-1, 2, half, *x.shape[1:])
    return batches[:, ::-1].reshape(x.shape)


def _shard_rows(index):
    """Rows of the global data worker `index` is meant to see, step by step."""
    half = BATCH // NUM_WORKERS
    return np.arange(STEPS)[:, None] * BATCH + index * half + np.arange(half)


def test_each_worker_is_one_replica_fed_its_own_shard(workers):
    for index, result in enumerate(workers):
        assert int(result["task_index"]) == index
        assert int(result["num_replicas_in_sync"]) == NUM_WORKERS
        assert int(result["num_local_replicas"]) == 1
        assert int(result["replica_id"]) == index
        assert not result["uses_tf_agn_ops"]
        np.testing.assert_array_equal(result["rows"], _shard_rows(index))


@pytest.mark.parametrize("method", METHODS)
def test_weights_match_numpy_reference(workers, method):
    x, y = data(STEPS)

    def reference(x, y, learning_rate=LEARNING_RATE):
        return sgd_trajectory(
            initial_params(), x, y, method, NUM_WORKERS, BATCH, learning_rate
        )

    want = reference(x, y)
    doubled = reference(x, y, 2 * LEARNING_RATE)
    halved = reference(x, y, LEARNING_RATE / 2)
    # Each replica's shard in the other's place.
    swapped = reference(_swap_replica_shards(x), _swap_replica_shards(y))
    for index, result in enumerate(workers):
        wrong = {"2x scale": doubled[index], "0.5x scale": halved[index]}
        if method in ("only_first_replica", "none"):
            wrong["the other replica"] = swapped[index]
        _assert_matches(
            _weights(result, method), want[index], wrong,
            f"{method}, worker {index}",
        )


def test_none_trains_each_worker_on_its_own_shard_alone(workers):
    x, y = data(STEPS)
    finals = []
    for index, result in enumerate(workers):
        rows = _shard_rows(index).reshape(-1)
        (alone,) = sgd_trajectory(
            initial_params(), x[rows], y[rows], "none", 1, BATCH // NUM_WORKERS,
            LEARNING_RATE,
        )
        got = _weights(result, "none")
        for i, (g, w) in enumerate(zip(got, alone, strict=True)):
            np.testing.assert_allclose(
                g, w, rtol=RTOL, atol=ATOL, err_msg=f"worker {index}, weight {i}"
            )
        finals.append(got)
    assert not _close(finals[0], finals[1]), "NONE: the workers did not drift apart"


@pytest.mark.parametrize("method", ["sum", "mean", "only_first_replica"])
def test_synchronized_methods_keep_workers_equal(workers, method):
    first, second = (_weights(result, method) for result in workers)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"weight {i}")
