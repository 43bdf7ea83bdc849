"""The launcher (`python -m tf_agn.strategies.launch`) and the server module
(`python -m tf_agn.strategies.server`): run as users run them, in fresh
processes, and their argument checks in this one."""

import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from cluster_checks import checkout_env
from cluster_checks import default_sigint
from cluster_checks import port_is_free
from scripts import cluster_env
from scripts import launch
from tf_agn.strategies import launch as launcher
from tf_agn.strategies import server
from tf_agn.strategies.ports import free_ports
from tf_agn.strategies.ports import unreachable
from tf_agn.strategies.server import SERVING

# Trains nothing: counts to 4 on the parameter server through the workers,
# then exits with 3, which the launcher must pass on.
COORDINATOR_SCRIPT = """
import sys

import tensorflow as tf

import tf_agn

strategy = tf_agn.strategies.parameter_server()
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    count = tf.Variable(0.0)
    per_worker = tf.Variable(0.0, per_worker_variable=True)


@tf.function
def step():
    count.assign_add(1.0)
    per_worker.assign_add(1.0)


for _ in range(4):
    coordinator.schedule(step)
coordinator.join()
workers = len(per_worker.read_all())
print(f"workers={workers} count={count.numpy()}", flush=True)
sys.exit(3)
"""


@pytest.mark.slow
def test_launch_runs_the_command_as_coordinator_and_passes_its_exit_code(tmp_path):
    script = tmp_path / "coordinator.py"
    script.write_text(COORDINATOR_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tf_agn.strategies.launch",
            "--workers",
            "2",
            "--ps",
            "1",
            "--",
            sys.executable,
            str(script),
        ],
        env=checkout_env(),
        capture_output=True,
        check=False,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    lines = result.stdout.splitlines()
    assert "listen on all network interfaces, without authentication" in lines[0], output
    assert lines[1].startswith("Local cluster: worker localhost:"), output
    assert "workers=2 count=4.0" in result.stdout, output


@pytest.mark.slow
def test_interrupted_launch_stops_the_command_and_the_cluster():
    command = "print('ready', flush=True); import time; time.sleep(600)"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tf_agn.strategies.launch",
            "--workers",
            "1",
            "--",
            sys.executable,
            "-c",
            command,
        ],
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        notice, cluster_line = launcher.stdout.readline(), launcher.stdout.readline()
        assert "without authentication" in notice, notice
        assert launcher.stdout.readline() == "ready\n", cluster_line
        launcher.send_signal(
            signal.SIGINT
        )  # Only the launcher: not a terminal's Ctrl-C.
        assert launcher.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        launcher.kill()
        launcher.wait()
    ports = [int(port) for port in re.findall(r"localhost:(\d+)", cluster_line)]
    assert len(ports) == 3, cluster_line
    assert all(map(port_is_free, ports[:2])), cluster_line  # The worker and ps.


def test_launch_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exited:
        launcher.parse_args(["--workers", "2"])
    assert exited.value.code == 2
    assert "give the command to run after '--'" in capsys.readouterr().err
    options, command = launcher.parse_args(["--ps", "2", "--", "python", "--ps", "1"])
    assert (options.workers, options.ps, command) == (2, 2, ["python", "--ps", "1"])


@pytest.mark.parametrize("count", ["0", "-1"])
def test_launch_refuses_fewer_than_one_multi_worker(capsys, count):
    with pytest.raises(SystemExit) as exited:
        launcher.parse_args(["--multi_worker", count, "--", "python"])
    assert exited.value.code == 2
    assert f"--multi_worker must be >= 1; received {count}" in capsys.readouterr().err


