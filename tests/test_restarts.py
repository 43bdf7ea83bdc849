"""Restarts that lose nothing: `tf_agn.callbacks.BackupAndRestore` and the
launcher's `--max_restarts`.

In this process (4 logical CPUs, conftest): an interrupted `fit` resumed by
a fresh model from the backup ends exactly where an uninterrupted one does,
on every replica, with AGN's per-replica inner Adam moments mid-window;
the files on disk follow the write protocol. In real processes: the
launcher restarts a failing group, and a 2-worker cluster whose worker 1
SIGKILLs itself mid-epoch resumes and ends with the uninterrupted run's
weights.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import restart_model
import tf_agn
from cluster_checks import default_sigint
from conftest import DEVICES
from scripts import cluster_env
from scripts import launch
from tf_agn.optimizers import saving
from tf_agn.resuming import resizing
from tf_agn.resuming.backup_and_restore import POINTER
from tf_agn.strategies import launch as launcher
from tf_agn.strategies import membership
from tf_agn.strategies import ports
from worker_cluster import worker_env

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_worker.py")
# The kill in restart_worker.py: before batch 3 of epoch 2 (0-based), so
# with save_freq 2 the last backup is at epoch 2, step 2: one step redone.
KILL_EPOCH, KILL_BATCH = 2, 3


class Interrupt(keras.callbacks.Callback):
    """Raises KeyboardInterrupt before batch `batch` of epoch `epoch`, as a
    Ctrl-C would."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.stop_at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.stop_at:
            raise KeyboardInterrupt(f"interrupted before epoch {self.epoch} batch {batch}")


def _fit(model, callbacks=(), epochs=restart_model.EPOCHS):
    x, y = restart_model.data()
    return model.fit(
        x, y, batch_size=restart_model.GLOBAL_BATCH, epochs=epochs, shuffle=False,
        verbose=0, callbacks=list(callbacks),
    )


def _interrupted_fit(model, backup_dir, epoch, batch, **backup_kwargs):
    with pytest.raises(KeyboardInterrupt):
        _fit(model, [tf_agn.callbacks.BackupAndRestore(backup_dir, **backup_kwargs),
                     Interrupt(epoch, batch)])


def _pointer(backup_dir):
    with open(os.path.join(backup_dir, POINTER)) as f:
        return json.load(f)


def _assert_states_equal(got, want, atol):
    assert len(got) == len(want)  # replicas
    for replica, (got_arrays, want_arrays) in enumerate(zip(got, want)):
        for index, (g, w) in enumerate(zip(got_arrays, want_arrays, strict=True)):
            np.testing.assert_allclose(
                g, w, rtol=0, atol=atol, err_msg=f"replica {replica}, variable {index}"
            )


# In this process ----------------------------------------------------------


def test_resumed_agn_run_equals_an_uninterrupted_one_on_every_replica(tmp_path):
    strategy = tf_agn.strategies.mirrored()
    reference = restart_model.build_model(strategy)
    reference_history = _fit(reference)
    want = restart_model.training_state(reference)
    # Otherwise restoring replica 0's copy everywhere (what a .keras file
    # holds) would pass too: the inner Adam moments differ per replica.
    variables = reference.variables + reference.optimizer.variables
    moments = [i for i, v in enumerate(variables) if v.path.endswith("momentum")]
    assert len(moments) == 4
    for i in moments:
        assert not np.allclose(want[1][i], want[0][i], rtol=0.1, atol=0), variables[i].path

    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(restart_model.build_model(strategy), backup_dir, 2, 3, save_freq=2)
    # 4 steps per epoch; backups every 2 steps; stopped after 3 of epoch 2.
    pointer = _pointer(backup_dir)
    assert (pointer["epoch"], pointer["step"]) == (2, 2), pointer
    global_step = 2 * 4 + 2
    assert global_step % restart_model.LOCAL_STEPS, "the backup must fall mid-window"
    with np.load(os.path.join(backup_dir, f"ckpt-{pointer['checkpoint']}.worker-0.npz")) as npz:
        assert any(key.endswith("/3") for key in npz.files), "no per-replica copy saved"

    resumed = restart_model.build_model(strategy)  # fresh weights and optimizer
    history = _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=2)])
    _assert_states_equal(restart_model.training_state(resumed), want, atol=1e-6)
    # Epochs 2 to 4 ran; the interrupted epoch's loss covers all its batches.
    np.testing.assert_allclose(
        history.history["loss"], reference_history.history["loss"][2:], rtol=1e-6
    )
    assert not os.path.exists(backup_dir)  # delete_checkpoint=True


