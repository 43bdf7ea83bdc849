"""Runs benchmarks/agn_paper.py on its `--smoke` setting: it must run all
four experiments and write well-formed results. The numbers themselves are
not checked (the smoke runs are far too short to reproduce the paper, and
the machine is shared); the benchmark's own PASS/FAIL lines are for people."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGN_PAPER = os.path.join(ROOT, "benchmarks", "agn_paper.py")
EXPERIMENTS = ("divergence", "grid", "scaling", "staleness")


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_verdict(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    # Import this checkout's tf_agn, in the benchmark and its subprocesses.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, AGN_PAPER, "--smoke", f"--results_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    markdown = (tmp_path / "results.md").read_text()
    sections = re.findall(r"^## (\w+)", markdown, re.MULTILINE)
    assert [s.lower() for s in sections] == list(EXPERIMENTS), markdown
    verdicts = re.findall(r"^(PASS|FAIL): ", markdown, re.MULTILINE)
    assert len(verdicts) == len(EXPERIMENTS), markdown
    assert len(re.findall(r"^  (PASS|FAIL): ", result.stdout, re.M)) == 4

    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"config", *EXPERIMENTS}
    for name in EXPERIMENTS:
        assert isinstance(results[name]["passed"], bool)
    run = results["divergence"]["runs"]["agn_n2"]
    assert len(run["time"]) == len(run["test_accuracy"]) >= 2
    assert all(cell["e_aeasgd"] > 0 for cell in results["grid"]["cells"])
    assert [r["num_workers"] for r in results["scaling"]["runs"]] == [1, 2]
    assert all(r["commits_per_second"] > 0 for r in results["scaling"]["runs"])
    assert all(r["commits"] > 0 for r in results["staleness"]["runs"])

    if importlib.util.find_spec("matplotlib") is not None:
        for name in EXPERIMENTS:
            assert (tmp_path / f"{name}.png").stat().st_size > 0
