"""`tf_agn.metrics.temporal_efficiency` on curves with closed-form integrals."""

import keras
import numpy as np
import pytest

from tf_agn.metrics import temporal_efficiency


def test_linear_against_constant_is_exact():
    # f_a(t) = t on [0, 2], f_b(t) = 1 on [0, 1]: m = 1, ∫ t = 1/2, ∫ 1 = 1.
    assert temporal_efficiency(([0, 2], [0, 2]), ([0, 1], [1, 1])) == pytest.approx(0.5)
    assert temporal_efficiency(([0, 1], [1, 1]), ([0, 2], [0, 2])) == pytest.approx(2.0)


def test_saturating_curves_match_their_closed_form():
    # f(t) = 1 − exp(−k t): ∫₀^m = m − (1 − exp(−k m)) / k. Run b is longer,
    # so m is run a's duration.
    def integral(k, m):
        return m - (1 - np.exp(-k * m)) / k

    t_a = np.linspace(0, 3, 3001)
    t_b = np.linspace(0, 5, 5001)
    efficiency = temporal_efficiency(
        {"time": t_a, "accuracy": 1 - np.exp(-2 * t_a)},
        {"time": t_b, "accuracy": 1 - np.exp(-0.5 * t_b)},
    )
    assert efficiency == pytest.approx(integral(2, 3) / integral(0.5, 3), rel=1e-5)
    assert efficiency > 1  # the faster learner wins


def test_samples_off_the_end_are_interpolated():
    # Run b ends at 1.5, inside run a's last segment [1, 2] of f_a = t:
    # ∫₀^1.5 t dt = 1.125; f_b = 0.5 gives 0.75.
    assert temporal_efficiency(([0, 1, 2], [0, 1, 2]), ([0, 1.5], [0.5, 0.5])) == pytest.approx(1.5)


def test_a_keras_history_and_another_metric():
    history = keras.callbacks.History()
    history.history = {"time": [0.0, 1.0], "val_accuracy": [0.0, 1.0]}
    other = {"time": [0.0, 1.0], "val_accuracy": [0.25, 0.25]}
    assert temporal_efficiency(history, other, metric="val_accuracy") == pytest.approx(2.0)


def test_bad_curves_are_refused():
    with pytest.raises(ValueError, match="'time' and 'accuracy'"):
        temporal_efficiency({"accuracy": [1]}, ([0, 1], [1, 1]))
    with pytest.raises(ValueError, match="increasing"):
        temporal_efficiency(([0, 2, 1], [0, 1, 1]), ([0, 1], [1, 1]))
    with pytest.raises(ValueError, match="as many times as values"):
        temporal_efficiency(([0, 1], [1]), ([0, 1], [1, 1]))
    with pytest.raises(ValueError, match="integrates to 0"):
        temporal_efficiency(([0, 1], [1, 1]), ([0, 1], [0, 0]))
