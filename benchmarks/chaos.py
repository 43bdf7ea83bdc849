r"""Training under chaos: 3 localhost workers, a fault every `--interval`
seconds on a random worker, and what each fault costs.

Each job runs `python -m tf_agn.strategies.launch --multi_worker 3` over
this script in worker mode: an MLP (784-1024-1024-10, 1.9M parameters) with
Adam on fixed data, `--epochs` epochs of `--steps_per_epoch` steps, under
`tf_agn.callbacks.BackupAndRestore`. A clean job (no fault) sets the
reference wall time and weights (the faster of two, as the first pays for
cold caches). Then, for each fault kind of `--kinds`,
faults go to random workers of the running group, `--faults` of them, one
every `--interval` seconds:

- `sigkill`: a lost host;
- `sigterm`: a preemption notice (the process is SIGKILLed `--notice_s`
  later if it still runs, as a cloud does);
- `sigstop`: a hung host (SIGCONT after `--stop_s` if it still exists).

Each kind runs with each recipe of `--recipes`: `tf_agn` (preemption
notices on, survivors' rescues on, the launcher's `--hang_timeout 10`,
backups every `--save_freq` steps), and today's recovery without them
(notices and rescues off, no hang timeout, so TensorFlow's own health
check finds a hung worker) with backups every `--save_freq` steps
(`backups`) or every epoch (`backups_epoch`).

Reported per job: wall time, goodput (the clean job's wall time over this
job's), what a fault cost (the extra wall time over the faults), restarts
(and those after a preemption, uncounted), steps trained twice (steps
that every worker of an attempt completed and a later attempt trained
again; a step only the lost worker completed died with it, and training it
again loses nothing), and the final weights against the clean job's (max
|difference|). Then where a restart's time goes: the median, over a job's
restarts, of the seconds from the fault to the launcher restarting every
worker (the survivors saved and exited), and to each new worker's
`PHASES` (its script began, connected, built the model, began `fit` past
the restore, trained a step), the slowest worker's. `--logdir` keeps each
job's launcher output (each line after its time) and its workers' steps
and phases files.

Targets (issue 48): no step trained twice; final weights bitwise equal;
goodput >= 0.85 with a SIGKILL or a SIGTERM every 30 s; a SIGSTOP costs at
most the detection bound (10 s) plus one restart.

Usage (the full run: 10 faults of each kind, about 40 minutes):

    python benchmarks/chaos.py --faults=10 --interval=30
"""

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags

import launched

FLAGS = flags.FLAGS
flags.DEFINE_list("kinds", ["sigterm", "sigkill", "sigstop"], "Fault kinds, one job each.")
flags.DEFINE_list("recipes", ["tf_agn", "backups", "backups_epoch"], "Recoveries to compare.")
flags.DEFINE_integer("faults", 10, "Faults per job.")
flags.DEFINE_float("interval", 30.0, "Seconds between faults.")
flags.DEFINE_float("notice_s", 30.0, "sigterm: seconds from the notice to a SIGKILL.")
flags.DEFINE_float("stop_s", 60.0, "sigstop: seconds a worker stays stopped.")
flags.DEFINE_integer("epochs", 10, "Epochs of training.")
flags.DEFINE_integer("steps_per_epoch", 100, "Steps an epoch.")
flags.DEFINE_integer("save_freq", 10, "Steps between backups (0: every epoch).")
flags.DEFINE_list("units", ["1024", "1024"], "The MLP's hidden layers' widths.")
flags.DEFINE_integer("batch_size", 192, "The global batch.")
flags.DEFINE_integer("seed", 0, "Which workers the faults hit.")
flags.DEFINE_string("workdir", None, "Worker mode: the job's directory (set by this script).")
flags.DEFINE_bool("notices", True, "Worker mode: whether SIGTERM is a notice.")
flags.DEFINE_bool("rescues", True,
                  "Worker mode: whether survivors save the last step (keep_last_steps).")
