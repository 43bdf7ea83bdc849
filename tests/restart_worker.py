"""One worker of tests/test_restarts.py's restart test and of
benchmarks/restart_cost.py: trains a tiny model with AGN on
`tf_agn.strategies.multi_worker_mirrored()` under
`tf_agn.callbacks.BackupAndRestore`, and may SIGKILL itself mid-fit.

It is not a test module and must not import conftest (which splits the CPU
into 4 devices): each worker keeps one CPU, one replica.

Usage: python restart_worker.py WORKDIR [--kill_worker I --kill_epoch E
    --kill_batch B [--kill_signal SIGKILL|SIGTERM|SIGSTOP]] [--epochs N]
    [--optimizer NAME[,NAME...]] [--rows R --global_batch G]
    [--save_freq N|epoch] [--connect_timeout S] [--linger_until PATH]

With --optimizer it trains with restart_model.OPTIMIZERS[NAME] instead of
AGN; with several names, one after the other, each with its own backup
(WORKDIR/backup-NAME) and results (result-NAME-<task>.npz), a finished one
skipped when the job restarts. With --rows and --global_batch, on the
first R rows in batches of G. Backups every --save_freq steps (default 2).
--connect_timeout is multi_worker_mirrored's (with TF_AGN_MIN_WORKERS, how
long the workers wait for a missing one before going on without it). With
--linger_until PATH, a worker done training waits for PATH before it exits,
its TensorFlow server up.

Worker I sends itself --kill_signal (SIGKILL by default) just before batch
B of epoch E of each optimizer's fit, unless WORKDIR/killed-NAME exists; it
first writes that file, holding the time of the signal, so each optimizer
is hit once. SIGTERM is a preemption notice: every worker backs up after
one step and exits with 75. The backup is kept after fit. Each worker
writes:

    WORKDIR/result-<task>.npz (one optimizer): every variable of the model
        and of the optimizer (this worker's replica's copy), in order, as
        "0", "1", ...;
    WORKDIR/begin-NAME-<task>.txt: the optimizer's iterations as each
        attempt's fit began, a line each;
    WORKDIR/writes-<task>.jsonl: one line per file this process opened for
        writing, replaced or removed in the backup directory, appended as
        it happens (Python audit hooks), so a killed worker's survive.
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras  # noqa: E402
import tf_agn  # noqa: E402
import restart_model  # noqa: E402
from worker_cluster import wait_for_files  # noqa: E402

def task_name():
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}-{task['index']}"


def record_writes(backup_dir, log_path):
    """Appends every write to a file under `backup_dir` to `log_path`."""
    backup_dir = os.path.realpath(backup_dir)
    log = open(log_path, "a")

    def in_backup(path):
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.dirname(
            os.path.realpath(os.fsdecode(path))
        ) == backup_dir

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (mode and any(c in mode for c in "wax+")) or (
                mode is None and flags & (os.O_WRONLY | os.O_RDWR)
            )
            touched = [path] if writes else []
        elif event in ("os.replace", "os.rename"):
            touched = [args[0], args[1]]
        elif event in ("os.remove", "os.rmdir"):
            touched = [args[0]]
        else:
            return
        for path in touched:
            if in_backup(path):
                log.write(json.dumps([event, os.path.basename(os.fsdecode(path))]) + "\n")
                log.flush()

    sys.addaudithook(hook)


class KillSelf(keras.callbacks.Callback):
    """Sends this process `signum` before batch `batch` of epoch `epoch`,
    once; with `batch` -1, after the epoch's last batch (before Keras reads
    the epoch's metrics, a collective)."""

    def __init__(self, epoch, batch, marker, signum=signal.SIGKILL):
        super().__init__()
        self.kill_epoch, self.kill_batch, self.marker = epoch, batch, marker
        self.signum = signum

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch):
            self._kill(f"before epoch {self.epoch} batch {batch}")

    def on_train_batch_end(self, batch, logs=None):
        last = batch == self.params["steps"] - 1
        if (self.epoch, self.kill_batch) == (self.kill_epoch, -1) and last:
            self._kill(f"after epoch {self.epoch}'s last batch")

    def _kill(self, when):
        if os.path.exists(self.marker):
            return
        with open(self.marker, "w") as marker:
            marker.write(repr(time.time()))  # when, for the benchmark
        print(f"sending myself {self.signum.name} {when}", flush=True)
        os.kill(os.getpid(), self.signum)


