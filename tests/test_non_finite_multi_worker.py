"""Under `tf_agn.strategies.multi_worker_mirrored()`, an overflow on one
worker skips the step on both: two worker processes on localhost
(tests/non_finite_worker.py), one CPU replica each, checked against the
same no-strategy references as test_non_finite.py."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tf_agn
from overflow import MULTI_WORKER_CASES
from overflow import NUM_REPLICAS
from overflow import batches
from overflow import case_key
from overflow import finite_batches
from overflow import reference_loss_scale
from overflow import reference_weights
from tf_agn.strategies.ports import free_ports

TIMEOUT_S = 120
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "non_finite_worker.py")
# As test_non_finite.py: float16 activations.
RTOL, ATOL = 1e-3, 1e-4


def worker_env(cluster, index):
    env = {
        name: value
        for name, value in os.environ.items()
        # gRPC would send localhost traffic to a proxy.
        if name.lower() not in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")
    }
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(tf_agn.__file__)))
    env.update(
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",  # CPU only: one replica per worker
        PYTHONPATH=os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")])),
    )
    return env


def start_workers(rundir):
    """Runs the workers until they exit or TIMEOUT_S passes.

    Returns:
        Their exit codes (None where killed at the deadline) and logs. No
        worker outlives this call, whatever happens.
    """
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(NUM_REPLICAS)]}
    processes, logs = [], [rundir / f"worker{i}.log" for i in range(NUM_REPLICAS)]
    try:
        for index, log_path in enumerate(logs):
            with open(log_path, "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, WORKER_SCRIPT, str(rundir)],
                        env=worker_env(cluster, index),
                        cwd=str(rundir),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group, killed below
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        # A worker that failed leaves its peer waiting on collectives.
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


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Every worker's results, in task order."""
    workdir = tmp_path_factory.mktemp("non_finite_multi_worker")
    for attempt in range(3):
        rundir = workdir / f"attempt{attempt}"
        rundir.mkdir()
        codes, texts = start_workers(rundir)
        # Another process took a port between free_ports and the worker's
        # bind: try new ones.
        if any(codes) and any("Could not start gRPC server" in t for t in texts):
            continue
        break
    if codes != [0] * NUM_REPLICAS:
        report = "\n".join(
            f"--- worker {i} (exit {code}) ---\n{text[-4000:]}"
            for i, (code, text) in enumerate(zip(codes, texts))
        )
        pytest.fail(f"workers failed or timed out after {TIMEOUT_S} s:\n{report}", pytrace=False)
    results = []
    for index in range(NUM_REPLICAS):
        with np.load(rundir / f"worker{index}.npz") as npz:
            results.append(dict(npz))
    return results


def weights(result, key, stage):
    count = len([k for k in result if k.startswith(f"{key}/{stage}/")])
    return [result[f"{key}/{stage}/{i}"] for i in range(count)]


@pytest.mark.parametrize("name, accumulation_steps", MULTI_WORKER_CASES)
def test_one_workers_overflow_skips_the_step_on_every_worker(
    workers, name, accumulation_steps
):
    key = case_key(name, accumulation_steps)
    reference = reference_weights(name, *finite_batches(*batches()), accumulation_steps)
    scale, counter = reference_loss_scale()
    for index, result in enumerate(workers):
        message = f"{key}, worker {index}"
        for got, want in zip(weights(result, key, "after"), weights(result, key, "before")):
            np.testing.assert_array_equal(got, want, err_msg=message)
        assert (float(result[f"{key}/scale"]), int(result[f"{key}/counter"])) == (
            scale, counter,
        ), message
        assert int(result[f"{key}/iterations"]) == (1 if accumulation_steps else 2)
        final = weights(result, key, "final")
        assert len(final) == len(reference)
        for got, want in zip(final, reference):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=message)
