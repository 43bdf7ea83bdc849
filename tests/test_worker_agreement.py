"""Workers that cannot agree fail, on every worker and in bounded time,
with an error that says why; none hangs.

Each test starts real worker processes (tests/settings_worker.py) on
localhost ports with their own `TF_CONFIG`: workers built with different
`bytes_per_pack`, a worker whose peer never comes, Ctrl-C and SIGTERM while
it waits, and SIGTERM once the strategy exists (TensorFlow's coordination
service catches SIGTERM; tf_agn puts Python's handler back).
"""

import os
import signal
import subprocess
import sys
import time

import keras
import pytest
import tensorflow as tf

import tf_agn
from cluster_checks import default_sigint
from tf_agn.collectives import agreement
from tf_agn.strategies import rendezvous
from tf_agn.strategies.ports import free_ports
from worker_cluster import worker_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "settings_worker.py")
MIB = 2**20


class Workers:
    """Worker processes of one localhost cluster, all killed on exit."""

    def __init__(self, num_workers, start=None):
        ports = free_ports(num_workers)
        self.cluster = {"worker": [f"localhost:{port}" for port in ports]}
        self.processes = {}
        self.start = range(num_workers) if start is None else start

    def __enter__(self):
        return self

    def launch(self, settings):
        """Starts each worker in `self.start` with its (bytes_per_pack,
        connect_timeout, then) from `settings`."""
        for index in self.start:
            self.processes[index] = subprocess.Popen(
                [sys.executable, WORKER, *map(str, settings[index])],
                env=worker_env(self.cluster, index),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                preexec_fn=default_sigint,
            )

    def wait_for_line(self, index, prefix, timeout=120):
        """Reads worker `index`'s output until a line starts with `prefix`."""
        deadline = time.monotonic() + timeout
        process = self.processes[index]
        lines = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(prefix):
                return line.strip()
        pytest.fail(f"worker {index} never printed {prefix!r}:\n{''.join(lines)[-3000:]}")

    def finish(self, index, timeout):
        """Worker `index`'s exit code and the rest of its output."""
        out, _ = self.processes[index].communicate(timeout=timeout)
        return self.processes[index].returncode, out

    def __exit__(self, *exc_info):
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_workers_with_different_bytes_per_pack_both_fail_naming_it():
    with Workers(2) as workers:
        workers.launch([(4 * MIB, 120, "exit"), (1 * MIB, 120, "exit")])
        started = time.monotonic()
        for index in range(2):
            line = workers.wait_for_line(index, "error")
            assert line == (
                "error ValueError: Workers disagree on bytes_per_pack: worker 0 "
                f"has {4 * MIB}, worker 1 has {MIB}. Every worker must build its "
                "strategy with the same settings (the same program and tf_agn "
                "release on each)."
            )
            code, _ = workers.finish(index, timeout=30)
            assert code == 1
        assert time.monotonic() - started < 90


def test_a_missing_peer_is_named_after_the_connect_timeout():
    with Workers(2, start=[0]) as workers:
        workers.launch({0: (4 * MIB, 5, "exit")})
        workers.wait_for_line(0, "creating")
        started = time.monotonic()
        line = workers.wait_for_line(0, "error")
        waited = time.monotonic() - started
        peer = workers.cluster["worker"][1]
        assert line.startswith(f"error TimeoutError: No answer within 5.0 s from worker 1 ({peer}).")
        assert 4 < waited < 30
        assert workers.finish(0, timeout=30)[0] == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_waiting_for_a_peer_stops_on_a_signal(signum):
    with Workers(2, start=[0]) as workers:
        workers.launch({0: (4 * MIB, 600, "exit")})
        workers.wait_for_line(0, "creating")
        time.sleep(2)  # well inside the wait
        workers.processes[0].send_signal(signum)
        code, out = workers.finish(0, timeout=15)
        if signum == signal.SIGINT:
            # Python ends an uncaught KeyboardInterrupt by the signal itself.
            assert code == -signal.SIGINT and "KeyboardInterrupt" in out, out
        else:
            assert code == -signal.SIGTERM, out


def test_sigterm_stops_a_worker_once_its_strategy_exists():
    with Workers(2) as workers:
        workers.launch([(4 * MIB, 120, "wait"), (4 * MIB, 120, "wait")])
        for index in range(2):
            assert workers.wait_for_line(index, "reduced") == "reduced 3.0"
        for index in range(2):
            workers.processes[index].send_signal(signal.SIGTERM)
        for index in range(2):
            code, out = workers.finish(index, timeout=15)
            assert code == -signal.SIGTERM, out


def codes(settings):
    return [setting.code for setting in settings]


