"""The fixed-seed sweep of tests/behaviour_sweep.py still gives the numbers
recorded in tests/data/behaviour_sweep.npz.xz before the core's rebuild
(issue 27, point 9): every weight change, optimizer variable and `History`
log of every configuration on every transport, bitwise.

A configuration whose arithmetic a change reorders on purpose goes into
`ROUNDING_CHANGES` with the reason; it is then compared within
`RELATIVE_TOLERANCE` by norm. See behaviour_sweep.py's docstring for when
re-recording is allowed instead.

The three sweeps (about a minute of CPU each, one of them on a 2-worker
cluster) run once per test process, on the first test that needs each;
`test_matches_the_recording` is marked slow. On another machine than the
recording's, the code that made it runs here too (`recording`).
"""

import fnmatch
import os
import subprocess
import sys

import numpy as np
import pytest

import behaviour_sweep
from behaviour_sweep import CONFIGURATIONS
from behaviour_sweep import FIXTURE
from behaviour_sweep import TRANSPORTS
from conftest import DEVICES


# {"<transport>/<configuration name>" pattern (fnmatch): why its arithmetic
# changed}. Empty: the code as recorded reproduces every number bitwise,
# run after run (checked by running this file twice against the recording).
ROUNDING_CHANGES = {}
RELATIVE_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The fixture's arrays, {"<transport>/<configuration>/<tensor>": array};
    on another machine than the recording's, those of the code that made
    it, run here."""
    arrays = behaviour_sweep.load(FIXTURE)
    if str(arrays.pop("machine", "")) == behaviour_sweep.machine():
        return arrays
    return record_at(recording_commit(), tmp_path_factory.mktemp("recording_commit"))


def recording_commit():
    """The last commit that changed the fixture: the code that made it."""
    root = FIXTURE.parents[2]
    log = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%H", "--", str(FIXTURE)],
        capture_output=True, text=True,
    )
    if log.returncode or not log.stdout.strip():
        pytest.fail(
            f"{FIXTURE.name} was recorded on another machine, and git cannot name "
            f"the commit that made it to run here: {log.stderr.strip() or 'no history'}"
        )
    return log.stdout.strip()


def record_at(commit, workdir):
    """The sweep of `commit`'s code, recorded on this machine."""
    root = FIXTURE.parents[2]
    tree = workdir / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    # `tf_agn.strategies` is the top-level strategies/ as setup.py installs it.
    (tree / "tf_agn" / "strategies").symlink_to("../strategies")
    out = workdir / "recording.npz.xz"
    script = (
        "import pathlib, sys; sys.path.insert(0, 'tests'); import behaviour_sweep; "
        f"behaviour_sweep.record(pathlib.Path({str(out)!r}))"
    )
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-c", script], cwd=tree, env=env, check=True)
    arrays = behaviour_sweep.load(out)
    arrays.pop("machine", None)
    return arrays


@pytest.fixture(scope="module")
def current_sweep(tmp_path_factory):
    """`current_sweep(transport)`: the sweep on the code under test, keyed
    as the recording; each transport's sweep runs once."""
    done = {}

    def of(transport):
        if transport not in done:
            if transport == "workers_collective":
                workdir = tmp_path_factory.mktemp("behaviour_sweep_workers")
                done[transport] = behaviour_sweep.workers_sweep(workdir)
            else:
                name = transport.removeprefix("mirrored_")
                done[transport] = behaviour_sweep.mirrored_sweep(name, DEVICES)
        return done[transport]

    return of


def tolerance_of(configuration_key):
    """RELATIVE_TOLERANCE if a ROUNDING_CHANGES pattern matches, else 0
    (bitwise)."""
    matches = any(fnmatch.fnmatchcase(configuration_key, p) for p in ROUNDING_CHANGES)
    return RELATIVE_TOLERANCE if matches else 0.0


def difference(got, want, tolerance):
    """Why `got` is not `want` (None if it is): bitwise, or within
    `tolerance` relative to `want`'s norm when `tolerance` > 0."""
    if got.dtype != want.dtype or got.shape != want.shape:
        # A collapsed (1, ...) recording means every replica held the same
        # value; a (4, ...) result now means they no longer do.
        return f"{got.dtype}{list(got.shape)}, recorded {want.dtype}{list(want.shape)}"
    if got.tobytes() == want.tobytes():
        return None
    error = np.linalg.norm((got - want).astype(np.float64).ravel())
    scale = np.linalg.norm(want.astype(np.float64).ravel())
    relative = error / scale if scale else (0.0 if error == 0 else np.inf)  # 0.0 vs -0.0
    if tolerance and relative <= tolerance:
        return None
    allowed = f"{tolerance:g} relative" if tolerance else "bitwise"
    return f"differs ({allowed} required): relative difference by norm {relative:.3g}"


def mismatches(got, want, tolerance):
    """Every tensor of one configuration that is missing, new, or differs,
    in the recording's order: one line each, naming the tensor."""
    lines = [f"{t}: produced, not recorded" for t in got if t not in want]
    for tensor, recorded in want.items():
        if tensor not in got:
            lines.append(f"{tensor}: recorded, not produced")
        elif why := difference(got[tensor], recorded, tolerance):
            lines.append(f"{tensor}: {why}")
    return lines


def of_configuration(arrays, configuration_key):
    """{tensor: array} of the keys under "<configuration_key>/"."""
    prefix = configuration_key + "/"
    return {k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)}


# About 3 minutes on 2 cores, most of it tracing: the slow tier of CI.
@pytest.mark.slow
@pytest.mark.parametrize("configuration", CONFIGURATIONS, ids=lambda c: c.name)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matches_the_recording(transport, configuration, recording, current_sweep):
    key = f"{transport}/{configuration.name}"
    want = of_configuration(recording, key)
    assert want, f"{key} is not in {FIXTURE.name}: re-record (behaviour_sweep.py)"
    got = of_configuration(current_sweep(transport), key)
    lines = mismatches(got, want, tolerance_of(key))
    if lines:
        pytest.fail(f"{key} no longer gives the recorded numbers:\n  " + "\n  ".join(lines))


def test_differences_are_bitwise_unless_a_tolerance_is_given():
    want = np.array([[1.0, 2.0]], np.float32)
    close = want + np.float32(1e-7)  # ~5e-8 relative by norm
    assert difference(want.copy(), want, 0.0) is None
    assert "bitwise required" in difference(close, want, 0.0)
    assert difference(close, want, RELATIVE_TOLERANCE) is None
    assert "1e-06 relative required" in difference(want * 1.01, want, RELATIVE_TOLERANCE)
    # -0.0 == 0.0 numerically, but not bitwise.
    assert difference(np.array([-0.0]), np.array([0.0]), 0.0)
    # Replicas that now differ where the recording kept one row.
    assert "recorded float32[1, 2]" in difference(np.repeat(want, 4, 0), want, 0.0)
    assert mismatches({"a": want, "new": want}, {"a": want, "gone": want}, 0.0) == [
        "new: produced, not recorded",
        "gone: recorded, not produced",
    ]
