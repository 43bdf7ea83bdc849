"""tf_agn/resuming/rescue.py in one process: which rescue a restarted job
resumes from, and a lost task's own state (its part of sharded state, its
accumulators, its residuals) cut from a survivor's gathered copies (4
replicas here, read as 2 tasks of 2).

Real lost workers, killed mid-step, are in tests/test_restarts.py."""

import numpy as np
import pytest

import restart_model
import tf_agn
from tf_agn.resuming import rescue
from tf_agn.resuming.backup_files import BackupFiles
from tf_agn.resuming.backup_files import Task
from tf_agn.resuming.replica_state import local_copies

TASKS = ["worker-0", "worker-1", "worker-2"]


def _pointer(files, epoch, step, checkpoint=0):
    return files.pointer(checkpoint, epoch, step, len(TASKS), 4)


def _files(tmp_path, task="worker-0"):
    return BackupFiles(str(tmp_path), Task(task, task == TASKS[0], TASKS))


def _rescue(tmp_path, task, epoch, step, value):
    files = _files(tmp_path, task)
    files.write_rescue(_pointer(files, epoch, step), {"state/0/0": np.array([value])})


def _built(optimizer):
    """restart_model's model with `optimizer`, built as `fit` begins."""
    strategy = tf_agn.strategies.mirrored()
    model = restart_model.build_model(strategy, restart_model.OPTIMIZERS[optimizer])
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def plain_model():
    return _built("adam")


def _steps(tmp_path):
    # worker-0 got one step further than worker-1; worker-2 was lost.
    for step in (5, 6):
        _rescue(tmp_path, "worker-0", 1, step, 10.0 * step)
    for step in (4, 5):
        _rescue(tmp_path, "worker-1", 1, step, 20.0 * step)


def test_the_latest_step_a_survivor_saved_is_chosen(tmp_path, plain_model, capsys):
    _steps(tmp_path)
    found = rescue.find(_files(tmp_path), None, plain_model, say=True)
    assert (found.pointer["epoch"], found.pointer["step"]) == (1, 6)
    assert found.read("worker-0")["state/0/0"] == [60.0]
    # The task a step behind and the lost one take worker-0's state.
    assert found.read("worker-1")["state/0/0"] == [60.0]
    assert found.read("worker-2")["state/0/0"] == [60.0]
    assert ("resuming at epoch 1, step 6, the last step the survivors completed, from "
            "their rescue (worker-2 lost; worker-1 a step behind).") in capsys.readouterr().out


def test_with_state_of_their_own_every_task_resumes_from_its_own_step(tmp_path, capsys):
    _steps(tmp_path)
    _rescue(tmp_path, "worker-2", 1, 5, 30.0)
    _rescue(tmp_path, "worker-2", 1, 6, 30.0)
    found = rescue.find(_files(tmp_path), None, _built("agn"), say=True)
    assert (found.pointer["epoch"], found.pointer["step"]) == (1, 5)
    assert [found.read(f"worker-{i}")["state/0/0"] for i in range(3)] == [[50.0], [100.0], [30.0]]
    assert "(worker-1 a step behind)" not in capsys.readouterr().out


def test_no_rescue_without_one_newer_than_the_backup(tmp_path, plain_model):
    files = _files(tmp_path)
    assert rescue.find(files, None, plain_model, say=False) is None  # none at all
    _rescue(tmp_path, "worker-0", 1, 6, 1.0)
    _rescue(tmp_path, "worker-1", 1, 4, 2.0)
    assert rescue.find(files, _pointer(files, 1, 6), plain_model, say=False) is None
    assert rescue.find(files, _pointer(files, 1, 5), plain_model, say=False) is not None
    # A half-written file (its writer killed) is not read; nor after removal.
    (tmp_path / "rescue-1-7.worker-0.npz.tmp").write_bytes(b"half")
    assert set(files.rescues()) == {(1, 4), (1, 6)}
    files.remove_rescues()
    assert files.rescues() == {}


@pytest.mark.parametrize("optimizer, own", [
    ("adam", []),
    ("adam_sharded", ["its part of the sharded optimizer state"]),
    ("accumulation", ["its gradient accumulators"]),
    ("int8", ["its compressor state (error feedback residuals)"]),
    ("agn", ["its local steps in AGN's window"]),
])
def test_what_a_lost_worker_takes_with_it_without_and_with_peer_copies(optimizer, own):
    model = _built(optimizer)
    assert rescue.own_state(model) == own
    window = ["its local steps in AGN's window"] if optimizer == "agn" else []
    assert rescue.own_state(model, peer_copies=True) == window


def test_state_only_a_lost_worker_held_makes_the_job_fall_back(tmp_path, capsys):
    model = _built("agn")
    for task in ("worker-0", "worker-1"):
        _rescue(tmp_path, task, 0, 2, 1.0)
    assert rescue.find(_files(tmp_path), None, model, say=True) is None
    assert ("worker-2 lost its local steps in AGN's window; the survivors' rescue at epoch "
            "0, step 2 cannot be used: resuming from the last backup.") in capsys.readouterr().out
    # With every task's rescue, nothing was lost.
    _rescue(tmp_path, "worker-2", 0, 2, 1.0)
    assert rescue.find(_files(tmp_path), None, model, say=False) is not None


@pytest.mark.parametrize("optimizer, own_variables", [
    ("adam_sharded", 8),  # the moments of 2 kernels and 2 biases
    ("accumulation", 4),  # an accumulator each
    ("int8", 4),  # a residual each
])
def test_a_lost_tasks_own_state_is_cut_from_a_survivors_peer_copies(optimizer, own_variables):
    strategy = tf_agn.strategies.mirrored()
    model = restart_model.build_model(strategy, restart_model.OPTIMIZERS[optimizer])
    x, y = restart_model.data()
    # 5 steps: 3 accumulated gradients applied, 2 still held.
    model.fit(x[:5 * restart_model.GLOBAL_BATCH], y[:5 * restart_model.GLOBAL_BATCH],
              batch_size=restart_model.GLOBAL_BATCH, epochs=1, verbose=0)
    variables = list(model.variables) + list(model.optimizer.variables)
    positions = rescue.peer_positions(model)
    assert len(positions) == own_variables
    gathered = rescue.gather_parts(strategy, variables, positions)
    assert sorted(gathered) == ["peer/float32", "peer/positions"]
    survivor = dict(local_copies(strategy, variables, "state"), **gathered)
    # Read as 2 tasks of 2 replicas: the second task's replicas are 2 and 3.
    cut = rescue._lost_parts(survivor, survivor["peer/positions"], range(2, 4))
    assert sorted(cut) == sorted(f"state/{p}/{r}" for p in positions for r in range(2))
    for p in positions:
        copies = tf_agn.replica_weights([variables[p]])
        assert not np.array_equal(copies[2][0], copies[0][0])  # parts differ
        for local, replica in enumerate((2, 3)):
            np.testing.assert_array_equal(cut[f"state/{p}/{local}"], copies[replica][0])
