"""Runs benchmarks/step_overhead.py, compression.py and sharding.py on tiny
settings: each must run, print its tables and a verdict per target. The timings themselves are not checked (the
machine is shared); the benchmark's own PASS/FAIL lines are for people."""

import os
import re

import pytest

from scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_OVERHEAD = os.path.join(ROOT, "benchmarks", "step_overhead.py")
COMPRESSION = os.path.join(ROOT, "benchmarks", "compression.py")


def run_benchmark(*args, timeout=300):
    return run_python(STEP_OVERHEAD, *args, timeout=timeout, returncode=None)


@pytest.mark.slow
def test_step_overhead_runs_and_reports():
    result = run_benchmark(
        "--model=small",
        "--batch_size=32",
        "--configs=keras_stock,keras,dist_mean,agn,accum",
        "--local_steps=1,2",
        "--accumulation_steps=1,2",
        "--steps=4",
        "--repeats=1",
        "--warmup_steps=2",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for name in ("keras_stock", "keras", "dist_mean", "agn_1", "agn_2", "accum_1", "accum_2"):
        assert re.search(rf"^  {name}\s+\d+\.\d+", out, re.MULTILINE), out
    assert re.search(r"^  (PASS|FAIL): DistributedOptimizer MEAN", out, re.M)
    assert re.search(r"^  (PASS|FAIL): agn_2 takes", out, re.M)
    # Bytes do not depend on the machine's load: exactly half.
    assert re.search(r"^  PASS: accum_2 sends \d+ bytes per micro-step, 0.5000", out, re.M), out


def test_step_overhead_rejects_partial_windows():
    result = run_benchmark(
        "--configs=agn", "--local_steps=16", "--steps=20", timeout=120
    )
    assert result.returncode != 0
    assert "not a multiple" in result.stdout + result.stderr


@pytest.mark.slow
def test_compression_runs_and_reports():
    # 2 workers, a 784-16-10 MLP, 2 steps, 1 round: start-up and tracing
    # are most of it.
    result = run_python(
        COMPRESSION,
        "--hidden_units=16",
        "--convergence_hidden_units=16",
        "--warmup_steps=1",
        "--steps=2",
        "--repeats=1",
        "--byte_calls=1",
        "--convergence_steps=3",
        "--convergence_seeds=2",
        timeout=240,
    )
    out = result.stdout
    for name in ("stock", "ours", "fp16", "int8", "powersgd_r1", "powersgd_r4", "floor"):
        assert re.search(rf"^  {name}\s+\d+\.\d\s+\d+\.\d\s", out, re.M), (name, out)
    # The codec part: every candidate against the memory pass, and what
    # int8's bytes buy against fp16.
    assert re.search(r"^  memory pass\s+\d+\.\d\s+1\.0\s+-$", out, re.M), out
    for name in ("ours", "fp16", "int8", "powersgd_r1", "powersgd_r4"):
        assert re.search(rf"^  {name}\s+\d+\.\d\s+\d+\.\d\s+[\d,]+$", out, re.M), (name, out)
    assert re.search(r"^  int8 sends .* fewer than fp16 .*: it is the faster", out, re.M), out
    assert re.search(r"^  powersgd_r4, sending nothing: .* = \d+\.\d\dx the floor", out, re.M), out
    assert re.search(r"^  powersgd_r4\s+[\d,]+\s+\d+\.\d$", out, re.M), out  # ResNet-50 bytes
    # Accuracy: the mean of two seeds, between their min and max.
    row = re.search(r"^  powersgd_r4_no_ef\s+(\d+\.\d\d)\s+(\d+\.\d)\s+(\d+\.\d)\s", out, re.M)
    assert row, out
    mean, low, high = map(float, row.groups())
    assert low - 0.05 <= mean <= high + 0.05, row.group(0)
    for letter in "abcde":
        assert re.search(rf"^  (PASS|FAIL): \({letter}\) ", out, re.M), (letter, out)
    # The bytes do not depend on the machine's load.
    assert re.search(r"^  PASS: \(c\) ", out, re.M), out


@pytest.mark.slow
def test_sharding_runs_and_reports():
    # A 784-64-10 MLP, 2 steps, 1 round: memory in fresh processes, speed
    # on 2 logical CPUs and across 2 workers, saving across 2 workers.
    result = run_python(
        os.path.join(ROOT, "benchmarks", "sharding.py"),
        "--hidden_units=64", "--models=mlp", "--steps=2", "--repeats=1", "--num_replicas=2",
        timeout=900, returncode=None,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for row in ("mlp (0.1M) | unsharded", "mlp (0.1M) | sharded",
                "tf_agn sharded, float32 Adam | 8Ψ + 12Ψ/n", "stock Keras (default ops)",
                "reduce-scatter + all-gather"):
        assert f"| {row}" in out, out
    # memory_stats, not the load: Adam's moments halve on 2 replicas.
    states = [float(s) for s in re.findall(r"^\| mlp \S+ \| \w+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", out, re.M)]
    assert len(states) == 2 and states[1] < 0.8 * states[0], out
    assert re.search(r"^  (PASS|FAIL): the MLP's peak resident memory", out, re.M)
    # On 2 logical CPUs, then across 2 worker processes.
    assert len(re.findall(r"^  (PASS|FAIL): sharded / unsharded = \d", out, re.M)) == 2, out
    assert "-- speed: 2 workers on localhost" in out
    # Each worker's peak, training alone and then saving each way.
    for run in ("training alone", ".weights.h5", ".keras"):
        assert re.search(rf"^\| {re.escape(run)} \| \d+ \| \d+ \|$", out, re.M), out
    assert re.search(r"^  Keras's in-memory .h5 of the .keras file's weights \(not counted\)", out, re.M)
    assert re.search(r"^  (PASS|FAIL): saving adds at most -?\d+ MiB to a worker's", out, re.M)
