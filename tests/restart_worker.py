"""One worker of tests/test_restarts.py's restart test and of
benchmarks/restart_cost.py: trains a tiny model with AGN on
`tf_agn.strategies.multi_worker_mirrored()` under
`tf_agn.callbacks.BackupAndRestore`, and may SIGKILL itself mid-fit.

It is not a test module and must not import conftest (which splits the CPU
into 4 devices): each worker keeps one CPU, one replica.

Usage: python restart_worker.py WORKDIR [--kill_worker I --kill_epoch E
    --kill_batch B] [--epochs N] [--optimizer adam|adam_sharded|streaming_diloco]
    [--rows R --global_batch G]

With --optimizer it trains with tf_agn's Adam (sharded or not) instead of
AGN; with --rows and --global_batch, on the first R rows in batches of G.

Worker I kills itself (SIGKILL) just before batch B of epoch E, unless
WORKDIR/killed exists; it first writes that file, holding the time of the
kill, so only the first attempt dies. The backup goes to WORKDIR/backup (kept after fit). Each
worker writes:

    WORKDIR/result-<task>.npz: every variable of the model and of the
        optimizer (this worker's replica's copy), in order, as "0", "1", ...;
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

# The strategy must exist before any other TensorFlow op runs.
STRATEGY = tf_agn.strategies.multi_worker_mirrored()

SAVE_FREQ = 2


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
    """SIGKILLs this process before batch `batch` of epoch `epoch`, once."""

    def __init__(self, epoch, batch, marker):
        super().__init__()
        self.kill_epoch, self.kill_batch, self.marker = epoch, batch, marker

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch) and not os.path.exists(
            self.marker
        ):
            with open(self.marker, "w") as marker:
                marker.write(repr(time.time()))  # when, for the benchmark
            print(f"killing myself before epoch {self.epoch} batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--epochs", type=int, default=restart_model.EPOCHS)
    parser.add_argument("--kill_worker", type=int, default=-1)
    parser.add_argument("--kill_epoch", type=int, default=2)
    parser.add_argument("--kill_batch", type=int, default=3)
    parser.add_argument("--optimizer", choices=list(restart_model.OPTIMIZERS), default="agn")
    parser.add_argument("--rows", type=int, default=restart_model.ROWS)
    parser.add_argument("--global_batch", type=int, default=restart_model.GLOBAL_BATCH)
    args = parser.parse_args()
    name = task_name()
    backup_dir = os.path.join(args.workdir, "backup")
    record_writes(backup_dir, os.path.join(args.workdir, f"writes-{name}.jsonl"))

    x, y = (column[: args.rows] for column in restart_model.data())
    model = restart_model.build_model(STRATEGY, restart_model.OPTIMIZERS[args.optimizer])
    callbacks = [
        tf_agn.callbacks.BackupAndRestore(
            backup_dir, save_freq=SAVE_FREQ, delete_checkpoint=False
        )
    ]
    if name == f"worker-{args.kill_worker}":
        marker = os.path.join(args.workdir, "killed")
        callbacks.append(KillSelf(args.kill_epoch, args.kill_batch, marker))
    model.fit(
        x, y, batch_size=args.global_batch, epochs=args.epochs,
        shuffle=False, verbose=0, callbacks=callbacks,
    )
    (copy,) = restart_model.training_state(model)  # one replica per worker
    result = os.path.join(args.workdir, f"result-{name}.npz")
    np.savez(result + ".tmp.npz", **{str(i): value for i, value in enumerate(copy)})
    os.replace(result + ".tmp.npz", result)
    print(f"{name} done", flush=True)
    # No peer may still need this worker's collectives when it exits.
    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    wait_for_files(
        [os.path.join(args.workdir, f"result-worker-{i}.npz") for i in range(workers)]
    )


if __name__ == "__main__":
    main()
    # Results are on disk and every peer is done with this one. Shutting the
    # gRPC server and collective executor down at exit takes seconds: skip it.
    sys.stdout.flush()
    os._exit(0)