def test_a_streaming_diloco_exchange_in_flight_resumes_exactly(tmp_path):
    # H = 6, F = 2, τ = 2: the second fragment's first combined Δ is sent
    # in step 5 and lands after step 6; the backup after step 5 holds it.
    streaming = restart_model.OPTIMIZERS["streaming_diloco"]
    strategy = tf_agn.strategies.mirrored()
    reference = restart_model.build_model(strategy, streaming)
    _fit(reference)
    interrupted = restart_model.build_model(strategy, streaming)
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(interrupted, backup_dir, 1, 1, save_freq=1)
    assert (_pointer(backup_dir)["epoch"], _pointer(backup_dir)["step"]) == (1, 1)
    outer_gradients = [v for v in interrupted.optimizer.variables if "outer_gradient" in v.path]
    # The second layer's, zeros until its first exchange.
    assert all(np.any(v.numpy()) for v in outer_gradients[2:])

    resumed = restart_model.build_model(strategy, streaming)  # fresh weights and optimizer
    _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=1)])
    _assert_states_equal(
        restart_model.training_state(resumed),
        restart_model.training_state(reference),
        atol=1e-6,
    )


def test_resume_without_a_strategy_and_several_steps_per_execution(tmp_path):
    strategy = tf.distribute.get_strategy()
    reference = restart_model.build_model(strategy, steps_per_execution=2)
    _fit(reference)
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(
        restart_model.build_model(strategy, steps_per_execution=2), backup_dir, 3, 2,
        save_freq=2,
    )
    assert (_pointer(backup_dir)["epoch"], _pointer(backup_dir)["step"]) == (3, 2)
    resumed = restart_model.build_model(strategy, steps_per_execution=2)
    history = _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=2)])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4
    _assert_states_equal(
        restart_model.training_state(resumed),
        restart_model.training_state(reference),
        atol=1e-6,
    )


def test_a_changed_global_batch_warns_and_resumes_at_the_same_share_of_the_epoch(tmp_path):
    strategy = tf.distribute.get_strategy()
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(restart_model.build_model(strategy), backup_dir, 1, 3, save_freq=1)
    assert _pointer(backup_dir)["steps_per_epoch"] == 4
    assert (_pointer(backup_dir)["epoch"], _pointer(backup_dir)["step"]) == (1, 3)
    resumed = restart_model.build_model(strategy)
    x, y = restart_model.data()
    with pytest.warns(UserWarning, match=r"run of 4 steps per epoch with 2: the global batch is "
                      r"about 2 times .* resumes at step 1 \(was 3\)"):
        resumed.fit(x, y, batch_size=2 * restart_model.GLOBAL_BATCH, epochs=restart_model.EPOCHS,
                    shuffle=False, verbose=0,
                    callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=1)])
    # 7 steps of 16 rows before the backup, then 1 step of 32 rows to finish
    # epoch 1 and 2 in each of the 3 epochs left.
    assert int(resumed.optimizer.iterations.numpy()) == 7 + 1 + 2 * (restart_model.EPOCHS - 2)


def test_epoch_backups_resume_at_the_next_epoch_and_fit_leaves_no_state(tmp_path):
    strategy = tf.distribute.get_strategy()
    reference = restart_model.build_model(strategy)
    _fit(reference)
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(restart_model.build_model(strategy), backup_dir, 3, 1)
    assert _pointer(backup_dir)["epoch"] == 3 and _pointer(backup_dir)["step"] == 0
    resumed = restart_model.build_model(strategy)
    callback = tf_agn.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    history = _fit(resumed, [callback])
    assert len(history.history["loss"]) == 2
    _assert_states_equal(
        restart_model.training_state(resumed),
        restart_model.training_state(reference),
        atol=1e-6,
    )
    # The next fit of the same model, without the callback, starts at epoch 0.
    assert len(_fit(resumed, epochs=1).history["loss"]) == 1


