"""Runs benchmarks/adl_throughput.py on tiny settings: it must run, print its
table and its verdict. The timings themselves are not checked (the machine
is shared); the PASS/FAIL line is for people."""

import os
import re

import pytest

from scripts import run_python

# Whole example and benchmark runs: in CI, not in the quick command.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADL_THROUGHPUT = os.path.join(ROOT, "benchmarks", "adl_throughput.py")
TINY = ["--width=32", "--depth=4", "--steps=4", "--repeats=1"]


def run_benchmark(*args, timeout=300):
    return run_python(ADL_THROUGHPUT, *TINY, *args, timeout=timeout).stdout


def rows(stdout):
    return re.findall(r"^  (\w+_\d)\s+(\d)\s+(\d+)\s+\d+", stdout, re.MULTILINE)


def test_adl_throughput_runs_and_reports():
    out = run_benchmark("--stages=2", "--budget_epochs=0")
    assert rows(out) == [("bp_1", "1", "1"), ("adl_2", "2", "2")], out
    assert re.search(
        r"^  (PASS|FAIL): ADL at K=2 runs at \d+\.\d\dx", out, re.MULTILINE
    )
    assert "logical CPU devices sharing them" in out


def test_adl_throughput_with_k_4_and_accuracy():
    out = run_benchmark("--stages=2,4", "--budget_epochs=1", "--train_samples=512")
    assert [r[0] for r in rows(out)] == ["bp_1", "adl_2", "adl_4"], out
    assert ("adl_4", "4", "6") in rows(out)  # M = 2 (K - 1)
    accuracies = re.findall(r"^  \w+_\d .* (\d\.\d{4})$", out, re.MULTILINE)
    assert len(accuracies) == 3, out
