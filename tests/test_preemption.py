"""Preemption notices (`tf_agn.callbacks.BackupAndRestore(preemption_notice=...)`):
a notice stops `fit` after one step, backed up there, with exit code 75; the
resumed run trains no step twice and ends bitwise where an uninterrupted one
does. Here on 4 logical CPU replicas in this process; across worker
processes in tests/test_preemption_cluster.py."""

import os
import re
import signal
import sys

import keras
import numpy as np
import pytest

import restart_model
import tf_agn
from conftest import DEVICES
from scripts import cluster_env
from scripts import launch

# Here the two whose state is most per replica; the cluster test runs them
# all.
OPTIMIZERS = {
    name: restart_model.OPTIMIZERS[name] for name in ("agn", "accumulation")
}
# 4 steps an epoch: the notice comes during step 10 (epoch 2, batch 1).
NOTICE_EPOCH, NOTICE_BATCH = 2, 1
NOTICE_STEP = NOTICE_EPOCH * 4 + NOTICE_BATCH + 1


class Notify(keras.callbacks.Callback):
    """Calls `notify()` as batch `batch` of epoch `epoch` begins."""

    def __init__(self, notify, epoch=NOTICE_EPOCH, batch=NOTICE_BATCH):
        super().__init__()
        self.notify, self.at = notify, (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            self.notify()


def _fit(model, callbacks=()):
    x, y = restart_model.data()
    return model.fit(x, y, batch_size=restart_model.GLOBAL_BATCH, epochs=restart_model.EPOCHS,
                     shuffle=False, verbose=0, callbacks=list(callbacks))


def _strategy():
    return tf_agn.strategies.mirrored(DEVICES)


def _assert_bitwise(model, reference):
    got, want = restart_model.training_state(model), restart_model.training_state(reference)
    for replica, (g, w) in enumerate(zip(got, want, strict=True)):
        for index, (a, b) in enumerate(zip(g, w, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"replica {replica}, variable {index}")


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sigterm_backs_up_after_the_step_and_the_resumed_run_is_bitwise(tmp_path, optimizer):
    make = OPTIMIZERS[optimizer]
    reference = restart_model.build_model(_strategy(), make)
    _fit(reference)
    before = signal.getsignal(signal.SIGTERM)
    backup_dir = str(tmp_path / "backup")
    preempted = restart_model.build_model(_strategy(), make)
    with pytest.raises(tf_agn.callbacks.Preempted) as raised:
        _fit(preempted, [tf_agn.callbacks.BackupAndRestore(backup_dir),  # save_freq "epoch"
                         Notify(lambda: os.kill(os.getpid(), signal.SIGTERM))])
    assert raised.value.code == tf_agn.callbacks.PREEMPTED_EXIT_CODE == 75
    assert raised.value.step == NOTICE_STEP  # steps of this fit, which began at 0
    # The step in progress finished, and nothing after it ran.
    assert int(preempted.optimizer.iterations.numpy()) == _applied(optimizer, NOTICE_STEP)
    # The handler is put back: SIGTERM has its course from before fit again.
    assert signal.getsignal(signal.SIGTERM) is before

    resumed = restart_model.build_model(_strategy(), make)
    starts = _RecordIterations()
    _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir), starts])
    assert starts.at_begin == _applied(optimizer, NOTICE_STEP)  # no step trained twice
    _assert_bitwise(resumed, reference)


def _applied(optimizer, steps):
    """The optimizer's `iterations` after `steps` steps: with accumulation,
    one per 3."""
    return steps // 3 if optimizer == "accumulation" else steps