def test_only_complete_published_backups_are_restored(tmp_path):
    strategy = tf.distribute.get_strategy()
    backup_dir = tmp_path / "backup"
    _interrupted_fit(
        restart_model.build_model(strategy), str(backup_dir), 1, 3, save_freq=1,
        delete_checkpoint=False,
    )
    pointer = _pointer(backup_dir)
    last = pointer["checkpoint"]
    assert (pointer["epoch"], pointer["step"], last) == (1, 3, 6)
    # The previous backup stays until the next is published; no temporaries.
    assert sorted(os.listdir(backup_dir)) == [
        f"ckpt-{last - 1}.worker-0.npz", f"ckpt-{last}.worker-0.npz", POINTER,
    ]
    # A process that died after writing the next backup's file, or in the
    # middle of it, before the pointer moved: neither is read.
    (backup_dir / f"ckpt-{last + 1}.worker-0.npz").write_bytes(b"never published")
    (backup_dir / f"ckpt-{last + 2}.worker-0.npz.tmp").write_bytes(b"half writt")
    model = restart_model.build_model(strategy)
    history = _fit(
        model, [tf_agn.callbacks.BackupAndRestore(str(backup_dir), save_freq=1,
                                                  delete_checkpoint=False)]
    )
    assert len(history.history["loss"]) == restart_model.EPOCHS - 1
    assert not any(name.endswith(".tmp") for name in os.listdir(backup_dir))
    # Without a pointer there is nothing to restore, whatever files remain.
    os.remove(backup_dir / POINTER)
    history = _fit(
        restart_model.build_model(strategy),
        [tf_agn.callbacks.BackupAndRestore(str(backup_dir), save_freq=1)],
    )
    assert len(history.history["loss"]) == restart_model.EPOCHS
    assert not backup_dir.exists()


def test_a_backup_of_another_model_is_refused(tmp_path):
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(restart_model.build_model(tf.distribute.get_strategy()), backup_dir, 1, 0)
    other = keras.Sequential([keras.Input((restart_model.FEATURES,)), keras.layers.Dense(3)])
    other.compile(optimizer="adam", loss="mse")
    x, y = restart_model.data()
    with pytest.raises(ValueError, match="another model"):
        other.fit(x, y, epochs=1, verbose=0,
                  callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir)])


class _RecordStart(keras.callbacks.Callback):
    """Records, once `fit` begins, replica 0's weights and the optimizer's
    step count."""

    def on_train_begin(self, logs=None):
        self.weights = [np.array(w) for w in self.model.get_weights()]
        self.iterations = int(self.model.optimizer.iterations.numpy())
        self.state = tf_agn.replica_weights(self.model.optimizer.variables)


def test_a_windowed_backup_resumes_from_its_last_commit_on_another_shape(tmp_path):
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(
        restart_model.build_model(tf_agn.strategies.mirrored()), backup_dir, 2, 3, save_freq=2
    )
    pointer = _pointer(backup_dir)
    with np.load(os.path.join(backup_dir, f"ckpt-{pointer['checkpoint']}.worker-0.npz")) as npz:
        saved = dict(npz)
    # Mid-window: the replicas' weights differ; the centers are alike.
    assert not np.array_equal(saved["state/0/0"], saved["state/0/1"])
    model = restart_model.build_model(tf_agn.strategies.mirrored(DEVICES[:2]))
    record = _RecordStart()
    history = _fit(model, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=2), record])
    centers = [
        len(model.variables) + i for i, v in enumerate(model.optimizer.variables)
        if v.path.endswith("center")
    ]
    assert len(centers) == len(record.weights)
    for weight, position in zip(record.weights, centers):
        np.testing.assert_array_equal(weight, saved[f"state/{position}/0"])
    # Step 10 of the window from step 9 was dropped: a new window begins.
    assert record.iterations == 9 and record.iterations % restart_model.LOCAL_STEPS == 0
    # The inner Adam's moments, per replica: the old replicas' mean.
    moments = [i for i, v in enumerate(model.optimizer.variables) if v.path.endswith("momentum")]
    assert len(moments) == 4
    for i in moments:
        key = f"state/{len(model.variables) + i}"
        old = [saved.get(f"{key}/{r}", saved[f"{key}/0"]) for r in range(4)]
        for replica in record.state:
            np.testing.assert_allclose(replica[i], np.mean(old, axis=0), rtol=1e-6, atol=1e-8)
    assert np.isfinite(history.history["loss"]).all()


def _adam(shard=False, **kwargs):
    # restart_model.OPTIMIZERS's, with more arguments.
    return lambda: tf_agn.optimizers.Adam(0.05, shard_optimizer_state=shard, **kwargs)


class _RecordState(keras.callbacks.Callback):
    """Records, once `fit` begins, what each local replica owes under
    error feedback, per compressed variable."""

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        compressor, states = self.model.optimizer.compressor_state()
        self.positions = [
            {key: _position(self.model, v) for key, v in state.items()} for state in states
        ]
        self.owed = [
            [
                resizing.owed_by(compressor, dict(zip(state, replica)))
                for replica in zip(
                    *([c.numpy() for c in strategy.experimental_local_results(v.value)]
                      for v in state.values())
                )
            ]
            for state in states
        ]
        self.compressor = compressor


