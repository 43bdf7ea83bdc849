"""Runs examples/adl_mnist.py end to end, as a user would."""

import os
import re

from scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADL_MNIST = os.path.join(ROOT, "examples", "adl_mnist.py")


def run_example(*args, timeout=300):
    """Runs the example in a fresh process, which splits its CPU itself."""
    return run_python(ADL_MNIST, *args, timeout=timeout).stdout


def test_adl_mnist_learns_and_reports_staleness():
    # K = 2, M = 2, 2 epochs of the 4,000 training digits: 0.912, 0.919 and
    # 0.934 test accuracy with seeds 0-2 (BP, same run: 0.942). Chance is
    # 0.10; 0.88 leaves room for noise yet fails a pipeline that mixes up
    # batches or gradients.
    stdout = run_example(
        "--stages=2", "--accumulation_steps=2", "--epochs=2", "--verbose=0"
    )
    assert "schedule=adl, K=2, M=2" in stdout
    # 62 batches per epoch; the first two of each epoch see no step yet.
    assert "stage 0: delay D=2, measured staleness mean 0.968" in stdout
    assert "histogram {0: 4, 1: 120}" in stdout
    accuracy = float(re.search(r"^test_accuracy=(\S+)$", stdout, re.MULTILINE).group(1))
    assert accuracy >= 0.88
