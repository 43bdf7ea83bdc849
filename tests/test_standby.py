"""strategies/standby.py: a warm standby runs a command's script as
`python` would, with TensorFlow imported before the request came.

Restarted workers of real clusters run on standbys in
tests/test_restarts.py's and tests/test_preemption.py's launcher tests."""

import sys

import pytest

from scripts import checkout_env
from scripts import cluster_env
from scripts import launch
from tf_agn.strategies import standby

SCRIPT = """
import os, sys, time
print("tensorflow imported before:", "tensorflow" in sys.modules)
deadline = time.monotonic() + 5
while not os.path.exists(os.environ["TF_AGN_HEARTBEAT_FILE"]) and time.monotonic() < deadline:
    time.sleep(0.01)
print("beating:", os.path.exists(os.environ["TF_AGN_HEARTBEAT_FILE"]))
print("name:", __name__)
print("argv:", sys.argv[1:])
print("path0:", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("env:", os.environ.get("STANDBY_TEST"), "OLD" in os.environ)
print("stdin:", os.readlink("/proc/self/fd/0"), repr(sys.stdin.read()))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("command, runs", [
    ([sys.executable, "train.py", "--epochs=2"], True),
    ([sys.executable, "-m", "tf_agn.strategies.launch"], True),
    ([sys.executable, "-m"], False),
    ([sys.executable, "-c", "print(1)"], False),  # no file to run
    ([sys.executable, "-u", "train.py"], False),  # interpreter flags
    (["/bin/sh", "train.sh"], False),
    ([sys.executable], False),
])
def test_which_commands_run_on_standbys(command, runs):
    assert standby.runs_on_standby(command) is runs


def test_a_standby_runs_the_script_as_python_would(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    waiting = standby.Standby([sys.executable])
    env = checkout_env(STANDBY_TEST="yes", TF_AGN_HEARTBEAT_FILE=str(tmp_path / "heart"))
    try:
        # Read once it has imported TensorFlow and tf_agn.
        waiting.start(env, [str(script), "3", "--flag"])
        output = waiting.process.stdout.read()
        waiting.process.wait(timeout=120)
    finally:
        waiting.stop()
    assert waiting.process.returncode == 3, output
    assert "tensorflow imported before: True" in output, output
    assert "name: __main__" in output
    assert "argv: ['3', '--flag']" in output
    assert "path0: True" in output
    assert "env: yes False" in output  # the request's environment, whole
    # A worker on a standby beats before its script runs, as the worker of
    # the request's heartbeat file.
    assert "beating: True" in output
    assert "stdin: /dev/null ''" in output  # not the request's pipe


def test_a_pool_starts_standbys_for_python_commands_only_and_closes_them():
    pool = standby.Pool([sys.executable, "-c", "pass"], 2)
    pool.fill()
    assert pool.take() is None
    pool = standby.Pool([sys.executable, "train.py"], 2)
    pool.fill()
    first = pool.take()
    assert first is not None and first.process.poll() is None
    pool.fill()  # back to 2 waiting
    pool.close()
    first.process.stdin.close()  # a standby whose input closes exits
    assert first.process.wait(timeout=120) == 0
    assert pool.take() is None


# Attempt 1 fails once worker 0 has spoken (a worker 1 failing sooner stops
# worker 0 before its line: CI saw that race); attempt 2's workers say whether
# TensorFlow was imported before their script began.
RESTARTED = """
import os, sys, time
attempt = int(os.environ["TF_AGN_RESTART_COUNT"]) + 1
slot = os.environ["TF_AGN_WORKER_SLOT"]
spoken = os.path.join(sys.argv[1], "worker-0-spoke")
print(f"attempt {attempt}: warm {'tensorflow' in sys.modules}", flush=True)
if attempt == 1 and slot == "0":
    open(spoken, "w").close()
if attempt == 1 and slot == "1":
    deadline = time.monotonic() + 120
    while not os.path.exists(spoken) and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(7)
"""


def test_launch_restarts_workers_on_warm_standbys(tmp_path):
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "1"],
        [sys.executable, str(script), str(tmp_path)],
        cluster_env(),
    )
    assert code == 0, output
    assert "Worker slot 1 exited with code 7; restarting every worker" in output, output
    lines = [line for line in output.splitlines() if "attempt" in line and "warm" in line]
    assert sorted(lines) == [
        "[worker 1] attempt 1: warm False", "[worker 1] attempt 2: warm True",
        "attempt 1: warm False", "attempt 2: warm True",
    ], output
