"""Runs examples/compare_sync.py end to end at a reduced size and checks
its table, its JSON, its plot and AGN's communication savings."""

import json
import math
import os
import re

import pytest

from scripts import run_python

# Whole example and benchmark runs: in CI, not in the quick command.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE_SYNC = os.path.join(ROOT, "examples", "compare_sync.py")

TRAIN_SAMPLES = 2000
EPOCHS = 2
BATCH_SIZE = 512
LOCAL_STEPS = 4
# The MLP 784-256-128-10 in float32: each aggregation sends every weight.
NUM_PARAMETERS = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Runs sync Adam and AGN(Adam) λ=4 once; returns (stdout, output dir)."""
    output_dir = tmp_path_factory.mktemp("compare_sync")
    result = run_python(
        COMPARE_SYNC,
        "--cpu_replicas=4",
        f"--train_samples={TRAIN_SAMPLES}",
        f"--epochs={EPOCHS}",
        f"--batch_size={BATCH_SIZE}",
        f"--local_steps_list={LOCAL_STEPS}",
        "--configs=adam,agn",
        f"--output_dir={output_dir}",
        "--verbose=0",
        MPLBACKEND="Agg",
    )
    return result.stdout, output_dir


def _results(output_dir):
    with open(output_dir / "results.json", encoding="utf-8") as f:
        return json.load(f)


def _by_name(output_dir):
    return {r["name"]: r for r in _results(output_dir)["results"]}


def test_prints_and_writes_a_well_formed_table(run):
    stdout, output_dir = run
    table = (output_dir / "results.md").read_text(encoding="utf-8").strip()
    assert table in stdout
    lines = table.splitlines()
    assert lines[0] == (
        "| configuration | final test accuracy | wall time (s) | "
        "bytes communicated (MB) |"
    )
    assert lines[1] == "|---|---:|---:|---:|"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["sync Adam", f"AGN(Adam) λ={LOCAL_STEPS}"]
    by_name = _by_name(output_dir)
    for row, name in zip(rows, ["adam", f"agn{LOCAL_STEPS}"]):
        assert len(row) == 4
        accuracy, wall_time, megabytes = map(float, row[1:])
        result = by_name[name]
        assert accuracy == pytest.approx(result["final_test_accuracy"], abs=1e-4)
        assert wall_time == pytest.approx(result["wall_time_s"], abs=0.051)
        assert megabytes == pytest.approx(result["bytes_sent"] / 1e6, abs=0.0051)


def test_json_holds_settings_and_per_epoch_histories(run):
    _, output_dir = run
    data = _results(output_dir)
    settings = data["settings"]
    assert settings["train_samples"] == TRAIN_SAMPLES
    assert settings["epochs"] == EPOCHS
    assert settings["num_replicas"] == 4
    assert settings["local_steps_list"] == [LOCAL_STEPS]
    assert [r["name"] for r in data["results"]] == ["adam", f"agn{LOCAL_STEPS}"]
    for result in data["results"]:
        assert result["num_parameters"] == NUM_PARAMETERS
        history = result["history"]
        assert history["epoch"] == list(range(1, EPOCHS + 1))
        for key in ("test_accuracy", "wall_time_s", "bytes_sent"):
            assert len(history[key]) == EPOCHS, key
            assert all(math.isfinite(v) for v in history[key]), key
        # Cumulative: never decreasing; the last entry is the final value.
        for key in ("wall_time_s", "bytes_sent"):
            assert history[key] == sorted(history[key]), key
        assert history["bytes_sent"][-1] == result["bytes_sent"]
        assert history["test_accuracy"][-1] == result["final_test_accuracy"]
        assert history["wall_time_s"][-1] == result["wall_time_s"]
        assert result["wall_time_s"] > 0


def test_accuracies_beat_chance_by_far(run):
    _, output_dir = run
    for result in _results(output_dir)["results"]:
        assert 0.5 < result["final_test_accuracy"] <= 1, result["name"]
        for accuracy in result["history"]["test_accuracy"]:
            assert 0 <= accuracy <= 1, result["name"]


def test_agn_sends_one_commit_per_window(run):
    _, output_dir = run
    by_name = _by_name(output_dir)
    adam, agn = by_name["adam"], by_name[f"agn{LOCAL_STEPS}"]
    # 2000 samples in batches of 512 (the last one 464): 4 steps an epoch.
    steps = EPOCHS * math.ceil(TRAIN_SAMPLES / BATCH_SIZE)
    assert adam["steps"] == agn["steps"] == steps == 8
    bytes_per_aggregation = 4 * NUM_PARAMETERS  # float32
    # Sync Adam all-reduces every step ...
    assert adam["all_reduce_calls"] == steps
    assert adam["bytes_sent"] == steps * bytes_per_aggregation
    # ... AGN once per window of λ steps, a partial last window included.
    commits = math.ceil(steps / LOCAL_STEPS)
    assert agn["all_reduce_calls"] == commits == 2
    assert agn["bytes_sent"] == commits * bytes_per_aggregation
    # 8 steps, λ = 4: exactly a quarter of the bytes.
    assert agn["bytes_sent"] * LOCAL_STEPS == adam["bytes_sent"]
    # Per epoch too: one commit in each epoch of 4 steps.
    assert agn["history"]["bytes_sent"] == [
        bytes_per_aggregation * (e + 1) for e in range(EPOCHS)
    ]
    assert adam["history"]["bytes_sent"] == [
        bytes_per_aggregation * steps // EPOCHS * (e + 1) for e in range(EPOCHS)
    ]


def test_writes_a_png_or_says_why_not(run):
    stdout, output_dir = run
    png = output_dir / "compare_sync.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
        assert re.search(r"matplotlib is not installed", stdout), stdout
        return
    with open(png, "rb") as f:
        assert f.read(len(PNG_MAGIC)) == PNG_MAGIC
    assert png.stat().st_size > 1000
