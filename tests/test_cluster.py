"""`LocalCluster` and `parameter_server` with real `tf.distribute.Server`s.

Training on threads-mode clusters runs in a process of its own
(tests/ps_threads_worker.py): a process that connected a
`ParameterServerStrategy` stays connected, and later `MirroredStrategy`
tests in it would hang. Processes-mode clusters run one server subprocess
per task; the tests check that `stop()`, Ctrl-C and a dead parent free
every port and process.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cluster_checks import alive
from cluster_checks import checkout_env
from cluster_checks import default_sigint
from cluster_checks import listening
from cluster_checks import own_servers
from cluster_checks import port_is_free
from cluster_checks import run_in_fresh_process
from tf_agn.strategies import LocalCluster
from tf_agn.strategies import cluster as cluster_module
from tf_agn.strategies import parameter_server
from tf_agn.strategies.ports import accepts
from tf_agn.strategies.ports import free_ports

SERVER_SCRIPT = cluster_module._SERVER_SCRIPT
THREADS_WORKER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "ps_threads_worker.py"
)
# Server processes this module started, directly or through scripts; none
# may outlive it.
STARTED_PIDS = []


@pytest.fixture(scope="module", autouse=True)
def no_leaked_servers():
    yield
    deadline = time.monotonic() + 5  # Parent-watching servers take ~0.5 s.
    while time.monotonic() < deadline and any(map(alive, STARTED_PIDS)):
        time.sleep(0.1)
    assert not [pid for pid in STARTED_PIDS if alive(pid)]
    if os.path.isdir("/proc"):
        assert not own_servers(SERVER_SCRIPT)


def _port(address):
    return int(address.rpartition(":")[2])


# Threads mode ----------------------------------------------------------------


@pytest.fixture(scope="module")
def threads_training():
    """What tests/ps_threads_worker.py measured, in a process of its own."""
    return run_in_fresh_process(THREADS_WORKER)


def test_coordinator_counts_every_scheduled_step_exactly(threads_training):
    count = threads_training["count"]
    assert count["total"] == 10.0
    assert "/job:ps/" in count["total_device"]
    # Each worker added to its own copy; together they ran every step.
    per_worker = count["per_worker"]
    assert len(per_worker) == 2 and sum(per_worker) == 10.0, per_worker


def test_second_cluster_and_coordinator_in_one_process(threads_training):
    shards = threads_training["shards"]
    assert shards["shard_shapes"] == [[500, 64], [500, 64]]
    devices = shards["shard_devices"]
    assert "/job:ps/replica:0/task:0" in devices[0], devices
    assert "/job:ps/replica:0/task:1" in devices[1], devices
    assert shards["values"] == [2.0]


def test_auto_partitioner_shards_large_variables_only(threads_training):
    assert threads_training["shards"]["auto_shards"] == {"large": 2, "small": 1}


def test_in_process_servers_cannot_be_killed():
    cluster = LocalCluster(num_workers=1)
    with pytest.raises(RuntimeError, match="mode='processes'"):
        cluster.kill_worker(0)


# Arguments and configuration -------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "num_workers must be an int >= 1; received 0"),
        ({"num_workers": 1, "num_ps": 0}, "num_ps must be an int >= 1; received 0"),
        (
            {"num_workers": 1, "mode": "spark"},
            "'threads', 'processes'; received 'spark'",
        ),
        ({"num_workers": 1, "start_timeout": 0}, "start_timeout"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(**kwargs)


def test_tf_config_describes_every_task():
    cluster = LocalCluster(num_workers=2, num_ps=1)
    addresses = cluster.addresses
    assert sorted(addresses) == ["chief", "ps", "worker"]
    ports = [_port(a) for tasks in addresses.values() for a in tasks]
    assert len(set(ports)) == 4
    assert cluster.tf_config("worker", 1) == {
        "cluster": addresses,
        "task": {"type": "worker", "index": 1},
        "rpc_layer": "grpc",
    }
    assert cluster.cluster_spec.as_dict() == addresses
    assert cluster.cluster_resolver.task_type == "chief"
    with pytest.raises(ValueError, match="No task 'worker' 2"):
        cluster.tf_config("worker", 2)


def test_unreachable_task_raises_instead_of_hanging():
    worker, ps = (f"localhost:{port}" for port in free_ports(2))
    start = time.monotonic()
    with pytest.raises(ConnectionError) as raised:
        parameter_server({"worker": [worker], "ps": [ps]}, connect_timeout=2)
    assert time.monotonic() - start < 20
    message = str(raised.value)
    assert f"worker 0 at {worker}" in message and f"ps 0 at {ps}" in message
    assert "2 s" in message


_GOOD_CLUSTER = {
    "chief": ["localhost:1"],
    "worker": ["localhost:2"],
    "ps": ["localhost:3"],
}


@pytest.mark.parametrize(
    "tf_config, problem",
    [
        (None, "TF_CONFIG is not set"),
        ("{'cluster': }", "TF_CONFIG is not valid JSON"),
        (
            {
                "cluster": {"chief": ["a:1"], "worker": ["a:2"]},
                "task": {"type": "chief"},
            },
            'no "ps" job',
        ),
        (
            {"cluster": {"chief": ["a:1"], "ps": ["a:2"]}, "task": {"type": "chief"}},
            'no "worker" job',
        ),
        (
            {"cluster": _GOOD_CLUSTER},
            "task is None; this process needs a task of type 'chief'",
        ),
        (
            {"cluster": _GOOD_CLUSTER, "task": {"type": "worker", "index": 0}},
            "type 'chief'",
        ),
        (
            {"cluster": _GOOD_CLUSTER, "task": {"type": "chief", "index": 1}},
            "index 1 is out of range",
        ),
    ],
)
def test_malformed_tf_config_is_named(monkeypatch, tf_config, problem):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        text = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
        monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(ValueError) as raised:
        parameter_server(connect_timeout=1)
    message = str(raised.value)
    assert problem in message
    assert 'A valid TF_CONFIG looks like: {"cluster": {"chief"' in message


# Processes mode --------------------------------------------------------------


def test_stop_kills_every_server_and_frees_its_port(capsys):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with LocalCluster(num_workers=2, num_ps=1, mode="processes") as cluster:
        # While servers run, SIGTERM stops them before the process ends.
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        pids = [pid for job_pids in cluster.pids.values() for pid in job_pids]
        STARTED_PIDS.extend(pids)
        addresses = [a for job in ("worker", "ps") for a in cluster.addresses[job]]
        assert all(map(accepts, addresses))
        # What the notice printed at start warns about: "localhost" in the
        # cluster spec, yet every interface.
        ports = [_port(a) for job in cluster.addresses.values() for a in job]
        notice = capsys.readouterr().out
        assert "listen on all network interfaces, without authentication" in notice
        assert f"port(s) {', '.join(map(str, ports))}:" in notice, notice
        for address in addresses:
            assert set(listening(_port(address))) & {"0.0.0.0", "::"}, address

        worker_1 = cluster.pids["worker"][1]
        cluster.kill_worker(1)
        assert not alive(worker_1)
        ps_0 = cluster.pids["ps"][0]
        cluster.kill_ps(0)
        assert not alive(ps_0)
        with pytest.raises(IndexError, match="No worker 2"):
            cluster.kill_worker(2)
        assert accepts(cluster.addresses["worker"][0])
    cluster.stop()  # Again: stopping is idempotent.
    # No server runs: SIGTERM takes its default course again (a later fit's
    # BackupAndRestore would otherwise put the cluster's handler back).
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    for pid in pids:
        assert not alive(pid)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # Reaped: no zombie left.
    assert all(port_is_free(_port(address)) for address in addresses)
    assert not [a for a in addresses if listening(_port(a))]


def _with_fake_server(monkeypatch, tmp_path, source):
    """Makes processes-mode clusters run `source` instead of a real server."""
    script = tmp_path / "fake_server.py"
    script.write_text(source)
    monkeypatch.setattr(cluster_module, "_SERVER_SCRIPT", str(script))


def test_start_timeout_names_the_silent_address(monkeypatch, tmp_path):
    _with_fake_server(monkeypatch, tmp_path, "import time\ntime.sleep(60)\n")
    cluster = LocalCluster(num_workers=1, mode="processes", start_timeout=1)
    with pytest.raises(TimeoutError) as raised:
        cluster.start()
    pids = cluster.pids["worker"] + cluster.pids["ps"]
    STARTED_PIDS.extend(pids)
    message = str(raised.value)
    assert all(
        a in message for a in cluster.addresses["worker"] + cluster.addresses["ps"]
    )
    assert "within 1 s" in message
    assert not any(map(alive, pids))  # start() cleaned up after itself.


def test_server_that_cannot_bind_is_reported_with_its_output(monkeypatch, tmp_path):
    _with_fake_server(
        monkeypatch,
        tmp_path,
        "import sys\nprint('UNKNOWN: Could not start gRPC server')\nsys.exit(1)\n",
    )
    cluster = LocalCluster(num_workers=1, mode="processes", start_timeout=30)
    with pytest.raises(
        RuntimeError,
        match="(?s)exited with code 1.*took its port.*" "Could not start gRPC server",
    ):
        cluster.start()
    STARTED_PIDS.extend(cluster.pids["worker"] + cluster.pids["ps"])


def test_foreign_listener_on_a_servers_port_is_not_taken_for_it(monkeypatch):
    # Another process already listens where our worker must bind (ports
    # are chosen before the servers start, so another cluster can take
    # one): our worker fails to bind, and start() must say so rather than
    # connect the coordinator to the stranger that answers.
    with socket.create_server(("localhost", 0)) as stranger:
        taken = stranger.getsockname()[1]
        monkeypatch.setattr(
            cluster_module, "free_ports", lambda count: [taken] + free_ports(count - 1)
        )
        cluster = LocalCluster(num_workers=1, mode="processes", start_timeout=120)
        assert cluster.addresses["worker"] == [f"localhost:{taken}"]
        with pytest.raises(
            RuntimeError, match="(?s)worker 0 server.*took its port.*gRPC server"
        ):
            cluster.start()
        STARTED_PIDS.extend(cluster.pids["worker"] + cluster.pids["ps"])


_SCRIPT = """
import json, time
from tf_agn.strategies import LocalCluster

with LocalCluster(num_workers=1, num_ps=1, mode="processes") as cluster:
    print(json.dumps({"pids": cluster.pids, "addresses": cluster.addresses}))
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "signum",
    [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGKILL],
    ids=["SIGINT", "SIGKILL"],
)
def test_interrupted_or_killed_parent_leaves_no_server(tmp_path, signum):
    script = tmp_path / "cluster_script.py"
    script.write_text(_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script)],
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_sigint,
    )
    watchdog = threading.Timer(150, process.kill)
    watchdog.start()
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.strip() == "ready":
                break
        assert lines and lines[-1].strip() == "ready", "".join(lines)
        started = json.loads(lines[-2])
        pids = [pid for job_pids in started["pids"].values() for pid in job_pids]
        STARTED_PIDS.extend(pids)
        process.send_signal(signum)
        process.wait(timeout=60)
    finally:
        watchdog.cancel()
        process.kill()
        process.wait()

    # After SIGINT, `__exit__` kills the servers; after SIGKILL, each
    # server notices that its parent is gone within about a second.
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)]
    addresses = [a for job in ("worker", "ps") for a in started["addresses"][job]]
    assert all(port_is_free(_port(address)) for address in addresses)
    assert not [a for a in addresses if listening(_port(a))]