flags.DEFINE_string("logdir", None,
                    "Keeps each job's launcher output and steps files there, to "
                    "diagnose a step trained twice (default: deleted).")

HANG_TIMEOUT_S = 10
# What each worker reaches, in order (its phases file): the script's main
# began (a standby's worker: when it took the place), the strategy made,
# the model built, `fit` began past BackupAndRestore's restore, a first
# step trained.
PHASES = ("started", "connected", "built", "restored", "stepped")


def worker_main():
    """One worker: trains, logging every step's iteration to its steps
    file and when it reached each of `PHASES` to its phases file."""
    import keras
    import numpy as np

    import tf_agn

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = int(os.environ["TF_AGN_RESTART_COUNT"])
    phases = open(os.path.join(FLAGS.workdir, f"phases-{index}-{attempt}.txt"), "a", buffering=1)

    def reached(phase):
        phases.write(f"{phase} {time.time():.3f}\n")

    reached("started")
    strategy = tf_agn.strategies.multi_worker_mirrored()
    reached("connected")
    rng = np.random.default_rng(0)
    rows = FLAGS.batch_size * FLAGS.steps_per_epoch
    x = rng.normal(size=(rows, 784)).astype("float32")
    y = rng.integers(0, 10, rows)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf_agn.models.mlp((784,), 10, hidden_units=[int(u) for u in FLAGS.units])
        model.compile(optimizer=tf_agn.optimizers.Adam(1e-4),
                      loss="sparse_categorical_crossentropy")
    reached("built")
    steps = open(os.path.join(FLAGS.workdir, f"steps-{index}-{attempt}.txt"), "a", buffering=1)
    # A batch a resumed fit skips reaches callbacks with empty logs: only
    # a trained step is logged (logging the skipped ones counted the
    # resumed step as trained twice at every mid-epoch restart).
    def trained(batch, logs):
        if logs:
            if steps.tell() == 0:
                reached("stepped")
            steps.write(f"{int(model.optimizer.iterations.numpy())}\n")

    log = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: reached("restored"), on_train_batch_end=trained
    )
    backup = tf_agn.callbacks.BackupAndRestore(
        os.path.join(FLAGS.workdir, "backup"), save_freq=FLAGS.save_freq or "epoch",
        preemption_notice=signal.SIGTERM if FLAGS.notices else None,
        keep_last_steps=FLAGS.rescues,
    )
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, shuffle=False,
              verbose=0, callbacks=[backup, log])
    if index == 0:
        np.savez(os.path.join(FLAGS.workdir, "weights.npz"), *model.get_weights())
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's teardown takes seconds; every peer is done


def _deliver(kind, pid):
    """Sends fault `kind` to `pid`, and what follows it later."""
    signum = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}
    os.kill(pid, signum[kind])
    follow = {"sigterm": (FLAGS.notice_s, signal.SIGKILL), "sigstop": (FLAGS.stop_s, signal.SIGCONT)}
    if kind in follow:
        delay, then = follow[kind]

        def later():
            time.sleep(delay)
            try:
                os.kill(pid, then)
            except ProcessLookupError:
                pass

        threading.Thread(target=later, daemon=True).start()