def _position(model, variable):
    """`variable`'s position among a backup's state variables."""
    return len(model.variables) + [id(v) for v in model.optimizer.variables].index(id(variable))


@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "sharded"])
@pytest.mark.parametrize("first, then", [(2, 4), (4, 2)])
def test_a_backup_resumes_on_another_number_of_replicas(tmp_path, first, then, shard):
    """MEAN with the global batch unchanged: the resumed run ends where an
    uninterrupted one does, the interrupted epoch's loss included."""
    reference = restart_model.build_model(tf_agn.strategies.mirrored(DEVICES[:then]), _adam())
    reference_history = _fit(reference)
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(
        restart_model.build_model(tf_agn.strategies.mirrored(DEVICES[:first]), _adam(shard)),
        backup_dir, 2, 3, save_freq=2,
    )
    resumed = restart_model.build_model(tf_agn.strategies.mirrored(DEVICES[:then]), _adam(shard))
    history = _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=2)])
    for got, want in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    saved = zip(saving.saved_values(resumed.optimizer), saving.saved_values(reference.optimizer))
    for got, want in saved:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        history.history["loss"], reference_history.history["loss"][2:], rtol=1e-4
    )


def _regression_model(strategy):
    """restart_model's MLP with a `Dense(1)` head, whose bias's part on
    every replica has the whole bias's shape, (1,)."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((restart_model.FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=_adam(shard=True)(), loss="mse")
    return model


@pytest.mark.parametrize("first, then", [(2, 4), (4, 2)])
def test_a_sharded_backup_of_a_dense_1_head_resumes_on_another_number_of_replicas(
    tmp_path, first, then
):
    reference = _regression_model(tf_agn.strategies.mirrored(DEVICES[:then]))
    _fit(reference)
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(
        _regression_model(tf_agn.strategies.mirrored(DEVICES[:first])), backup_dir, 2, 3,
        save_freq=2,
    )
    resumed = _regression_model(tf_agn.strategies.mirrored(DEVICES[:then]))
    _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=2)])
    for got, want in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    saved = zip(saving.saved_values(resumed.optimizer), saving.saved_values(reference.optimizer))
    for got, want in saved:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _Record(keras.callbacks.Callback):
    """Every replica's copy of `variables` as training begins (after an
    earlier callback's restore)."""

    def __init__(self, variables):
        super().__init__()
        self.variables, self.copies = variables, None

    def on_train_begin(self, logs=None):
        self.copies = tf_agn.replica_weights(self.variables)


def _batch_norm_model(strategy):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((restart_model.FEATURES,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=_adam()(), loss="mse")
    return model


def test_batch_norm_statistics_resume_as_replica_0s_on_another_number_of_replicas(tmp_path):
    """Keras keeps each replica's own moving statistics under
    MirroredStrategy and saves replica 0's; a resized resume takes those."""
    backup_dir = str(tmp_path / "backup")
    first = _batch_norm_model(tf_agn.strategies.mirrored(DEVICES[:4]))
    _fit(first, [tf_agn.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)], epochs=1)
    statistics = first.layers[1].non_trainable_variables
    backed_up = tf_agn.replica_weights(statistics)
    assert not np.array_equal(backed_up[0][0], backed_up[1][0])  # the replicas' own
    resumed = _batch_norm_model(tf_agn.strategies.mirrored(DEVICES[:2]))
    record = _Record(resumed.layers[1].non_trainable_variables + resumed.trainable_variables)
    _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir), record], epochs=1)
    want = backed_up[0] + [v.numpy() for v in first.trainable_variables]
    for replica in record.copies:
        for got, expected in zip(replica, want, strict=True):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("compression", ["int8", "powersgd", "int8_sharded"])
