"""`Schedule`: when each stage forwards and backpropagates each batch.

Batch b enters at tick b; stage k forwards it at tick b + f_k and
backpropagates it D_k ticks later:

| schedule | forward lag f_k | delay D_k     | within a tick              |
|----------|-----------------|---------------|----------------------------|
| `"adl"`  | k               | 2 (K − 1 − k) | the K stages independent   |
| `"ddg"`  | 0               | K − 1 − k     | one chained forward        |
| `"bp"`   | 0               | 0             | chained forward, backward  |
"""

import collections

SCHEDULES = ("adl", "ddg", "bp")


class Schedule:
    """The timing of one of `SCHEDULES` over `num_stages` stages.

    Args:
        name: "adl", "ddg" or "bp", in any case.
        num_stages: K, the number of stages (an int >= 1).

    Raises:
        ValueError: if `name` is not one of `SCHEDULES`.

    Example:

    >>> schedule = Schedule("adl", 3)
    >>> schedule.forward_lags, schedule.delays
    ([0, 1, 2], [4, 2, 0])
    """

    def __init__(self, name, num_stages):
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in SCHEDULES:
            raise ValueError(
                f"Unknown schedule {name!r}. Allowed: {', '.join(SCHEDULES)} "
                "(case-insensitive)."
            )
        self.name = key
        self.num_stages = num_stages
        last = num_stages - 1
        # ADL: two ticks of delay per later stage (gradient sent, then used).
        if key == "adl":
            self.forward_lags = list(range(num_stages))
            self.delays = [2 * (last - k) for k in range(num_stages)]
        elif key == "ddg":
            self.forward_lags = [0] * num_stages
            self.delays = [last - k for k in range(num_stages)]
        else:
            self.forward_lags = [0] * num_stages
            self.delays = [0] * num_stages

    @property
    def chained_forward(self):
        """Whether stage k forwards stage k − 1's output of the same tick."""
        return self.name != "adl"

    @property
    def backward_lags(self):
        """f_k + D_k: stage k backpropagates batch b at tick b + this."""
        return [f + d for f, d in zip(self.forward_lags, self.delays)]

    def num_ticks(self, num_batches):
        """Ticks until `num_batches` batches are fed and fully trained."""
        return num_batches + max(self.backward_lags)

    def forwarded(self, tick, num_batches):
        """The batch each stage forwards at `tick`; -1 where none."""
        return _batches_at(tick, self.forward_lags, num_batches)

    def backpropagated(self, tick, num_batches):
        """The batch each stage backpropagates at `tick`; -1 where none."""
        return _batches_at(tick, self.backward_lags, num_batches)

    def staleness(self, accumulation_steps, num_batches=None):
        """Per stage, a `collections.Counter` {staleness: batches} the
        schedule predicts with M = `accumulation_steps`: for batches
        0 .. `num_batches` − 1 from an empty pipeline, or (None) in steady
        state."""
        # Batch b's staleness: the b' in [b − D_k, b − 1] with (b' + 1) % M == 0.
        steps = accumulation_steps
        first = 0 if num_batches is not None else 10 * steps * max(self.delays)
        batches = range(first, first + (num_batches or steps))
        return [
            collections.Counter(
                sum((b2 + 1) % steps == 0 for b2 in range(max(b - d, 0), b))
                for b in batches
            )
            for d in self.delays
        ]


def _batches_at(tick, lags, num_batches):
    """The batch at `tick` for each of `lags`; -1 where none."""
    return [tick - lag if 0 <= tick - lag < num_batches else -1 for lag in lags]