def _stopped(pid):
    """Whether process `pid` is stopped (SIGSTOP) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in "Tt"
    except OSError:
        return True


def run_job(kind, recipe, rng):
    """One job; returns its measures, and its weights for comparison."""
    import numpy as np

    workdir = tempfile.mkdtemp(prefix=f"tf_agn-chaos-{kind}-{recipe}-")
    env = launched.cluster_env()
    hang = HANG_TIMEOUT_S if recipe == "tf_agn" else 0
    command = [
        sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "3",
        "--max_restarts", "1000", "--hang_timeout", str(hang), "--",
        sys.executable, os.path.abspath(__file__), f"--workdir={workdir}",
        f"--notices={recipe == 'tf_agn'}", f"--rescues={recipe == 'tf_agn'}",
        f"--epochs={FLAGS.epochs}",
        f"--steps_per_epoch={FLAGS.steps_per_epoch}",
        f"--save_freq={0 if recipe == 'backups_epoch' else FLAGS.save_freq}",
        f"--units={','.join(FLAGS.units)}", f"--batch_size={FLAGS.batch_size}",
    ]
    start = time.monotonic()
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = []  # the launcher's lines, each after the time.time() it came at

    def read():
        for line in launcher.stdout:
            output.append(f"{time.time():.3f} {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        next_fault = start + FLAGS.interval
        while launcher.poll() is None:
            if kind != "none" and sent < FLAGS.faults and time.monotonic() >= next_fault:
                # A worker stopped by an earlier SIGSTOP, not yet found
                # hung, is no target: a fault there would change nothing.
                workers = {pid: index for pid, index in
                           launched.launcher_workers(launcher.pid).items() if not _stopped(pid)}
                if workers:
                    pid = rng.choice(sorted(workers))
                    output.append(f"{time.time():.3f} chaos: {kind} to pid {pid} (worker "
                                  f"{workers[pid]}) at {time.monotonic() - start:.1f} s\n")
                    _deliver(kind, pid)
                    sent += 1
                    next_fault += FLAGS.interval
            time.sleep(0.1)
        wall = time.monotonic() - start
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(5)
    text = "".join(output)
    if launcher.returncode != 0:
        raise RuntimeError(f"{kind}/{recipe} exited with {launcher.returncode}:\n{text[-3000:]}")
    twice = _steps_trained_twice(workdir)
    restarts = _restart_phases(workdir, text)
    with np.load(os.path.join(workdir, "weights.npz")) as npz:
        weights = [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]
    if FLAGS.logdir:
        kept = os.path.join(FLAGS.logdir, os.path.basename(workdir))
        os.makedirs(kept)
        with open(os.path.join(kept, "launcher.log"), "w") as f:
            f.write(text)
        for name in os.listdir(workdir):
            if name.startswith(("steps-", "phases-")):
                os.rename(os.path.join(workdir, name), os.path.join(kept, name))
    subprocess.run(["rm", "-rf", workdir], check=False)
    return {
        "kind": kind, "recipe": recipe, "faults": sent, "wall": wall,
        "restarts": text.count("restarting every worker (restart"),
        "preemptions": text.count("(not counted as a failure)"),
        "twice": twice,
        "phases": restarts,
        "resizes": text.count("dropped;"),
    }, weights


def _steps_trained_twice(workdir):
    """Steps every worker of an attempt completed (its steps files, one per
    worker and attempt) that a later attempt trained again."""
    steps = {}  # attempt -> [each worker's set of completed steps]
    for name in os.listdir(workdir):
        if name.startswith("steps-"):
            _, _, attempt = name[: -len(".txt")].split("-")
            with open(os.path.join(workdir, name)) as f:
                steps.setdefault(int(attempt), []).append(set(f.read().split()))
    twice = set()
    for attempt, workers in steps.items():
        completed = set.intersection(*workers)
        later = set().union(*(s for a, ws in steps.items() if a > attempt for s in ws))
        twice |= completed & later
    return len(twice)


def _restart_phases(workdir, text):
    """Each restart that followed a fault: seconds from the fault to the
    launcher's restart of every worker (`restarted`: the survivors saved and
    exited), then to each of `PHASES`, the slowest worker's."""
    reached = {}  # attempt -> phase -> the slowest worker's time
    for name in os.listdir(workdir):
        if name.startswith("phases-"):
            _, _, attempt = name[: -len(".txt")].split("-")
            times = reached.setdefault(int(attempt), {})
            with open(os.path.join(workdir, name)) as f:
                for line in f:
                    phase, at = line.split()
                    times[phase] = max(times.get(phase, 0.0), float(at))
    restarts, fault, group = [], None, 0
    for line in text.splitlines():
        stamp, _, said = line.partition(" ")
        if said.startswith("chaos: "):
            fault = float(stamp)
        elif "restarting every worker" in said:
            group += 1  # the attempt (TF_AGN_RESTART_COUNT) it starts
            times = reached.get(group, {})
            if fault is not None and all(phase in times for phase in PHASES):
                restarts.append({"restarted": float(stamp) - fault,
                                 **{phase: times[phase] - fault for phase in PHASES}})
            fault = None
    return restarts