class _RecordIterations(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.at_begin = int(self.model.optimizer.iterations.numpy())


@pytest.mark.parametrize("kind", ["callable", "path"])
def test_a_callable_or_a_file_is_a_notice(tmp_path, kind):
    noticed = []
    marker = tmp_path / "notice"
    if kind == "callable":
        notice, notify = (lambda: bool(noticed)), (lambda: noticed.append(1))
    else:
        notice, notify = str(marker), marker.touch
    model = restart_model.build_model(_strategy(), restart_model.OPTIMIZERS["adam"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tf_agn.callbacks.Preempted):
        _fit(model, [tf_agn.callbacks.BackupAndRestore(tmp_path / "b", preemption_notice=notice),
                     Notify(notify)])
    assert int(model.optimizer.iterations.numpy()) == NOTICE_STEP
    # A notice of another kind leaves SIGTERM alone.
    assert signal.getsignal(signal.SIGTERM) is before


def test_without_a_notice_fit_ends_and_a_late_signal_takes_its_old_course(tmp_path):
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *args: received.append(args[0]))
    try:
        model = restart_model.build_model(_strategy(), restart_model.OPTIMIZERS["adam"])
        # After the last step: fit ends, then the handler from before runs.
        callback = tf_agn.callbacks.BackupAndRestore(tmp_path / "b",
                                                     preemption_notice=signal.SIGUSR1)
        late = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: epoch == restart_model.EPOCHS - 1
            and os.kill(os.getpid(), signal.SIGUSR1)
        )
        _fit(model, [callback, late])
        assert int(model.optimizer.iterations.numpy()) == 4 * restart_model.EPOCHS
        assert received == [signal.SIGUSR1]
        assert not (tmp_path / "b").exists()  # the run was whole
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_fit_that_raises_gives_the_signal_back(tmp_path):
    """on_train_end never runs: a signal after fit left takes the old
    handler's course, and the next fit's notice starts from that handler."""
    received = []

    def handler(signum, frame):
        received.append(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        model = restart_model.build_model(_strategy(), restart_model.OPTIMIZERS["adam"])

        def interrupt():
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            _fit(model, [tf_agn.callbacks.BackupAndRestore(
                tmp_path / "b", preemption_notice=signal.SIGUSR1), Notify(interrupt)])
        os.kill(os.getpid(), signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is handler
        with pytest.raises(KeyboardInterrupt):
            _fit(model, [tf_agn.callbacks.BackupAndRestore(
                tmp_path / "c", preemption_notice=signal.SIGUSR1), Notify(interrupt)])
        # The next fit's notice stops the one left behind, which puts back
        # the handler from before; a whole fit then leaves that in place.
        _fit(restart_model.build_model(_strategy(), restart_model.OPTIMIZERS["adam"]),
             [tf_agn.callbacks.BackupAndRestore(tmp_path / "e", preemption_notice=signal.SIGUSR1)])
        assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("notice", [3.5, "", ["a"], 0, True, 10**6, "sigterm"])
def test_a_bad_notice_is_refused_naming_it(tmp_path, notice):
    want = {
        "": "empty path",
        "sigterm": re.escape("preemption_notice 'sigterm' names a signal: pass signal.SIGTERM"),
    }.get(notice) if isinstance(notice, str) else None
    want = want or f"preemption_notice must .*received {re.escape(repr(notice))}"
    with pytest.raises(ValueError, match=want):
        tf_agn.callbacks.BackupAndRestore(tmp_path, preemption_notice=notice)


def test_the_notice_round_trips_through_the_config(tmp_path):
    callback = tf_agn.callbacks.BackupAndRestore(tmp_path, preemption_notice=signal.SIGUSR2)
    config = callback.get_config()
    assert config["preemption_notice"] == signal.SIGUSR2
    assert tf_agn.callbacks.BackupAndRestore(**config).get_config() == config
    assert tf_agn.callbacks.BackupAndRestore(tmp_path).preemption_notice == signal.SIGTERM


# In real processes ------------------------------------------------------------
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_worker.py")


def _results(workdir, suffix):
    got = []
    for index in range(2):
        with np.load(workdir / f"result{suffix}-worker-{index}.npz") as npz:
            got.append([npz[str(i)] for i in range(len(npz.files))])
    return got


def _begins(workdir, optimizer):
    return [
        [int(line) for line in (workdir / f"begin-{optimizer}-worker-{i}.txt").read_text().split()]
        for i in range(2)
    ]


@pytest.mark.parametrize("optimizers", [
    ["agn"],
    # Plain Adam holds no state of its own per replica, and accumulation is
    # bitwise across a notice in one process (above).
    pytest.param(["adam_sharded", "int8"], marks=pytest.mark.slow),
], ids=["windowed", "sharded-int8"])
def test_a_sigterm_to_one_worker_stops_both_after_one_step_and_loses_none(tmp_path, optimizers):
    """Worker 1 gets SIGTERM as step 10 of each optimizer's fit begins (the
    launcher restarts both after each notice, uncounted: --max_restarts
    0); both back up after the same step, and each run ends bitwise where
    the uninterrupted one does, every step trained once."""
    code, output = launch(
        ["--multi_worker", "2"],
        [sys.executable, WORKER_SCRIPT, str(tmp_path), "--optimizer", ",".join(optimizers),
         "--kill_worker", "1", "--kill_signal", "SIGTERM",
         f"--kill_epoch={NOTICE_EPOCH}", f"--kill_batch={NOTICE_BATCH}"],
        cluster_env(), timeout=300 * len(optimizers),
    )
    assert code == 0, output
    assert output.count("restarting every worker (not counted as a failure)") == len(optimizers)
    for optimizer in optimizers:
        reference = restart_model.build_model(
            tf_agn.strategies.mirrored(DEVICES[:2]), restart_model.OPTIMIZERS[optimizer]
        )
        _fit(reference)
        suffix = f"-{optimizer}" if len(optimizers) > 1 else ""
        got = _results(tmp_path, suffix)
        want = restart_model.training_state(reference)
        for replica, (g, w) in enumerate(zip(got, want, strict=True)):
            for index, (a, b) in enumerate(zip(g, w, strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"{optimizer} worker {replica} #{index}")
        # The first attempt began at 0, the second after step 11: worker 1,
        # noticed after step 10, proposed the next step, which no peer can
        # have finished before it agreed.
        assert _begins(tmp_path, optimizer) == [[0, _applied(optimizer, NOTICE_STEP + 1)]] * 2