def test_a_resized_backup_keeps_the_sum_of_what_is_owed_and_warns_for_sum(tmp_path, compression):
    compressor = tf_agn.compression.PowerSGD(rank=1) if compression == "powersgd" else "int8"
    shard = compression == "int8_sharded"
    backup_dir = str(tmp_path / "backup")
    _interrupted_fit(
        restart_model.build_model(
            tf_agn.strategies.mirrored(DEVICES[:2]),
            _adam(shard, aggregation_method="sum", compression=compressor),
        ),
        backup_dir, 1, 2, save_freq=1,
    )
    pointer = _pointer(backup_dir)
    with np.load(os.path.join(backup_dir, f"ckpt-{pointer['checkpoint']}.worker-0.npz")) as npz:
        saved = dict(npz)
    resumed = restart_model.build_model(
        tf_agn.strategies.mirrored(DEVICES), _adam(shard, aggregation_method="sum", compression=compressor)
    )
    record = _RecordState()
    with pytest.warns(UserWarning, match="Multiply the learning rate by 2/4"):
        _fit(resumed, [tf_agn.callbacks.BackupAndRestore(backup_dir), record], epochs=2)
    assert len(record.owed) == (2 if compression == "powersgd" else 4)  # PowerSGD: matrices
    for positions, owed in zip(record.positions, record.owed):
        old = [
            {key: saved.get(f"state/{p}/{r}", saved[f"state/{p}/0"]) for key, p in positions.items()}
            for r in range(2)
        ]
        old_owed = [resizing.owed_by(record.compressor, state) for state in old]
        assert np.abs(old_owed[0] - old_owed[1]).max() > 0  # the replicas owe differently
        np.testing.assert_allclose(np.sum(owed, axis=0), np.sum(old_owed, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(owed[0], owed[3], rtol=1e-6)  # shared evenly


@pytest.mark.parametrize("save_freq", [0, -2, 1.5, True, "batch", None])
def test_bad_save_freq_is_refused(tmp_path, save_freq):
    with pytest.raises(ValueError, match='save_freq must be "epoch" or an int >= 1'):
        tf_agn.callbacks.BackupAndRestore(str(tmp_path), save_freq=save_freq)


def test_bad_backup_dir_is_refused_and_config_round_trips(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        tf_agn.callbacks.BackupAndRestore("")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OSError):
        tf_agn.callbacks.BackupAndRestore(str(a_file / "backup"))
    callback = tf_agn.callbacks.BackupAndRestore(tmp_path / "b", save_freq=7,
                                                 delete_checkpoint=False)
    config = callback.get_config()
    assert config == {"backup_dir": str(tmp_path / "b"), "save_freq": 7,
                      "delete_checkpoint": False, "preemption_notice": signal.SIGTERM,
                      "keep_last_steps": True}
    assert tf_agn.callbacks.BackupAndRestore(**config).get_config() == config


# In real processes ------------------------------------------------------------


# Attempt 1: worker 1 dies by SIGKILL; attempt 2: it exits with 7; attempt 3
# succeeds. Worker 1 fails only once every worker of its attempt has
# started, so that the test checks the launcher, not a race.
FAILS_TWICE = """
import json, os, pathlib, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index, workers = config["task"]["index"], len(config["cluster"]["worker"])
state = pathlib.Path(os.environ["STATE_DIR"])
attempt = len(list(state.glob(f"start-{index}-*"))) + 1
(state / f"start-{index}-{attempt}").touch()
print(f"worker {index} attempt {attempt}", flush=True)
if attempt == 3:
    sys.exit(0)
if index == 1:
    deadline = time.monotonic() + 30
    while not (state / f"start-0-{attempt}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(7)
time.sleep(600)
"""


def test_launch_restarts_every_worker_on_fresh_ports_until_one_run_succeeds(tmp_path):
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "2"],
        [sys.executable, "-c", FAILS_TWICE], cluster_env(STATE_DIR=str(tmp_path)),
    )
    assert code == 0, output
    assert "Worker slot 1 was killed by SIGKILL; restarting every worker (restart 1 of 2)." in output
    assert "Worker slot 1 exited with code 7; restarting every worker (restart 2 of 2)." in output
    clusters = re.findall(r"^Local multi-worker cluster: (.*)$", output, re.M)
    assert len(clusters) == 3 and len(set(clusters)) == 3, output
    assert "[worker 1] worker 1 attempt 3" in output and "worker 0 attempt 3" in output


def test_launch_gives_up_after_max_restarts_with_the_last_failures_code(tmp_path):
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "1"],
        [sys.executable, "-c", FAILS_TWICE], cluster_env(STATE_DIR=str(tmp_path)),
    )
    assert code == 7, output
    assert "restart 1 of 1" in output
    assert output.rstrip().endswith("Worker slot 1 exited with code 7; stopped every worker."), output
    assert "attempt 3" not in output


def test_launch_refuses_bad_max_restarts(capsys):
    for argv, error in (
        (["--multi_worker", "2", "--max_restarts", "-1"], "--max_restarts must be >= 0"),
        (["--max_restarts", "1"], "--max_restarts applies to --multi_worker clusters only"),
    ):
        with pytest.raises(SystemExit):
            launcher.parse_args([*argv, "--", "python"])
        assert error in capsys.readouterr().err
    options, _ = launcher.parse_args(["--multi_worker", "2", "--", "python"])
    assert options.max_restarts == 0