def main(argv):
    del argv
    if FLAGS.workdir:
        worker_main()
        return
    import numpy as np

    rng = random.Random(FLAGS.seed)
    print(f"tf_agn chaos: 3 workers on localhost, {os.cpu_count()} CPUs, MLP "
          f"784-{'-'.join(FLAGS.units)}-10, {FLAGS.epochs} x {FLAGS.steps_per_epoch} steps, "
          f"a fault every {FLAGS.interval:g} s, {FLAGS.faults} a job", flush=True)
    # The faster of two clean jobs: the first also pays for cold caches.
    cleans = [run_job("none", "tf_agn", rng) for _ in range(2)]
    clean, clean_weights = min(cleans, key=lambda job: job[0]["wall"])
    step_ms = 1000 * clean["wall"] / (FLAGS.epochs * FLAGS.steps_per_epoch)
    same = all(np.array_equal(a, b) for a, b in zip(cleans[0][1], cleans[1][1]))
    walls = ", ".join(f"{job['wall']:.1f}" for job, _ in cleans)
    print(f"clean: {walls} s; the faster is "
          f"the reference ({step_ms:.0f} ms a step with start-up); the two clean jobs' "
          f"weights are {'bitwise equal' if same else 'DIFFERENT'}", flush=True)
    print("| fault | recipe | faults | wall s | goodput | s a fault | restarts | uncounted | "
          "steps twice | max abs(w - clean) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ours, timed = {}, []
    for kind in FLAGS.kinds:
        for recipe in FLAGS.recipes:
            job, weights = run_job(kind, recipe, rng)
            job["goodput"] = clean["wall"] / job["wall"]
            job["cost"] = (job["wall"] - clean["wall"]) / max(job["faults"], 1)
            job["difference"] = max(
                float(np.abs(a - b).max()) for a, b in zip(weights, clean_weights)
            )
            print(f"| {kind} | {recipe} | {job['faults']} | {job['wall']:.1f} | "
                  f"{job['goodput']:.2f} | {job['cost']:.1f} | {job['restarts']} | "
                  f"{job['preemptions']} | {job['twice']} | {job['difference']:.3g} |",
                  flush=True)
            timed.append(job)
            if recipe == "tf_agn":
                ours[kind] = job
    # Where a fault's time goes: after the fault, the launcher restarts
    # every worker once the survivors saved and exited, then each new
    # worker reaches each phase.
    print("\nA restart's phases, median seconds after the fault (the slowest worker):")
    print("| fault | recipe | restarts timed | restarted | " + " | ".join(PHASES) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(PHASES))
    for job in timed:
        medians = [statistics.median(restart[name] for restart in job["phases"])
                   if job["phases"] else float("nan") for name in ("restarted", *PHASES)]
        print(f"| {job['kind']} | {job['recipe']} | {len(job['phases'])} | "
              + " | ".join(f"{m:.1f}" for m in medians) + " |", flush=True)
    for kind, job in ours.items():
        checks = [("no step trained twice", job["twice"] == 0),
                  ("weights bitwise", job["difference"] == 0)]
        if kind in ("sigkill", "sigterm"):
            checks.append((f"goodput >= 0.85 (a fault every {FLAGS.interval:g} s)",
                           job["goodput"] >= 0.85))
        if kind == "sigstop" and "sigkill" in ours:
            # A restart's cost is what a SIGKILL costs.
            bound = HANG_TIMEOUT_S + ours["sigkill"]["cost"]
            checks.append((f"a fault costs <= detection + a restart ({bound:.1f} s)",
                           job["cost"] <= bound))
        for name, ok in checks:
            print(f"{'PASS' if ok else 'FAIL'}: {kind}: {name}")


if __name__ == "__main__":
    app.run(main)