class RecordBegin(keras.callbacks.Callback):
    """Appends the optimizer's iterations as fit begins (after a restore)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_begin(self, logs=None):
        with open(self.path, "a") as f:
            f.write(f"{int(self.model.optimizer.iterations.numpy())}\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--epochs", type=int, default=restart_model.EPOCHS)
    parser.add_argument("--kill_worker", type=int, default=-1)
    parser.add_argument("--kill_epoch", type=int, default=2)
    parser.add_argument("--kill_batch", type=int, default=3)
    parser.add_argument("--kill_signal", default="SIGKILL",
                        choices=["SIGKILL", "SIGTERM", "SIGSTOP"])
    parser.add_argument("--optimizer", default="agn")
    parser.add_argument("--rows", type=int, default=restart_model.ROWS)
    parser.add_argument("--global_batch", type=int, default=restart_model.GLOBAL_BATCH)
    parser.add_argument("--save_freq", type=lambda v: v if v == "epoch" else int(v), default=2)
    parser.add_argument("--connect_timeout", type=float, default=600)
    parser.add_argument("--linger_until")
    args = parser.parse_args()
    # Before any other TensorFlow op runs.
    strategy = tf_agn.strategies.multi_worker_mirrored(connect_timeout_seconds=args.connect_timeout)
    names = args.optimizer.split(",")
    name = task_name()
    x, y = (column[: args.rows] for column in restart_model.data())
    for optimizer in names:
        suffix = f"-{optimizer}" if len(names) > 1 else ""
        result = os.path.join(args.workdir, f"result{suffix}-{name}.npz")
        if os.path.exists(result):
            continue  # trained before the job restarted
        backup_dir = os.path.join(args.workdir, "backup" + suffix)
        record_writes(backup_dir, os.path.join(args.workdir, f"writes-{name}.jsonl"))
        model = restart_model.build_model(strategy, restart_model.OPTIMIZERS[optimizer])
        callbacks = [
            tf_agn.callbacks.BackupAndRestore(
                backup_dir, save_freq=args.save_freq, delete_checkpoint=False
            ),
            RecordBegin(os.path.join(args.workdir, f"begin-{optimizer}-{name}.txt")),
        ]
        if name == f"worker-{args.kill_worker}":
            marker = os.path.join(args.workdir, "killed" + suffix)
            callbacks.append(KillSelf(args.kill_epoch, args.kill_batch, marker,
                                      signal.Signals[args.kill_signal]))
        model.fit(
            x, y, batch_size=args.global_batch, epochs=args.epochs,
            shuffle=False, verbose=0, callbacks=callbacks,
        )
        (copy,) = restart_model.training_state(model)  # one replica per worker
        np.savez(result + ".tmp.npz", **{str(i): value for i, value in enumerate(copy)})
        os.replace(result + ".tmp.npz", result)
    print(f"{name} done", flush=True)
    # No peer may still need this worker's collectives when it exits.
    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    wait_for_files([
        os.path.join(args.workdir, f"result{suffix}-worker-{i}.npz") for i in range(workers)
    ])
    if args.linger_until:
        wait_for_files([args.linger_until], timeout=240)


if __name__ == "__main__":
    main()
    # Results are on disk and every peer is done with this one. Shutting the
    # gRPC server and collective executor down at exit takes seconds: skip it.
    sys.stdout.flush()
    os._exit(0)
