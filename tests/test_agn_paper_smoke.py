"""Runs benchmarks/agn_paper.py on its `--smoke` setting: it must run all
four experiments and write well-formed results. The numbers themselves are
not checked (the smoke runs are far too short to reproduce the paper, and
the machine is shared); the benchmark's own PASS/FAIL lines are for people.
The scaling verdict's rule is checked on its own, on made-up runs."""

import importlib.util
import json
import os
import re
import textwrap

import pytest

from tests.scripts import ROOT
from tests.scripts import run_python

AGN_PAPER = os.path.join(ROOT, "benchmarks", "agn_paper.py")
EXPERIMENTS = ("divergence", "grid", "scaling", "staleness")


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_verdict(tmp_path):
    result = run_python(AGN_PAPER, "--smoke", f"--results_dir={tmp_path}", timeout=900)

    markdown = (tmp_path / "results.md").read_text()
    sections = re.findall(r"^## (\w+)", markdown, re.MULTILINE)
    assert [s.lower() for s in sections] == list(EXPERIMENTS), markdown
    verdicts = re.findall(r"^(PASS|FAIL)\b.*: ", markdown, re.MULTILINE)
    assert len(verdicts) == len(EXPERIMENTS), markdown
    assert len(re.findall(r"^  (PASS|FAIL)\b", result.stdout, re.M)) == 4

    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"config", *EXPERIMENTS}
    for name in EXPERIMENTS:
        assert isinstance(results[name]["passed"], bool)

    # Divergence ran on a real multi-process cluster, both algorithms.
    assert results["divergence"]["runtime"] == "cluster"
    assert set(results["divergence"]["runs"]) == {
        "downpour_n2",
        "agn_n2",
        "agn_scaled_n2",
    }
    for run in results["divergence"]["runs"].values():
        assert len(run["time"]) == len(run["seconds"]) == len(run["test_accuracy"])
        assert run["time"][0] == 0 and run["time"][-1] == run["windows"] / 2
        assert run["seconds"] == sorted(run["seconds"])
        assert run["staleness_mean"] >= 0

    for cell in results["grid"]["cells"]:
        assert set(cell["efficiency"]) == {
            "agn_vs_aeasgd",
            "agn_vs_dynsgd",
            "agn_scaled_vs_aeasgd",
        }
        assert all(e > 0 for e in cell["efficiency"].values())
    assert set(results["grid"]["shares"]) == set(cell["efficiency"])
    scaling = results["scaling"]["runs"]
    assert [r["num_workers"] for r in scaling] == [1, 2]
    for run in scaling:
        assert run["commits_per_second"] > 0
        assert 0 < run["cores_busy"] <= results["config"]["cpu_count"] + 0.5
        assert run["cpu_ms_per_commit"] > 0
    assert all(r["commits"] > 0 for r in results["staleness"]["runs"])

    if importlib.util.find_spec("matplotlib") is not None:
        for name in EXPERIMENTS:
            assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_scaling_verdict_passes_growth_or_a_saturated_stop_only():
    # A fresh process: the benchmark defines absl flags at import.
    code = textwrap.dedent(f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("agn_paper", {AGN_PAPER!r})
        agn_paper = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(agn_paper)

        def runs(rates, busy):
            return [
                dict(num_workers=n, commits_per_second=rate, cores_busy=cores,
                     cpu_ms_per_commit=1000 * cores / rate)
                for n, rate, cores in zip((1, 8, 32, 64), rates, busy)
            ]

        print(json.dumps([
            agn_paper.scaling_verdict(runs(rates, busy), cores=2)
            for rates, busy in [
                ((10, 40, 60, 80), (0.5, 1.0, 1.5, 1.9)),  # still growing
                ((10, 40, 30, 20), (0.5, 1.9, 2.0, 2.0)),  # stops saturated
                ((10, 40, 30, 20), (0.5, 1.2, 1.0, 0.8)),  # stops, cores idle
                ((10, 40, 60, 50), (0.5, 1.0, 1.7, 1.5)),  # 32 > 30, then falls
            ]
        ] + [agn_paper.scaling_verdict(runs((10, 40), (1.0, 1.9)), cores=2)]))
        """)
    result = run_python("-c", code, timeout=120)
    verdicts = json.loads(result.stdout.strip().splitlines()[-1])
    assert [v["passed"] for v in verdicts] == [True, True, False, True, False]
    assert verdicts[0]["verdict"].startswith("PASS: the commit rate still grows")
    assert verdicts[1]["verdict"].startswith("PASS (stop explained)")
    assert (
        "n = 8" in verdicts[1]["verdict"]
        and "1.90 of 2 cores" in verdicts[1]["verdict"]
    )
    assert verdicts[2]["verdict"].startswith("FAIL")
    assert "n = 8" in verdicts[2]["verdict"]
    # Saturated at the largest n measured: nothing shows that it stops.
    assert verdicts[4]["verdict"].startswith("FAIL: measured only up to n = 8")
