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

import pytest

from cluster_checks import checkout_env
from cluster_checks import default_sigint
from cluster_checks import port_is_free
from tf_agn.strategies import launch
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
        launch.parse_args(["--workers", "2"])
    assert exited.value.code == 2
    assert "give the command to run after '--'" in capsys.readouterr().err
    options, command = launch.parse_args(["--ps", "2", "--", "python", "--ps", "1"])
    assert (options.workers, options.ps, command) == (2, 2, ["python", "--ps", "1"])


@pytest.mark.parametrize("count", ["0", "-1"])
def test_launch_refuses_fewer_than_one_multi_worker(capsys, count):
    with pytest.raises(SystemExit) as exited:
        launch.parse_args(["--multi_worker", count, "--", "python"])
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
