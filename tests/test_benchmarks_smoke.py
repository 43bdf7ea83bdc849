"""Runs benchmarks/step_overhead.py on a tiny setting: it must run, print its
table and a verdict per target. The timings themselves are not checked (the
machine is shared); the benchmark's own PASS/FAIL lines are for people."""

import os
import re

import pytest

from scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_OVERHEAD = os.path.join(ROOT, "benchmarks", "step_overhead.py")


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