# Each worker leaves a file in STATE_DIR once started, and then sleeps.
STARTS_AND_SLEEPS = """
import json, os, pathlib, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
(pathlib.Path(os.environ["STATE_DIR"]) / f"started-{index}").touch()
time.sleep(600)
"""


def test_a_ctrl_c_launch_does_not_restart(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "2",
         "--max_restarts", "3", "--", sys.executable, "-c", STARTS_AND_SLEEPS],
        env=cluster_env(STATE_DIR=str(tmp_path)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=default_sigint,
    )
    try:
        # Files, not output lines: worker 0 writes its own output and the
        # launcher relays worker 1's, so their lines may interleave.
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read()
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 128 + signal.SIGINT
        output = process.stdout.read()
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert output.count("Local multi-worker cluster") == 1, output
    assert "restart" not in output, output


def _writes(workdir, task):
    """(event, file name) of every write `task` made in the backup
    directory, in order, over all attempts."""
    with open(workdir / f"writes-{task}.jsonl") as f:
        return [tuple(json.loads(line)) for line in f]


@pytest.mark.parametrize("kill_signal, how", [
    ("SIGKILL", "was killed by SIGKILL"),
    # A hung worker (a frozen host): the launcher kills it once its
    # heartbeat is 4 s old.
    pytest.param("SIGSTOP", "stopped sending heartbeats and was killed", marks=pytest.mark.slow),
])
def test_a_killed_worker_is_restarted_and_training_ends_as_if_uninterrupted(
    tmp_path, kill_signal, how
):
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "1", "--hang_timeout", "4"],
        [sys.executable, WORKER_SCRIPT, str(tmp_path), "--kill_worker", "1",
         f"--kill_epoch={KILL_EPOCH}", f"--kill_batch={KILL_BATCH}", "--kill_signal", kill_signal],
        cluster_env(),
    )
    assert code == 0, output
    assert f"Worker slot 1 {how}; restarting every worker (restart 1 of 1)." in output
    assert "[worker 1] worker-1 done" in output and "worker-0 done" in output, output
    # AGN's window: worker 1's local steps since the last commit died with it.
    assert ("BackupAndRestore: worker-1 lost its local steps in AGN's window; the "
            "survivors' rescue at epoch 2, step 3 cannot be used: resuming from the last "
            "backup.") in output, output

    # The uninterrupted run: the same model and data on 2 replicas here
    # (each worker's replica gets the same shard as replica i here).
    reference = restart_model.build_model(tf_agn.strategies.mirrored(DEVICES[:2]))
    _fit(reference)
    _assert_states_equal(_results(tmp_path), restart_model.training_state(reference), atol=1e-5)

    # Backups every 2 steps, 4 steps per epoch: backups 0-4 by epoch 2
    # step 2, where the second attempt resumed: it wrote 5-9, none again.
    for task in ("worker-0", "worker-1"):
        started = [name for event, name in _writes(tmp_path, task) if event == "open"]
        if task == "worker-0":  # the pointer, and the survivor's unused rescue
            started = [name for name in started
                       if name != POINTER + ".tmp" and not name.startswith("rescue-")]
        assert started == [f"ckpt-{i}.{task}.npz.tmp" for i in range(10)], (task, started)
    chief, other = _writes(tmp_path, "worker-0"), _writes(tmp_path, "worker-1")
    assert ("os.rename", POINTER) in chief
    # The other worker wrote, replaced and removed its own files only.
    assert other and all(re.fullmatch(r"ckpt-\d+\.worker-1\.npz(\.tmp)?", name)
                         for _, name in other), other
    assert _pointer(tmp_path / "backup")["tasks"] == ["worker-0", "worker-1"]


def _results(workdir, workers=2):
    got = []
    for index in range(workers):
        with np.load(workdir / f"result-worker-{index}.npz") as npz:
            got.append([npz[str(i)] for i in range(len(npz.files))])
    return got