def test_disagreement_names_the_first_differing_field_and_every_value():
    ops = tf_agn.AggregatingAllReduce(transport="collective", num_workers=3, worker_index=0)
    other = tf_agn.AggregatingAllReduce(
        transport="collective", num_workers=3, worker_index=1, compression="fp16"
    )
    devices = ["/device:CPU:0"]
    settings = agreement.strategy_settings(ops, devices)
    same = codes(settings)
    assert agreement.disagreement(settings, [same, same, same]) is None
    differs = codes(agreement.strategy_settings(other, devices))
    message = agreement.disagreement(settings, [same, differs, same])
    assert message.startswith(
        "Workers disagree on compression: worker 0 has None, worker 1 has "
        "'fp16', worker 2 has None."
    )
    assert agreement._version_text(agreement._version_code("1.23.4")) == "1.23.4"


def settings_of(compression=None, accumulation=None, units=4, sparse=None):
    """The settings of an optimizer training a Dense(units) layer's kernel
    and bias, as a worker would compare them."""
    variables = [tf.Variable(tf.zeros((8, units))), tf.Variable(tf.zeros((units,)))]
    return agreement.optimizer_settings(
        tf_agn.AggregationMethod.MEAN,
        tf_agn.compression.get(compression),
        ("gradient_accumulation_steps", accumulation),
        variables,
        sparse,
    )


@pytest.mark.parametrize(
    "differs, named, shown",
    [
        ({"compression": "int8"}, "compression", "worker 1 has 'int8'"),
        (
            {"compression": tf_agn.compression.PowerSGD(rank=2)},
            "compression settings",
            "worker 1 has code",
        ),
        ({"accumulation": 4}, "gradient_accumulation_steps", "worker 1 has 4"),
        ({"units": 5}, "trainable variable shapes and dtypes", "worker 1 has code"),
        ({"sparse": [True, False]}, "variables with sparse gradients", "worker 1 has code"),
    ],
    ids=["compressor", "its_rank", "accumulation", "shapes", "sparse_gradients"],
)
def test_optimizer_disagreement_names_what_differs(differs, named, shown):
    settings = settings_of(compression=tf_agn.compression.PowerSGD(rank=1))
    first = codes(settings)
    again = codes(settings_of(compression=tf_agn.compression.PowerSGD(rank=1)))
    assert agreement.disagreement(settings, [first, again]) is None
    other = {"compression": tf_agn.compression.PowerSGD(rank=1), **differs}
    message = agreement.disagreement(
        settings, [first, codes(settings_of(**other))], "optimizer and model"
    )
    assert message.startswith(f"Workers disagree on {named}: worker 0 has ")
    assert shown in message
    assert "must build its optimizer and model with the same settings" in message


def test_a_streaming_diloco_schedule_disagreement_is_named():
    def settings(sync_delay):
        optimizer = tf_agn.optimizers.StreamingDiLoCo(
            keras.optimizers.SGD(), local_steps=6, num_fragments=2, sync_delay=sync_delay
        )
        return agreement.optimizer_settings(
            tf_agn.AggregationMethod.MEAN, None, ("local_steps", 6), [],
            schedule=optimizer._commit_schedule(),
        )

    message = agreement.disagreement(
        settings(1), [codes(settings(1)), codes(settings(2))], "optimizer and model"
    )
    assert message.startswith("Workers disagree on sync_delay: worker 0 has 1, worker 1 has 2.")


def test_workers_compressing_differently_both_fail_naming_it():
    with Workers(2) as workers:
        workers.launch([(4 * MIB, 120, "fit:int8"), (4 * MIB, 120, "fit:powersgd:1")])
        for index in range(2):
            line = workers.wait_for_line(index, "error")
            assert line == (
                "error ValueError: Workers disagree on compression: worker 0 "
                "has 'int8', worker 1 has 'powersgd'. Every worker must build "
                "its optimizer and model with the same settings (the same "
                "program and tf_agn release on each)."
            )
            code, _ = workers.finish(index, timeout=30)
            assert code == 1


def test_workers_compressing_alike_train():
    with Workers(2) as workers:
        workers.launch([(4 * MIB, 120, "fit:powersgd:1")] * 2)
        for index in range(2):
            assert workers.wait_for_line(index, "trained") == "trained"
            assert workers.finish(index, timeout=30)[0] == 0


def test_peers_are_every_other_chief_and_worker():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(
            {"chief": ["a:1"], "worker": ["b:2", "c:3"], "ps": ["d:4"]}
        ),
        task_type="worker",
        task_id=1,
    )
    peers, own = rendezvous.peers_of(resolver)
    assert peers == [("chief 0", "a:1"), ("worker 0", "b:2")]
    assert own == "c:3"
