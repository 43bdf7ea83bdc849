r"""What a preemption notice costs a 2-worker `multi_worker_mirrored` job,
and where a restart's time goes.

Two localhost worker processes (`python -m tf_agn.strategies.launch
--multi_worker 2`, one core each) train an MLP (784-4096-4096-1024-10,
24.2M parameters, the overlap benchmark's) with Adam under
`tf_agn.callbacks.BackupAndRestore` (backups once an epoch, so the notice's
backup is the only one). After `--steps_before` steps, this script sends
SIGTERM to worker 1, as a cloud sends before it preempts a machine. Both
workers agree on a step, back up after it (every variable and Adam's
moments: 290 MB a worker) and exit with 75; the launcher restarts them,
uncounted, and they resume and train one step.

It reports, per run, in seconds from the signal: when each worker had
backed up (`Preempted` raised), and when the launcher saw both exit; then
the restart's phases, from the new processes' start: TensorFlow imported,
the strategy connected, the model built and compiled, the backup restored
(`fit`'s start) and the first step done.

Target: from the notice to both workers' exit within 30 s (GKE's notice;
AWS gives up to 120 s).

Usage (about a minute a run on 2 CPU cores):

    python benchmarks/preemption.py --runs=2
"""

import time

START = time.time()  # before the imports: a restart's process start

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import launched  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("runs", 2, "How many notices to measure, each in a fresh job.")
flags.DEFINE_list("units", ["4096", "4096", "1024"], "The MLP's hidden layers' widths.")
flags.DEFINE_integer("batch_size", 256, "The global batch.")
flags.DEFINE_integer("steps_before", 5, "Steps trained before the notice.")
flags.DEFINE_string("workdir", None, "Where a worker runs (set by this script).")

TARGET_S = 30.0
PHASES = ("imported", "connected", "built", "restored", "stepped")


def log(event, **fields):
    """Appends `event` with this worker's time to WORKDIR/events.jsonl."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    restart = int(os.environ["TF_AGN_RESTART_COUNT"])
    line = dict(event=event, worker=task, restart=restart, time=time.time(), **fields)
    with open(os.path.join(FLAGS.workdir, "events.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def worker_main():
    """One worker: trains until the notice, or (restarted) one step."""
    log("started", at=START)
    import keras

    import tf_agn  # TensorFlow with it

    log("imported")
    strategy = tf_agn.strategies.multi_worker_mirrored()
    log("connected")
    restart = int(os.environ["TF_AGN_RESTART_COUNT"])
    steps = FLAGS.steps_before + 1000  # the notice comes long before the end
    model, dataset = launched.mlp_job(
        strategy, FLAGS.units, FLAGS.batch_size, lambda: tf_agn.optimizers.Adam(1e-4)
    )
    log("built", parameters=int(model.count_params()))

    class Marks(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            log("restored", iterations=int(self.model.optimizer.iterations.numpy()))

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                log("stepped")
                if restart:  # the restart is measured: stop here
                    sys.stdout.flush()
                    os._exit(0)
            if batch + 1 == FLAGS.steps_before:
                log("ready")  # the notice may come

    backup = tf_agn.callbacks.BackupAndRestore(os.path.join(FLAGS.workdir, "backup"))
    try:
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=[backup, Marks()])
    except tf_agn.callbacks.Preempted as preempted:
        log("backed_up", step=preempted.step)
        raise


def measure_once(run):
    """One job: the notice, the exits, the restart. Returns its events."""
    workdir = tempfile.mkdtemp(prefix=f"tf_agn-preemption-{run}-")
    env = launched.cluster_env()
    command = [sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "2", "--",
               sys.executable, os.path.abspath(__file__), f"--workdir={workdir}",
               f"--units={','.join(FLAGS.units)}", f"--batch_size={FLAGS.batch_size}",
               f"--steps_before={FLAGS.steps_before}"]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    events_path = os.path.join(workdir, "events.jsonl")
    try:
        _wait_for(events_path, lambda e: sum(x["event"] == "ready" for x in e) == 2)
        (worker_1,) = [
            pid for pid, index in launched.launcher_workers(launcher.pid).items() if index == 1
        ]
        signalled = time.time()
        os.kill(worker_1, signal.SIGTERM)
        exited = None
        for line in launcher.stdout:
            if "Every worker backed up after a preemption notice" in line:
                exited = time.time()
        if launcher.wait(600) != 0 or exited is None:
            raise RuntimeError(f"the launcher exited with {launcher.returncode}")
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        with open(events_path) as f:
            events = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the backup: 290 MB a worker
    return signalled, exited, events


def _wait_for(path, done, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                events = [json.loads(line) for line in f if line.endswith("\n")]
            if done(events):
                return events
        time.sleep(0.1)
    raise TimeoutError(f"no workers ready within {timeout} s")


def report(runs):
    print(f"tf_agn preemption: 2 workers on localhost, {os.cpu_count()} CPUs, "
          f"MLP 784-{'-'.join(FLAGS.units)}-10, global batch {FLAGS.batch_size}")
    rows = []
    for signalled, exited, events in runs:
        backed_up = sorted(e["time"] - signalled for e in events if e["event"] == "backed_up")
        restart = [e for e in events if e["restart"] == 1 and e["worker"] == 0]
        marks = {e["event"]: e for e in restart}
        start = marks["started"]["at"]
        phases = [marks[p]["time"] - start for p in PHASES]
        stopped = {e["step"] for e in events if e["event"] == "backed_up"}
        rows.append((backed_up, exited - signalled, phases,
                     (stopped, marks["restored"]["iterations"])))
        parameters = marks["built"]["parameters"]
    print(f"parameters: {parameters:,}")
    print("| run | backed up (worker 0, 1) | both exited | restart: imported | connected "
          "| built | restored | first step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run, (backed_up, exited, phases, _) in enumerate(rows, 1):
        cells = " | ".join(f"{p:.1f}" for p in phases)
        print(f"| {run} | {', '.join(f'{b:.1f}' for b in backed_up)} | {exited:.1f} | {cells} |")
    print("(seconds: backups and exits from the notice; restart phases from the new "
          "process's start)")
    for run, (*_, (stopped, resumed)) in enumerate(rows, 1):
        same = "no step trained twice or lost" if stopped == {resumed} else "MISMATCH"
        print(f"run {run}: both stopped after step {sorted(stopped)}, resumed at {resumed}: {same}")
    worst = max(exited for _, exited, _, _ in rows)
    verdict = "PASS" if worst <= TARGET_S else "FAIL"
    print(f"{verdict}: notice to exit at most {worst:.1f} s (target {TARGET_S:g} s)")


def main(argv):
    del argv
    if FLAGS.workdir:
        worker_main()
        return
    report([measure_once(run) for run in range(FLAGS.runs)])


if __name__ == "__main__":
    app.run(main)