@pytest.mark.parametrize("optimizer, lost, kill_batch", [
    # Worker 0 hosts the coordination service; worker 1's part of the
    # sharded moments comes from worker 0's peer copy.
    ("adam_sharded", 0, KILL_BATCH),
    pytest.param("adam", 1, KILL_BATCH, marks=pytest.mark.slow),
    # Killed after the epoch's last step: the survivor fails as Keras reads
    # the epoch's metrics (a collective, outside the steps).
    pytest.param("adam", 1, -1, marks=pytest.mark.slow),
    # Killed with 2 gradients accumulated: worker 1's come from worker 0's
    # peer copy; so do worker 0's residuals.
    pytest.param("accumulation", 1, KILL_BATCH, marks=pytest.mark.slow),
    pytest.param("int8", 0, KILL_BATCH, marks=pytest.mark.slow),
])
def test_a_lost_workers_survivor_saves_the_last_step_and_the_job_resumes_there(
    tmp_path, optimizer, lost, kill_batch
):
    """A worker is SIGKILLed before step 12 (or after step 12, the end of
    epoch 2) with backups only every epoch (the last after step 8): the
    other saves the last two steps it completed as its collectives fail,
    and the restarted job resumes after the last one, training no step
    twice, and ends at the uninterrupted run's state."""
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "1"],
        [sys.executable, WORKER_SCRIPT, str(tmp_path), f"--optimizer={optimizer}",
         "--save_freq=epoch", "--kill_worker", str(lost), f"--kill_epoch={KILL_EPOCH}",
         f"--kill_batch={kill_batch}"],
        cluster_env(),
    )
    assert code == 0, output
    assert f"Worker slot {lost} was killed by SIGKILL; restarting every worker" in output, output
    survivor = 1 - lost
    epoch, step = (KILL_EPOCH, KILL_BATCH) if kill_batch >= 0 else (KILL_EPOCH + 1, 0)
    why = "a collective failed (a peer lost?)" if kill_batch >= 0 else "fit left with an error"
    assert (f"[worker {survivor}] " * survivor + f"BackupAndRestore: {why}; saved the last "
            f"steps this worker completed, up to epoch {epoch}, step {step}"
            ) in output, output
    assert (f"BackupAndRestore: resuming at epoch {epoch}, step {step}, the last step the "
            f"survivors completed, from their rescue (worker-{lost} lost).") in output, output
    steps = epoch * 4 + step
    # The optimizer's iterations count applied steps: 1 in 3 accumulated.
    applied = steps // 3 if optimizer == "accumulation" else steps
    for task in ("worker-0", "worker-1"):
        begins = (tmp_path / f"begin-{optimizer}-{task}.txt").read_text().split()
        assert begins == ["0", str(applied)], (task, begins)
    reference = restart_model.build_model(
        tf_agn.strategies.mirrored(DEVICES[:2]), restart_model.OPTIMIZERS[optimizer]
    )
    _fit(reference)
    _assert_states_equal(_results(tmp_path), restart_model.training_state(reference), atol=1e-5)
    # The rescue became a backup; no rescue file is left.
    assert (_pointer(tmp_path / "backup")["epoch"], _pointer(tmp_path / "backup")["step"]) == (
        restart_model.EPOCHS, 0)
    assert not [name for name in os.listdir(tmp_path / "backup") if name.startswith("rescue")]


@pytest.mark.parametrize("error, torn_down", [
    ("tf.errors.UnavailableError(None, None, 'a peer was lost')", False),
    ("ValueError('not a lost peer')", True),
])
def test_a_survivor_exits_without_teardown_after_an_op_error(error, torn_down):
    """After an uncaught op error, the handler `multi_worker_mirrored`
    registers ends the process with code 1 once the handlers registered
    after it (BackupAndRestore's rescue) ran, skipping the ones before it
    and TensorFlow's teardown; after any other error, exit is as usual."""
    source = f"""
import atexit
import tensorflow as tf
from tf_agn.strategies import multi_worker
atexit.register(lambda: print("registered before: ran", flush=True))
atexit.register(multi_worker._exit_without_teardown_after_an_op_error)
atexit.register(lambda: print("registered after: ran", flush=True))
raise {error}
"""
    result = subprocess.run([sys.executable, "-c", source], env=cluster_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "registered after: ran" in result.stdout, result.stdout
    assert ("registered before: ran" in result.stdout) is torn_down, result.stdout


@pytest.mark.slow
def test_a_killed_streaming_diloco_worker_resumes_an_exchange_in_flight(tmp_path):
    # Backups every 2 steps: the last before the kill, after step 8, holds
    # the first fragment's Δ, taken after step 7 and landing after step 9:
    # its first slice combined in step 8, its second each worker's own.
    code, output = launch(
        ["--multi_worker", "2", "--max_restarts", "1"],
        [sys.executable, WORKER_SCRIPT, str(tmp_path), "--optimizer=streaming_diloco",
         "--kill_worker", "1", "--kill_epoch=2", "--kill_batch=1"],
        cluster_env(),
    )
    assert code == 0, output
    assert "restarting every worker (restart 1 of 1)" in output, output
    reference = restart_model.build_model(
        tf_agn.strategies.mirrored(DEVICES[:2]), restart_model.OPTIMIZERS["streaming_diloco"]
    )
    _fit(reference)
    _assert_states_equal(_results(tmp_path), restart_model.training_state(reference), atol=1e-5)


def _killed_job_of_3(tmp_path, optimizer, rows, batch):
    """A 3-worker job that dies (worker 1 is SIGKILLed, no restarts),
    leaving a backup of 3 replicas; returns its workers' arguments."""
    args = [WORKER_SCRIPT, str(tmp_path), f"--optimizer={optimizer}",
            f"--rows={rows}", f"--global_batch={batch}"]
    code, output = launch(
        ["--multi_worker", "3"],
        [sys.executable, *args, "--kill_worker", "1", f"--kill_epoch={KILL_EPOCH}",
         f"--kill_batch={KILL_BATCH}"],
        cluster_env(),
    )
    assert code != 0 and "sending myself SIGKILL" in output, output
    assert _pointer(tmp_path / "backup")["num_replicas_in_sync"] == 3
    return args


def _assert_ends_as_uninterrupted_on_2(tmp_path, optimizer, rows, batch):
    """Both workers of the 2-worker job end where an uninterrupted run of 2
    replicas does (MEAN, the same global batch)."""
    reference = restart_model.build_model(
        tf_agn.strategies.mirrored(DEVICES[:2]), restart_model.OPTIMIZERS[optimizer]
    )
    x, y = restart_model.data()
    reference.fit(x[:rows], y[:rows], batch_size=batch, epochs=restart_model.EPOCHS,
                  shuffle=False, verbose=0)
    for index in range(2):
        with np.load(tmp_path / f"result-worker-{index}.npz") as npz:
            got = [npz[str(i)] for i in range(len(reference.weights))]
        for g, w in zip(got, reference.get_weights(), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "adam_sharded"])
