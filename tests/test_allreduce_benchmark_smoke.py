"""Runs benchmarks/allreduce.py and benchmarks/multi_worker_allreduce.py on
tiny settings: each must check every candidate against numpy, print its
tables and a verdict per target. The
timings themselves are not checked (the machine is shared); the benchmark's
own PASS/FAIL lines are for people."""

import importlib.util
import os
import re

import numpy as np
import pytest

from scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLREDUCE = os.path.join(ROOT, "benchmarks", "allreduce.py")
MULTI_WORKER = os.path.join(ROOT, "benchmarks", "multi_worker_allreduce.py")
CANDIDATES = (
    "stock_default",
    "reduction_to_one_device",
    "ours_local",
    "ours_collective",
)


def run_benchmark(*args, script=ALLREDUCE, timeout=600):
    result = run_python(script, *args, timeout=timeout, returncode=None)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def assert_rows(out, title, names):
    """Every name has a timed row in the table headed `title`."""
    match = re.search(
        rf"^-- {re.escape(title)} --\n(.*?)(?:\n\n|\Z)", out, re.M | re.S
    )
    assert match, out
    for name in names:
        assert re.search(
            rf"^  {name}\s+\d+\.\d+\s+\d+\.\d+\s", match.group(1), re.M
        ), (title, name, out)


def assert_verdict(out, pattern):
    assert re.search(rf"^  (PASS|FAIL): {pattern}", out, re.M), (pattern, out)


@pytest.mark.slow
def test_allreduce_benchmark_runs_and_reports():
    out = run_benchmark(
        "--sets=tiny",
        "--tiny_tensors=20",
        "--repeats=1",
        "--fit_steps=2",
        "--fit_batch_size=8",
    )
    assert "stock_default: MirroredStrategy picks" in out
    assert re.search(r"load average \d", out), out
    for mode in ("keras_path", "unplaced"):
        for name in CANDIDATES:
            line = rf"^  {mode}/{name}: traced, ran and checked"
            assert re.search(line, out, re.M), out
        assert_rows(out, f"tiny, {mode}", CANDIDATES + ("numpy_floor",))
    assert "every replica's outputs match numpy" in out
    assert_rows(out, "fit_step (ms per step)", CANDIDATES)
    assert "failed" not in out.lower(), out
    ratio = r"\d+\.\d+x"
    # One line per target that a tiny run exercises, in the targets' order.
    assert_verdict(
        out,
        rf"tiny keras_path: ours_local is {ratio} as fast as "
        "reduction_to_one_device",
    )
    assert_verdict(out, rf"tiny: ours_local unplaced takes {ratio} its keras_path")
    assert_verdict(
        out, rf"fit_step: ours \(ours_local\) steps {ratio} as fast as stock_default"
    )
    assert_verdict(
        out, rf"tiny keras_path: ours_collective is {ratio} as fast as stock_default"
    )


@pytest.mark.slow
def test_allreduce_benchmark_resnet50_target():
    out = run_benchmark("--sets=resnet50", "--modes=keras_path", "--repeats=1")
    assert_rows(out, "resnet50, keras_path", CANDIDATES + ("numpy_floor",))
    assert_verdict(
        out, r"resnet50 keras_path: ours \(ours_local\) takes \d+\.\d+x the numpy floor"
    )


@pytest.mark.slow
def test_multi_worker_benchmark_runs_and_reports():
    out = run_benchmark(
        "--sets=big", "--big_size=100000", "--repeats=1", "--byte_calls=1",
        script=MULTI_WORKER,
    )
    assert "2 workers, one CPU replica each; mwms_default:" in out, out
    names = ("mwms_default", "ours", "ours_fp16")
    for name in names:
        assert re.search(rf"^  {name}: traced, ran and checked", out, re.M), out
    assert_rows(out, "big, keras_path across workers", names)
    # The loopback bytes of one call: at least the payload a 2-worker ring
    # sends (each worker its 400 KB, half that in fp16).
    rows = dict(
        re.findall(r"^  (\w+)\s+[\d.]+\s+[\d.]+\s+[\d.-]+\s+([\d.]+)\s", out, re.M)
    )
    assert float(rows["ours"]) >= 2 * 100000 * 4 / 2**20 * 0.99, out
    assert float(rows["ours_fp16"]) >= 2 * 100000 * 2 / 2**20 * 0.99, out
    assert_verdict(out, r"big: ours is \d+\.\d+x as fast as mwms_default")
    assert_verdict(out, r"big: ours_fp16 puts \d+\.\d+x the bytes of ours on the wire")


def test_numpy_floor_sums_every_replica_in_chunks_on_every_thread():
    spec = importlib.util.spec_from_file_location("allreduce_benchmark", ALLREDUCE)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    rng = np.random.default_rng(0)
    shapes = [(7, 3), (50,), (1,)]  # 72 elements: chunks of 10 split tensors
    arrays = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    want = np.concatenate([a.ravel() for a in benchmark.replica_sum(arrays)])
    np.testing.assert_allclose(
        want, sum(np.concatenate([a.ravel() for a in r]) for r in arrays), rtol=1e-6
    )
    floor = benchmark.numpy_floor(arrays, threads=3, chunk_elements=10)
    np.testing.assert_allclose(floor(), want, rtol=1e-6)
    np.testing.assert_allclose(floor(), want, rtol=1e-6)  # runs again alike
