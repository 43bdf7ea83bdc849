"""Metrics for comparing training runs."""

import numpy as np


def temporal_efficiency(history_a, history_b, metric="accuracy"):
    """E(a, b) = ∫₀^m f_a(t) dt / ∫₀^m f_b(t) dt (Hermans et al., 2017).

    f is a run's metric over wall-clock time, linear between samples and
    held before the first, and m the shorter run's duration. E > 1 favours
    run a on average over that time.

    Example:

    >>> temporal_efficiency(([1, 2], [0.5, 1.0]), ([1, 2], [0.25, 0.5]))
    2.0

    Args:
        history_a: run a: a `(times, values)` pair, or a mapping (a Keras
            `History`'s) with "time" (seconds from the start, increasing)
            and `metric` entries.
        history_b: run b, the same way.
        metric: the mapping key of the values.

    Returns:
        E(a, b), a float.

    Raises:
        ValueError: for a run without samples, with bad times or lengths,
            or where run b's integral is 0.
    """
    times_a, values_a = _curve(history_a, metric, "a")
    times_b, values_b = _curve(history_b, metric, "b")
    end = min(times_a[-1], times_b[-1])
    denominator = _integral(times_b, values_b, end)
    if denominator == 0:
        raise ValueError(
            f"Run b's {metric} integrates to 0 over [0, {end}]; E(a, b) is "
            "undefined."
        )
    return _integral(times_a, values_a, end) / denominator


def _curve(history, metric, name):
    """Run `name`'s `(times, values)` as float64 arrays, checked."""
    if hasattr(history, "history"):  # a keras.callbacks.History
        history = history.history
    if isinstance(history, dict):
        missing = [key for key in ("time", metric) if key not in history]
        if missing:
            raise ValueError(
                f"Run {name} has no {missing} entries; it needs 'time' and "
                f"{metric!r}. It has {sorted(history)}."
            )
        times, values = history["time"], history[metric]
    else:
        times, values = history
    times = np.asarray(times, np.float64)
    values = np.asarray(values, np.float64)
    if times.ndim != 1 or times.shape != values.shape or times.size == 0:
        raise ValueError(
            f"Run {name} needs as many times as values, at least one; "
            f"received shapes {times.shape} and {values.shape}."
        )
    if times[0] < 0 or np.any(np.diff(times) <= 0):
        raise ValueError(
            f"Run {name}'s times must be >= 0 and increasing; received "
            f"{times.tolist()}."
        )
    return times, values


def _integral(times, values, end):
    """∫₀^end of the curve through (times, values), held before times[0]."""
    # Runs are sampled after their first update; trapezoids are exact here.
    inside = times < end
    grid = np.concatenate([[0.0], times[inside], [end]])
    curve = np.interp(grid, times, values)  # np.interp holds the ends
    return float(np.sum((curve[1:] + curve[:-1]) / 2 * np.diff(grid)))