def test_server_module_serves_the_task_of_its_tf_config():
    ps, worker = (f"localhost:{port}" for port in free_ports(2))
    tf_config = {"cluster": {"worker": [worker], "ps": [ps]}, "task": {"type": "ps"}}
    server = subprocess.Popen(
        [sys.executable, "-m", "tf_agn.strategies.server"],
        env=checkout_env(TF_CONFIG=json.dumps(tf_config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The port answers before the server prints; wait for the line itself.
    # The timer turns a server that never prints into a failure, not a hang.
    killer = threading.Timer(120, server.kill)
    killer.start()
    lines = []
    try:
        for line in server.stdout:
            lines.append(line)
            if SERVING in line:
                break
        assert not unreachable([ps], timeout=10) and server.poll() is None
    finally:
        killer.cancel()
        server.kill()
        lines.append(server.communicate()[0])
    assert "ps 0 serving at grpc://localhost:" in "".join(lines)
    notice = "TensorFlow gRPC servers listen on all network interfaces"
    assert f"{notice}, without authentication, on port(s) {ps.split(':')[1]}:" in (
        "".join(lines)
    )


def test_server_module_names_a_malformed_tf_config(monkeypatch, capsys):
    # test_cluster.py checks the other problems read_tf_config names.
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}}')
    with pytest.raises(SystemExit) as exited:
        server.main([])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert 'no "ps" job' in error and "A valid TF_CONFIG looks like" in error


ROOT = pathlib.Path(__file__).resolve().parent.parent
MNIST_MIRRORED = str(ROOT / "examples" / "mnist_mirrored.py")


@pytest.mark.slow
def test_launch_multi_worker_trains_the_example_across_two_processes():
    result = subprocess.run(
        [
            sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "2",
            "--", sys.executable, MNIST_MIRRORED,
            "--epochs=3", "--train_samples=2000", "--verbose=0",
        ],
        env=checkout_env(), capture_output=True, text=True, timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "2 replicas, aggregation=mean" in result.stdout, output
    ports = re.search(r"^Local multi-worker cluster: localhost:(\d+), localhost:(\d+)$",
                      result.stdout, re.M)
    assert ports, output
    assert f"without authentication, on port(s) {', '.join(ports.groups())}:" in output
    accuracies = {}
    # Not anchored to lines: worker 0 writes its output itself while the
    # launcher relays worker 1's, so with unbuffered output (e.g.
    # PYTHONUNBUFFERED=1) a relayed line can land between worker 0's text
    # and its newline.
    for prefix, value in re.findall(r"(\[worker 1\] )?test_accuracy=([\d.]+)", result.stdout):
        accuracies[prefix or "worker 0"] = float(value)
    # Each worker evaluates the (shared) model on its shard of the test set.
    assert len(accuracies) == 2, output
    assert min(accuracies.values()) > 0.8, accuracies


# Worker 1 fails only once every worker has started (each leaves a file in
# STARTED_DIR): otherwise the launcher may, rightly, stop worker 0 before it
# has printed anything, and the test would check a race, not the launcher.
WORKER_EXITS = """
import json, os, pathlib, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
workers = len(config["cluster"]["worker"])
# One string: unbuffered, print writes its arguments one by one, and the
# launcher may relay a peer's line between them.
print(f"worker {index} of {workers}", flush=True)
started = pathlib.Path(os.environ["STARTED_DIR"])
(started / str(index)).touch()
if index == 1:
    deadline = time.monotonic() + 30
    while len(list(started.iterdir())) < workers and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(5)
time.sleep(600)
"""


def test_launch_multi_worker_stops_every_worker_when_one_fails(tmp_path):
    env = checkout_env(STARTED_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "3",
         "--", sys.executable, "-c", WORKER_EXITS],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 5, result.stdout + result.stderr
    assert "worker 0 of 3" in result.stdout
    assert "[worker 1] worker 1 of 3" in result.stdout


# Recovery: preemption, hangs, slots ------------------------------------------
# The workers here are plain Python (no TensorFlow), each run recorded in
# STATE_DIR: "start-<slot>-<attempt>" once started (attempt: the launcher's
# TF_AGN_RESTART_COUNT + 1). They beat through
# strategies/heartbeat.py loaded by path, as `multi_worker_mirrored` does.
RECOVERY_WORKER = """
import importlib.util, json, os, pathlib, signal, sys, time
spec = importlib.util.spec_from_file_location("heartbeat", os.environ["HEARTBEAT_PY"])
heartbeat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heartbeat)
# Beaten once before it returns, so a worker stopped right after is found.
assert heartbeat.start_from_environment() and heartbeat.age_s(os.environ["TF_AGN_HEARTBEAT_FILE"]) < 1
slot = int(os.environ["TF_AGN_WORKER_SLOT"])
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
state = pathlib.Path(os.environ["STATE_DIR"])
attempt = int(os.environ["TF_AGN_RESTART_COUNT"]) + 1
(state / f"start-{slot}-{attempt}").touch()
print(f"slot {slot} attempt {attempt} of {workers} workers", flush=True)
deadline = time.monotonic() + 30
while len(list(state.glob(f"start-*-{attempt}"))) < workers and time.monotonic() < deadline:
    time.sleep(0.02)
exec(os.environ["PLAN"])
"""


def _recover(tmp_path, launcher_args, plan, after_start=None, worker=RECOVERY_WORKER):
    """Runs `worker` (RECOVERY_WORKER) under the launcher with `plan`
    (Python run by each worker once all of its group started, with `slot`,
    `attempt`, `workers` and `state` set); returns (exit code, output)."""
    env = cluster_env(
        STATE_DIR=str(tmp_path), PLAN=plan,
        HEARTBEAT_PY=str(pathlib.Path(launcher.__file__).parent / "heartbeat.py"),
    )
    return launch(launcher_args, [sys.executable, "-c", worker], env,
                  timeout=120, after_start=after_start)


def _assert_slot_1_found_hung(tmp_path, code, output, timeout):
    """Slot 1, stopped (its time in "stopped"), was killed as hung and the
    job restarted within `timeout`, a beat and the launcher's poll, plus
    the new group's start."""
    assert code == 0, output
    assert ("Worker slot 1 stopped sending heartbeats and was killed; restarting every "
            "worker (restart 1 of 1).") in output, output
    stopped = float((tmp_path / "stopped").read_text())
    restarted = min(path.stat().st_mtime for path in tmp_path.glob("start-*-2"))
    assert timeout - 1 < restarted - stopped < timeout + 1 + 4, restarted - stopped


def test_a_preempted_group_waits_for_every_backup_and_restarts_uncounted(tmp_path):
    # Attempt 1: slot 0 exits preempted at once, slot 1 a second later (its
    # backup is slower); attempt 2 succeeds. No restart is allowed.
    plan = """
if attempt == 1:
    time.sleep(slot)
    print(f"slot {slot} backed up", flush=True)
    sys.exit(75)
"""
    code, output = _recover(tmp_path, ["--multi_worker", "2"], plan)
    assert code == 0, output
    assert "[worker 1] slot 1 backed up" in output, output  # not killed early
    assert ("Every worker backed up after a preemption notice; restarting every worker "
            "(not counted as a failure).") in output
    assert "slot 1 attempt 2 of 2 workers" in output


def test_sigterm_to_the_launcher_is_every_workers_notice_and_it_exits_75(tmp_path):
    plan = """
signal.signal(signal.SIGTERM, lambda *a: (print(f"slot {slot} noticed", flush=True), sys.exit(75)))
time.sleep(600)
"""

    def terminate_once_started(process):
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("start-*-1"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # past their signal.signal
        process.send_signal(signal.SIGTERM)

    code, output = _recover(tmp_path, ["--multi_worker", "2", "--max_restarts", "3"], plan,
                            after_start=terminate_once_started)
    assert code == 75, output
    assert "slot 0 noticed" in output and "[worker 1] slot 1 noticed" in output, output
    assert output.rstrip().endswith("exiting with 75."), output
    assert output.count("Local multi-worker cluster") == 1, output


def test_a_hung_worker_is_killed_within_the_timeout_and_a_busy_one_is_not(tmp_path):
    # Attempt 1: slot 1 stops itself (SIGSTOP), as a frozen host would.
    # Attempt 2: slot 0 is busy for twice the timeout, still beating.
    plan = """
if attempt == 1:
    if slot == 1:
        (state / "stopped").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
if slot == 0:
    time.sleep(8)
"""
    code, output = _recover(
        tmp_path, ["--multi_worker", "2", "--max_restarts", "1", "--hang_timeout", "4"], plan
    )
    _assert_slot_1_found_hung(tmp_path, code, output, 4)


def test_a_worker_hung_before_its_first_beat_is_killed_once_its_cpu_time_stands_still(
    tmp_path,
):
    # Attempt 1: both workers spin without beating for 5 s, as a slow
    # import would: not hung. Then slot 1 stops itself before it starts
    # beating, as a worker frozen while it imports TensorFlow would: its
    # CPU time stands still for 3 s, so it is hung. Attempt 2's workers
    # beat and succeed.
    worker = RECOVERY_WORKER.replace("assert heartbeat.start_from_environment() and", "assert")
    worker = worker.replace('heartbeat.age_s(os.environ["TF_AGN_HEARTBEAT_FILE"]) < 1', "True")
    plan = """
if attempt == 1:
    spin = time.monotonic() + 5
    while time.monotonic() < spin:
        pass
    (state / f"spun-{slot}").touch()
if attempt == 1 and slot == 1:
    (state / "stopped").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
assert heartbeat.start_from_environment()
if attempt == 1:
    time.sleep(600)
"""
    code, output = _recover(
        tmp_path, ["--multi_worker", "2", "--max_restarts", "1", "--hang_timeout", "3"], plan,
        worker=worker,
    )
    _assert_slot_1_found_hung(tmp_path, code, output, 3)
    # Silent but busy for longer than the timeout, neither was killed.
    assert (tmp_path / "spun-0").exists() and (tmp_path / "spun-1").exists()


def test_a_survivor_that_hangs_while_the_others_save_is_killed_not_waited_for(tmp_path):
    # Attempt 1: slot 0 answers abort requests, as a connected worker does,
    # and stops itself; slot 1 then fails. The launcher asks slot 0 to save
    # and would give it the whole backup grace (120 s): a hung survivor is
    # killed once its heartbeat is 3 s old instead.
    plan = """
if attempt == 1 and slot == 0:
    heartbeat.answer_aborts(lambda: None)
    (state / "stopped").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
if attempt == 1 and slot == 1:
    while not (state / "stopped").exists():
        time.sleep(0.05)
    sys.exit(7)
"""
    code, output = _recover(
        tmp_path, ["--multi_worker", "2", "--max_restarts", "1", "--hang_timeout", "3"], plan
    )
    assert code == 0, output
    assert "Worker slot 1 exited with code 7; restarting every worker" in output, output
    stopped = float((tmp_path / "stopped").read_text())
    restarted = min(path.stat().st_mtime for path in tmp_path.glob("start-*-2"))
    assert restarted - stopped < 3 + 1 + 4, restarted - stopped


def test_a_slot_that_keeps_failing_is_dropped_and_rejoins_at_a_later_restart(tmp_path):
    # Slot 2 never comes up; in the first group of 2, slot 1 fails once.
    plan = """
if slot == 2:
    sys.exit(9)
if slot == 1 and workers == 2 and attempt == 3:
    sys.exit(7)
"""
    code, output = _recover(
        tmp_path,
        ["--multi_worker", "3", "--min_workers", "2", "--slot_failures", "2",
         "--max_restarts", "4"],
        plan,
    )
    assert code == 0, output
    events = [line for line in output.splitlines()
              if line.startswith(("Worker slot", "slot 0 attempt"))]
    assert events == [
        "slot 0 attempt 1 of 3 workers",
        "Worker slot 2 exited with code 9; restarting every worker (restart 1 of 4).",
        "slot 0 attempt 2 of 3 workers",
        "Worker slot 2 exited with code 9; restarting every worker (restart 2 of 4).",
        "Worker slot 2 failed 2 times in a row: dropped; the job goes on with 2 workers "
        "(--min_workers 2).",
        "slot 0 attempt 3 of 2 workers",
        "Worker slot 1 exited with code 7; restarting every worker (restart 3 of 4).",
        "Worker slot(s) [2] rejoin: the job grows back to 3 workers.",
        "slot 0 attempt 4 of 3 workers",
        "Worker slot 2 exited with code 9; restarting every worker (restart 4 of 4).",
        "Worker slot 2 failed 3 times in a row: dropped; the job goes on with 2 workers "
        "(--min_workers 2).",
        "slot 0 attempt 5 of 2 workers",
    ], output


@pytest.mark.parametrize("argv, error", [
    (["--multi_worker", "3", "--min_workers", "0"], "--min_workers must be between 1 and "
     "--multi_worker (3); received 0"),
    (["--multi_worker", "3", "--min_workers", "4"], "received 4"),
    (["--min_workers", "1"], "--min_workers applies to --multi_worker clusters only"),
    (["--multi_worker", "2", "--slot_failures", "0"], "--slot_failures must be >= 1; received 0"),
    (["--multi_worker", "2", "--hang_timeout", "1"],
     "--hang_timeout must be 0 (never) or at least 3 seconds; received 1"),
])
def test_launch_refuses_bad_recovery_settings(capsys, argv, error):
    with pytest.raises(SystemExit):
        launcher.parse_args([*argv, "--", "python"])
    assert error in capsys.readouterr().err