def test_a_job_of_3_workers_resumes_as_a_job_of_2(tmp_path, optimizer):
    """A new job of 2 workers on the same backup directory ends where an
    uninterrupted run does."""
    rows, batch = 60, 12  # 5 steps an epoch; backups every 2
    args = _killed_job_of_3(tmp_path, optimizer, rows, batch)
    code, output = launch(["--multi_worker", "2"], [sys.executable, *args], cluster_env())
    assert code == 0, output
    _assert_ends_as_uninterrupted_on_2(tmp_path, optimizer, rows, batch)


@pytest.mark.slow
def test_a_machine_that_never_returns_is_left_out_and_rejoins_at_the_next_restart(tmp_path):
    """Supervisors on several machines restart the workers of a dead 3-worker
    job with TF_CONFIG's cluster of 3 and TF_AGN_MIN_WORKERS=2; worker 1's
    machine never returns. Workers 0 and 2 wait for it, go on as a job of 2
    and end where an uninterrupted run does; worker 1, back while they
    train, is told that the job runs without it."""
    rows, batch = 60, 12
    args = _killed_job_of_3(tmp_path, "adam", rows, batch)
    cluster = {"worker": [f"localhost:{port}" for port in ports.free_ports(3)]}
    logs = {index: tmp_path / f"restarted-{index}.log" for index in range(3)}
    workers = {}

    # Workers 0 and 2 keep their TensorFlow servers up until worker 1 is done.
    worker_1_done = tmp_path / "worker-1-done"

    def start(index, connect_timeout):
        with open(logs[index], "wb") as log:
            workers[index] = subprocess.Popen(
                [sys.executable, *args, f"--connect_timeout={connect_timeout}",
                 f"--linger_until={worker_1_done}"],
                env={**worker_env(cluster, index), membership.MIN_WORKERS_VARIABLE: "2"},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    try:
        start(0, 8)
        start(2, 8)
        # Worker 1 is back once the others train as a job of 2.
        deadline = time.monotonic() + 240
        while "trains as worker" not in logs[2].read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        start(1, 5)
        code_1 = workers[1].wait(timeout=240)
        worker_1_done.touch()
        codes = {index: worker.wait(timeout=240) for index, worker in workers.items()}
        assert codes[1] == code_1
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    output = {index: log.read_text(errors="replace") for index, log in logs.items()}
    assert codes == {0: 0, 2: 0, 1: codes[1]} and codes[1] != 0, output
    assert "tf_agn: worker 0 trains as worker 0 of 2 (min_workers=2); left out: worker 1" in output[0]
    assert "tf_agn: worker 2 trains as worker 1 of 2" in output[2], output[2]
    assert "Worker 1: the job runs without it" in output[1], output[1]
    _assert_ends_as_uninterrupted_on_2(tmp_path, "adam", rows, batch)
