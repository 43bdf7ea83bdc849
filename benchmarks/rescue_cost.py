r"""What keeping the last steps for a rescue costs a 2-worker job's step.

Two localhost worker processes (`python -m tf_agn.strategies.launch
--multi_worker 2`, one core each) train the preemption benchmark's MLP
(784-4096-4096-1024-10, 24.2M parameters) with Adam: plain, with sharded
state, accumulating 2 gradients a step, or with int8 compression (error
feedback residuals), under `tf_agn.callbacks.BackupAndRestore` with
backups once an epoch (none in the timed steps). With
`keep_last_steps=True` every step ends with a host copy of the worker's
training state and, for the state each replica holds of its own (its part
of sharded state, its accumulators, its residuals), an all-gather of every
worker's copy (`tf_agn.resuming.rescue`); the baseline is the same job with
`keep_last_steps=False`, run just before.

It reports, per optimizer, the median step time of each (from one step's
end to the next's, after the warm-up), their ratio, and what a snapshot
holds and a step gathers.

Usage (about 6 minutes on 2 CPU cores):

    python benchmarks/rescue_cost.py
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

import launched

FLAGS = flags.FLAGS
flags.DEFINE_list("units", ["4096", "4096", "1024"], "The MLP's hidden layers' widths.")
flags.DEFINE_integer("batch_size", 256, "The global batch.")
flags.DEFINE_integer("steps", 12, "Steps timed, after the warm-up.")
flags.DEFINE_integer("warmup", 3, "Steps not timed (tracing, first snapshots).")
OPTIMIZERS = {
    "adam": {},
    "adam_sharded": {"shard_optimizer_state": True},
    "accumulation": {"gradient_accumulation_steps": 2},
    "int8": {"compression": "int8"},
}
flags.DEFINE_list("optimizers", list(OPTIMIZERS), "Which Adams to measure.")
flags.DEFINE_string("workdir", None, "Where a worker runs (set by this script).")
flags.DEFINE_boolean("keep_last_steps", True, "For a worker (set by this script).")
flags.DEFINE_string("optimizer", "adam", "For a worker (set by this script).")


def worker_main():
    """One worker: times its steps; worker 0 writes them to WORKDIR."""
    import keras
    import numpy as np

    import tf_agn
    from tf_agn.resuming import rescue

    strategy = tf_agn.strategies.multi_worker_mirrored()
    model, dataset = launched.mlp_job(
        strategy, FLAGS.units, FLAGS.batch_size,
        lambda: tf_agn.optimizers.Adam(1e-4, **OPTIMIZERS[FLAGS.optimizer]),
    )
    ends = []

    class Times(keras.callbacks.Callback):  # after BackupAndRestore's snapshot
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    backup = tf_agn.callbacks.BackupAndRestore(
        os.path.join(FLAGS.workdir, "backup"), keep_last_steps=FLAGS.keep_last_steps
    )
    model.fit(dataset, steps_per_epoch=FLAGS.warmup + FLAGS.steps, epochs=1, verbose=0,
              callbacks=[backup, Times()])
    variables = model.variables + model.optimizer.variables
    own = sum(int(np.prod(variables[p].shape)) * 4 for p in rescue.peer_positions(model))
    state = sum(int(np.prod(v.shape)) * 4 for v in variables)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        with open(os.path.join(FLAGS.workdir, "result.json"), "w") as f:
            json.dump({"step_ms": 1e3 * float(np.median(np.diff(ends[FLAGS.warmup - 1:]))),
                       "parameters": int(model.count_params()),
                       "state_bytes": state, "own_bytes": own}, f)


def measure(optimizer, keep_last_steps):
    """One job; returns worker 0's result."""
    with tempfile.TemporaryDirectory(prefix="tf_agn-rescue-cost-") as workdir:
        command = [
            sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "2", "--",
            sys.executable, os.path.abspath(__file__), f"--workdir={workdir}",
            f"--units={','.join(FLAGS.units)}", f"--batch_size={FLAGS.batch_size}",
            f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}",
            f"--optimizer={optimizer}", f"--keep_last_steps={keep_last_steps}",
        ]
        done = subprocess.run(command, env=launched.cluster_env(), capture_output=True,
                              text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(done.stdout + done.stderr)
        with open(os.path.join(workdir, "result.json")) as f:
            return json.load(f)


def main(argv):
    del argv
    if FLAGS.workdir:
        worker_main()
        return
    rows = []
    for optimizer in FLAGS.optimizers:
        base, kept = measure(optimizer, False), measure(optimizer, True)
        rows.append((optimizer, base, kept))
    print(f"tf_agn rescue cost: 2 workers on localhost, {os.cpu_count()} CPUs, MLP "
          f"784-{'-'.join(FLAGS.units)}-10 ({rows[0][1]['parameters']:,} parameters), "
          f"global batch {FLAGS.batch_size}, median of {FLAGS.steps} steps")
    print("| optimizer | step, keep_last_steps=False (ms) | step, True (ms) | ratio "
          "| a snapshot holds (MB) | a step gathers per worker (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for optimizer, base, kept in rows:
        # `own_bytes` is one replica's own state: a snapshot holds the
        # worker's state and every replica's copy of its own, gathered (2
        # of them), of which it received the other worker's. Two snapshots
        # are kept.
        holds = kept["state_bytes"] + 2 * kept["own_bytes"]
        print(f"| {optimizer} | {base['step_ms']:.0f} | {kept['step_ms']:.0f} | "
              f"{kept['step_ms'] / base['step_ms']:.2f} | {holds / 1e6:.0f} | "
              f"{kept['own_bytes'] / 1e6:.0f} |")


if __name__ == "__main__":
    app.run(main)
