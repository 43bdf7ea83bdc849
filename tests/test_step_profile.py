"""benchmarks/step_profile.py: the gaps between collectives and what the
executor ran in them, on a step built by hand (the overlap smoke test reads
a real profile)."""

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import step_profile  # noqa: E402
from step_profile import Interval  # noqa: E402

FORWARD = Interval(0.0, 2.0, "dense/MatMul:MatMul")
BACKWARD = Interval(2.0, 5.0, "gradient_tape/dense/MatMul:MatMul")
RELU_BACKWARD = Interval(3.0, 4.0, "gradient_tape/dense/ReluGrad:ReluGrad")
ADAM = Interval(9.0, 12.0, "adam/AssignSubVariableOp:AssignSubVariableOp")
COLLECTIVES = [
    Interval(4.0, 6.0, "first:CollectiveReduceV2"),
    Interval(6.5, 8.0, "second:CollectiveReduceV2"),
    Interval(11.0, 13.0, "third:CollectiveReduceV2"),
]
STEP = step_profile.Step(14.0, [[FORWARD, BACKWARD, ADAM], [RELU_BACKWARD]], COLLECTIVES)


def test_idle_gaps_are_the_waits_between_collectives_with_the_kernels_run_meanwhile():
    # From 8.0 to 11.0 no collective ran; only Adam's kernel (9-12) ran then.
    assert step_profile.idle_gaps(STEP) == [(COLLECTIVES[2], 3.0, [ADAM])]
    # The 0.5 ms wait before the second counts at a lower threshold; no
    # kernel ran from 6.0 to 6.5.
    assert step_profile.idle_gaps(STEP, min_ms=0.5) == [
        (COLLECTIVES[1], 0.5, []),
        (COLLECTIVES[2], 3.0, [ADAM]),
    ]
    assert step_profile.idle_gaps(STEP, min_ms=3.5) == []


def test_describe_says_when_the_backward_pass_and_each_collective_ran():
    assert step_profile.describe(STEP) == [
        "step 14.0 ms; backward pass from 2.0 to 5.0 ms; 2 executor thread(s)",
        "  collective 0:     4.0 to     6.0 ms",
        "  collective 1:     6.5 to     8.0 ms",
        "  collective 2:    11.0 to    13.0 ms",
        "  before collective 2, none ran for 3.0 ms; the executor ran 1 kernel(s), the longest "
        "adam/AssignSubVariableOp:AssignSubVariableOp (3.0 ms)",
    ]
    forward_only = step_profile.Step(2.0, [[FORWARD]], [])
    assert step_profile.describe(forward_only) == ["step 2.0 ms; no backward pass"]
