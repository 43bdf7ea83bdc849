"""Asynchronous training on real parameter-server clusters.

Every scenario runs in a process of its own (tests/ps_scenarios.py):
connecting a `ParameterServerStrategy` is for the life of a process. The
failure tests kill server subprocesses of processes-mode clusters.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from scripts import run_python

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_scenarios.py")


def run_scenario(name, *args, returncode=0, timeout=300):
    """Runs a scenario; returns (its JSON result or None, its stdout)."""
    result = run_python(SCENARIOS, name, *args, timeout=timeout, returncode=None)
    output = result.stdout + result.stderr[-4000:]
    if returncode == 0:
        assert result.returncode == 0, output
        return json.loads(result.stdout.splitlines()[-1]), result.stdout
    assert result.returncode != 0, output
    return None, result.stdout


@pytest.mark.parametrize(
    "num_ps, compression, bytes_per_commit",
    [
        (1, "none", (10 + 2) * 4),
        pytest.param(2, "none", (10 + 2) * 4, marks=pytest.mark.slow),
        # int8: a code per element and one float32 scale per variable.
        (1, "int8", 10 + 4 + 2 + 4),
    ],
)
def test_one_worker_cluster_matches_the_simulator(num_ps, compression, bytes_per_commit):
    # One worker commits in order, so the real runtime and the oracle agree
    # to rounding, also with every variable split across 2 ps, and with
    # commits that travel as int8 (decompressed on the ps).
    result, _ = run_scenario("one_worker_against_simulator", num_ps, compression)
    assert result["shards"] == [num_ps, num_ps]
    assert result["bytes_per_commit"] == bytes_per_commit
    assert result["bytes_received"] == 4 * bytes_per_commit
    for actual, expected in zip(result["actual"], result["expected"]):
        assert np.abs(np.asarray(expected) - 0.1).max() > 1e-3  # it trained
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert result["commits"] == 4
    np.testing.assert_allclose(result["loss"], result["simulated_loss"], rtol=1e-5)
    assert result["staleness"] == [0, 0, 0, 0]


def test_fit_runs_keras_callbacks_validation_and_staleness(tmp_path):
    result, _ = run_scenario("callbacks_and_validation", tmp_path)
    history = result["history"]
    # EarlyStopping(patience=1) with an impossible min_delta: two epochs.
    assert [epoch for epoch, _ in result["epochs"]] == [0, 1]
    assert set(result["epochs"][-1][1]) >= {"loss", "val_loss", "staleness", "commits"}
    assert history["commits"] == [4, 8]
    assert history["val_loss"][1] < history["val_loss"][0]
    # Validation ran on the center: the final weights give the same loss.
    np.testing.assert_allclose(
        history["val_loss"][-1], result["mse_at_center"], rtol=1e-4
    )
    assert (tmp_path / "log.csv").read_text().count("\n") == 3
    assert any((tmp_path / "tb" / "train").iterdir())
    assert sum(result["staleness_counts"]) == 8


def test_a_killed_worker_loses_no_commit():
    result, _ = run_scenario("killed_worker")
    # Exactly once: every scheduled window applied once, none twice.
    assert result["commits"] == result["scheduled"] == 20
    assert result["applied_windows"] == 20
    assert result["rejected"] == 0
    assert not result["killed_worker_alive"]


class _Result:
    """A scheduled window's result, as `ClusterCoordinator.schedule` gives."""

    def __init__(self, value):
        self.value = value

    def fetch(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_a_result_lost_with_its_worker_is_fetched_from_a_rerun():
    from tf_agn.strategies.recovery import fetch_window as _fetch

    lost = tf.errors.UnavailableError(None, None, "Connection refused")
    reruns = iter([_Result(lost), _Result((0.5, 0, 2))])
    assert _fetch(_Result(lost), lambda: next(reruns)) == (0.5, 0, 2)
    with pytest.raises(tf.errors.UnavailableError):
        _fetch(_Result(lost), lambda: _Result(lost))
    with pytest.raises(tf.errors.InvalidArgumentError):  # other errors are not retried
        _fetch(_Result(tf.errors.InvalidArgumentError(None, None, "bad")), None)


@pytest.mark.slow
def test_restart_after_parameter_server_failure_resumes_from_checkpoint(tmp_path):
    _, first = run_scenario("checkpointed_run", tmp_path, 10, returncode=1)
    assert "restored_commits=0" in first
    second, _ = run_scenario("checkpointed_run", tmp_path, -1)
    # Checkpoints every 4 windows and the ps died after the 10th fetched
    # window: the last checkpoint holds 8 commits, at most one interval lost.
    assert second["restored_commits"] == 8
    assert second["commits"] == second["applied_windows"] == 24


def test_misuse_is_refused():
    errors, _ = run_scenario("misuse")
    assert "windowed optimizers" in errors["plain_optimizer"]
    assert "steps_per_epoch must be an int >= 1" in errors["no_steps"]
    assert "tf_agn.strategies.fit" in errors["apply"]
    assert errors["keras_fit"] is not None


def test_fit_refuses_other_strategies():
    import keras

    import tf_agn

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(tf_agn.optimizers.AGN(), loss="mse")
    with pytest.raises(
        ValueError, match="ParameterServerStrategy; the model was created under"
    ):
        tf_agn.strategies.fit(model, lambda context: None, steps_per_epoch=3)
