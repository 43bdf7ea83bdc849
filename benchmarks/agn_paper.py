r"""Reproduces the AGN paper's findings (Hermans et al., 2017) where it can.

The paper trains an MLP on MNIST with n asynchronous workers, each with its
own Adam, for 40 epochs in total split over the n workers (so every run
does the same work). Four experiments (`--experiments`):

- `divergence`: DOWNPOUR against AGN at n = 10 and n = 20, same λ and
  learning rate, from the same initial weights. The paper saw DOWNPOUR
  diverge at n = 20. By default (`--divergence_runtime=cluster`) on a real
  processes-mode `LocalCluster`: one process per worker and ps, the
  workers as fast as the machine lets them, the center evaluated after
  every n windows while they go on. `--divergence_runtime=simulator` runs
  the deterministic simulator (`tf_agn.strategies.simulate`) with a
  round-robin commit order instead: every commit exactly n − 1 stale, the
  paper's model of n workers of equal speed. Time is counted in rounds:
  one round is n commits. PASS if DOWNPOUR at n = 20 diverges or stalls
  (final test accuracy < 0.5, or non-finite weights) while AGN reaches
  >= 0.90.
- `grid`: over n × λ, the temporal efficiency E(AGN, AEASGD) and
  E(AGN, DynSGD) (`tf_agn.metrics.temporal_efficiency`) of the training
  accuracy (on a fixed training subset) over time, in the round-robin
  simulator. Within a cell every algorithm takes λ steps per commit, so
  time in rounds is fair to all of them. Every worker runs Adam, AEASGD's
  included (with the paper's ρ = 5, η = 0.01, so α = 0.05);
  `--aeasgd_optimizer=sgd` gives AEASGD plain SGD(η = 0.01). PASS if AGN
  wins (E > 1) in >= 70% of the cells against AEASGD (the paper: 69.73%
  of its 7 × 7 grid).
- `scaling`: commits per second applied by a real parameter server (a
  threads-mode `LocalCluster`, so that 64 workers fit in memory), AGN with
  λ = 1 on a small MLP so that commits dominate, for n from 1 to 64, with
  the CPU cores the whole cluster keeps busy. The paper's Python-thread
  server stopped scaling at n = 30. PASS if the rate still grows past 30
  workers, or if it stops where the machine's cores are saturated (then
  the plot shows where, and the CPU columns why: the machine, not the
  server); FAIL if it stops with cores to spare.
- `staleness`: the measured staleness of every applied commit per
  algorithm (AGN, DOWNPOUR, DynSGD) and n on a real threads-mode cluster,
  against the paper's E[τ] = n − 1 (and the simulator's round robin, which
  gives exactly n − 1 after the first round). PASS if every measured mean
  is within 50% of n − 1.

Every simulated run takes the paper's budget, 40 epochs split over the n
workers, but at least `--min_rounds` windows per worker (see
`num_windows`).

Every real-cluster run happens in a fresh subprocess (this script with the
hidden `--cluster_run` flag, answering one JSON line): a connected
`ParameterServerStrategy` is for the life of a process.

It writes `results.md` (tables and every PASS/FAIL line), `results.json`
and, with matplotlib (the `[bench]` extra), one PNG per experiment into
`--results_dir`.

Usage:

    python benchmarks/agn_paper.py --small           # about 35 minutes in all
    python benchmarks/agn_paper.py --smoke           # CI, about two minutes
    python benchmarks/agn_paper.py --model=paper     # the paper's grid
    python benchmarks/agn_paper.py --experiments=scaling --small
"""

import collections
import importlib.util
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402

EXPERIMENTS = ("divergence", "grid", "scaling", "staleness")
HIDDEN_UNITS = {"paper": (1000, 2000, 1000), "small": (256, 128)}
# The scaling runs time the server, not the model: a tiny MLP.
SCALING_HIDDEN_UNITS = (64,)
PAPER_WIN_SHARE = 0.6973
PAPER_SCALING_LIMIT = 30
DIVERGENCE_ALGORITHMS = ("downpour", "agn", "agn_scaled")
GRID_ALGORITHMS = ("agn", "agn_scaled", "aeasgd", "dynsgd")
# (a, b): the grid reports E(a, b) per cell and the share of cells a wins.
GRID_COMPARISONS = (("agn", "aeasgd"), ("agn", "dynsgd"), ("agn_scaled", "aeasgd"))
NAMES = {
    "agn": "AGN",
    "agn_scaled": "AGN-scaled",
    "aeasgd": "AEASGD",
    "dynsgd": "DynSGD",
    "downpour": "DOWNPOUR",
}
RUNTIMES = {
    "cluster": "real multi-process cluster",
    "simulator": "simulator, round robin",
}

FLAGS = flags.FLAGS
flags.DEFINE_list("experiments", list(EXPERIMENTS), "Experiments to run.")
flags.DEFINE_bool(
    "small", False, "A 2 x 3 grid (about 20 minutes on 2 cores), n up to 64."
)
flags.DEFINE_bool("smoke", False, "A tiny setting for CI (about two minutes).")
flags.DEFINE_enum(
    "model",
    "small",
    list(HIDDEN_UNITS),
    "paper: 784-1000-2000-1000-10; small: 784-256-128-10.",
)
flags.DEFINE_string("results_dir", "benchmarks/results", "Where outputs go.")
flags.DEFINE_integer("seed", 0, "Seeds weights, data order and the split.")
flags.DEFINE_integer("batch_size", 128, "Every worker's batch size.", 1)
flags.DEFINE_float("learning_rate", 1e-3, "The workers' Adam learning rate.")
flags.DEFINE_integer("epochs", 40, "Epochs in total, split over the n workers.", 1)
flags.DEFINE_integer("local_steps", 10, "λ of the divergence and staleness runs.", 1)
flags.DEFINE_integer(
    "min_rounds", 8, "Windows per worker at least, in every simulated run.", 1
)
flags.DEFINE_list("grid_workers", None, "The grid's n values; default: the setting's.")
flags.DEFINE_list(
    "grid_local_steps", None, "The grid's λ values; default: the setting's."
)
flags.DEFINE_enum(
    "aeasgd_optimizer",
    "adam",
    ["adam", "sgd"],
    "AEASGD's worker optimizer: adam, as every other worker; sgd: SGD(0.01).",
)
flags.DEFINE_enum(
    "divergence_runtime",
    "cluster",
    list(RUNTIMES),
    "cluster: one process per worker and ps; simulator: staleness exactly n − 1.",
)
flags.DEFINE_string(
    "cluster_run", None, "Internal: run one real-cluster measurement (JSON)."
)

# The sizes of the experiments: the paper's, `--small` and `--smoke`.
Setting = collections.namedtuple(
    "Setting",
    [
        "divergence_workers",
        "grid_workers",
        "grid_local_steps",
        "scaling_workers",
        "staleness_workers",
        "staleness_algorithms",
        "epochs",  # None: --epochs
        "cluster_windows",  # windows per epoch of a real-cluster run, per worker
    ],
)
PAPER_GRID = tuple(range(10, 45, 5))
ALL_STALENESS_ALGORITHMS = ("agn", "downpour", "dynsgd")
SETTINGS = {
    "paper": Setting(
        divergence_workers=(10, 20),
        grid_workers=PAPER_GRID,
        grid_local_steps=PAPER_GRID,
        scaling_workers=(1, 2, 4, 8, 16, 32, 64),
        staleness_workers=(2, 4, 8),
        staleness_algorithms=ALL_STALENESS_ALGORITHMS,
        epochs=None,
        cluster_windows=8,
    ),
    "small": Setting(
        divergence_workers=(10, 20),
        grid_workers=(10, 25),
        grid_local_steps=(10, 25, 40),
        scaling_workers=(1, 2, 4, 8, 16, 32, 64),
        staleness_workers=(2, 4, 8),
        staleness_algorithms=ALL_STALENESS_ALGORITHMS,
        epochs=None,
        cluster_windows=4,
    ),
    # CI: it must run every code path, not reproduce anything.
    "smoke": Setting(
        divergence_workers=(2,),
        grid_workers=(2,),
        grid_local_steps=(5,),
        scaling_workers=(1, 2),
        staleness_workers=(2,),
        staleness_algorithms=("agn",),
        epochs=2,
        cluster_windows=2,
    ),
}


def setting():
    if FLAGS.smoke:
        return SETTINGS["smoke"]
    return SETTINGS["small" if FLAGS.small else "paper"]


# Data and models -------------------------------------------------------------


class Data:
    """mnist5k, its test set, and a fixed training subset to evaluate on."""

    TRAIN_EVAL_SIZE = 1000

    def __init__(self, seed):
        (self.x_train, self.y_train), (self.x_test, self.y_test) = tf_agn.datasets.load(
            "mnist5k", seed=seed
        )
        self.x_train_eval = self.x_train[: self.TRAIN_EVAL_SIZE]
        self.y_train_eval = self.y_train[: self.TRAIN_EVAL_SIZE]

    @property
    def steps_per_epoch(self):
        return len(self.x_train) // FLAGS.batch_size

    def dataset(self, seed=None):
        """Shuffled, repeated batches; `seed` None shuffles unseeded."""
        return (
            tf.data.Dataset.from_tensor_slices((self.x_train, self.y_train))
            .shuffle(len(self.x_train), seed=seed)
            .repeat()
            .batch(FLAGS.batch_size, drop_remainder=True)
        )


def make_optimizer(algorithm, local_steps):
    """A windowed optimizer whose workers run Adam, as in the paper."""
    adam = keras.optimizers.Adam(FLAGS.learning_rate)
    if algorithm == "aeasgd":
        # The paper's elastic force: ρ = 5, η = 0.01, so α = 0.05; None
        # is AEASGD's own inner SGD(η).
        inner = adam if FLAGS.aeasgd_optimizer == "adam" else None
        return tf_agn.optimizers.AEASGD(inner, local_steps=local_steps)
    if algorithm == "agn_scaled":
        return tf_agn.optimizers.AGN(
            adam, local_steps=local_steps, staleness_scaling=True
        )
    windowed = {
        "agn": tf_agn.optimizers.AGN,
        "downpour": tf_agn.optimizers.DOWNPOUR,
        "dynsgd": tf_agn.optimizers.DynSGD,
    }[algorithm]
    return windowed(adam, local_steps=local_steps)


def make_model(algorithm, local_steps, hidden_units):
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial center for all
    model = tf_agn.models.mlp((784,), 10, hidden_units=hidden_units)
    model.compile(
        optimizer=make_optimizer(algorithm, local_steps),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def num_windows(data, num_workers, local_steps):
    """The paper's budget, `epochs` passes over the data split over the n
    workers, but at least `--min_rounds` windows per worker.

    The paper's 40 epochs of 60,000 images give every cell of its grid at
    least 11 rounds; 40 epochs of our 5,000 would give n = λ = 40 a single
    round, too short to compare anything.
    """
    epochs = setting().epochs or FLAGS.epochs
    return max(
        FLAGS.min_rounds * num_workers, epochs * data.steps_per_epoch // local_steps
    )


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model(x, training=False), axis=-1) == y))


class Curves:
    """The center's accuracy after every round of n commits.

    Time is counted in rounds, the time n workers of equal speed take for
    one window each, and in wall-clock seconds since the curves began.
    """

    def __init__(self, data, model, num_workers, total_windows):
        self.data = data
        self.model = model
        self.num_workers = num_workers
        self.total_windows = total_windows
        self.start = time.perf_counter()
        self.curves = {
            "time": [],
            "seconds": [],
            "test_accuracy": [],
            "train_accuracy": [],
        }
        self.record(0)

    def record(self, commits):
        self.curves["time"].append(commits / self.num_workers)
        self.curves["seconds"].append(time.perf_counter() - self.start)
        data = self.data
        self.curves["test_accuracy"].append(
            accuracy(self.model, data.x_test, data.y_test)
        )
        self.curves["train_accuracy"].append(
            accuracy(self.model, data.x_train_eval, data.y_train_eval)
        )

    def after_window(self, window_index):
        windows = window_index + 1
        if windows % self.num_workers == 0 or windows == self.total_windows:
            self.record(windows)

    def result(self, staleness_mean):
        weights = self.model.get_weights()
        return dict(
            self.curves,
            finite=all(bool(np.all(np.isfinite(w))) for w in weights),
            staleness_mean=staleness_mean,
            windows=self.total_windows,
        )


# The simulator ---------------------------------------------------------------


def simulated_run(data, algorithm, num_workers, local_steps):
    """Trains in the round-robin simulator, every commit n − 1 stale.

    Returns:
        The `Curves` result: "time" (rounds), "seconds", "test_accuracy",
        "train_accuracy", "finite" (the center's weights at the end),
        "staleness_mean" and "windows".
    """
    model = make_model(algorithm, local_steps, HIDDEN_UNITS[FLAGS.model])
    windows = num_windows(data, num_workers, local_steps)
    curves = Curves(data, model, num_workers, windows)
    simulation = tf_agn.strategies.simulate(
        model,
        # Each worker its own seeded order of the data.
        lambda context: data.dataset(seed=FLAGS.seed * 1000 + context.input_pipeline_id),
        num_workers,
        windows,
        order="round_robin",
        callback=curves.after_window,
    )
    return curves.result(simulation.staleness.mean)


def run_divergence(data):
    """DOWNPOUR and AGN at every n, on the real cluster or in the simulator."""
    runtime = FLAGS.divergence_runtime
    runs = {}
    for num_workers in setting().divergence_workers:
        start = time.perf_counter()
        if runtime == "cluster":
            pair = in_fresh_process(
                run="divergence",
                num_workers=num_workers,
                local_steps=FLAGS.local_steps,
                hidden_units=HIDDEN_UNITS[FLAGS.model],
            )
        else:
            pair = {
                algorithm: simulated_run(
                    data, algorithm, num_workers, FLAGS.local_steps
                )
                for algorithm in DIVERGENCE_ALGORITHMS
            }
        for algorithm, run in pair.items():
            runs[f"{algorithm}_n{num_workers}"] = run
            print(
                f"  divergence ({runtime}) {algorithm} n={num_workers}: test "
                f"accuracy {run['test_accuracy'][-1]:.3f}, train "
                f"{run['train_accuracy'][-1]:.3f}, mean staleness "
                f"{run['staleness_mean']:.1f}",
                flush=True,
            )
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    largest = max(setting().divergence_workers)
    downpour = runs[f"downpour_n{largest}"]
    agn = runs[f"agn_n{largest}"]
    downpour_final = downpour["test_accuracy"][-1]
    agn_final = agn["test_accuracy"][-1]
    passed = (downpour_final < 0.5 or not downpour["finite"]) and agn_final >= 0.90
    verdict = (
        f"{'PASS' if passed else 'FAIL'}: {RUNTIMES[runtime]}, n = {largest}, "
        f"λ = {FLAGS.local_steps}: DOWNPOUR final test accuracy "
        f"{downpour_final:.3f} (finite: {downpour['finite']}; target < 0.5 or "
        f"non-finite), AGN {agn_final:.3f} (target >= 0.90)."
    )
    scaled_final = runs[f"agn_scaled_n{largest}"]["test_accuracy"][-1]
    verdict += (
        f" Beyond the paper: AGN with staleness scaling {scaled_final:.3f} "
        f"(>= 0.90: {'yes' if scaled_final >= 0.90 else 'no'})."
    )
    return {"runtime": runtime, "runs": runs, "passed": passed, "verdict": verdict}


def grid_axis(flag_values, default):
    """The grid's values on one axis: the flag's, else the setting's."""
    if not flag_values:
        return default
    try:
        values = [int(value) for value in flag_values]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise app.UsageError(
            f"Grid values must be integers >= 1; received {flag_values}."
        )
    return values


def run_grid(data):
    cells = []
    for num_workers in grid_axis(FLAGS.grid_workers, setting().grid_workers):
        for local_steps in grid_axis(
            FLAGS.grid_local_steps, setting().grid_local_steps
        ):
            start = time.perf_counter()
            curves = {
                algorithm: simulated_run(data, algorithm, num_workers, local_steps)
                for algorithm in GRID_ALGORITHMS
            }
            efficiency = {
                f"{a}_vs_{b}": tf_agn.metrics.temporal_efficiency(
                    *[(curves[x]["time"], curves[x]["train_accuracy"]) for x in (a, b)]
                )
                for a, b in GRID_COMPARISONS
            }
            cells.append(
                {
                    "num_workers": num_workers,
                    "local_steps": local_steps,
                    "efficiency": efficiency,
                    "final_train_accuracy": {
                        name: run["train_accuracy"][-1] for name, run in curves.items()
                    },
                }
            )
            print(
                f"  grid n={num_workers} λ={local_steps}: "
                + ", ".join(
                    f"E({NAMES[a]}, {NAMES[b]}) {efficiency[f'{a}_vs_{b}']:.3f}"
                    for a, b in GRID_COMPARISONS
                )
                + f" ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    shares = {
        key: float(np.mean([cell["efficiency"][key] > 1 for cell in cells]))
        for key in cells[0]["efficiency"]
    }
    passed = shares["agn_vs_aeasgd"] >= 0.70
    verdict = (
        f"{'PASS' if passed else 'FAIL'}: simulator, AGN beats AEASGD (E > 1) "
        f"in {shares['agn_vs_aeasgd']:.2%} of {len(cells)} cells (target >= "
        f"70%; the paper: {PAPER_WIN_SHARE:.2%} of 49); it beats DynSGD in "
        f"{shares['agn_vs_dynsgd']:.2%}. Beyond the paper: AGN with staleness "
        f"scaling beats AEASGD in {shares['agn_scaled_vs_aeasgd']:.2%}."
    )
    return {"cells": cells, "shares": shares, "passed": passed, "verdict": verdict}


# The real cluster --------------------------------------------------------------


def rate_run(spec):
    """One real-cluster measurement; runs in a process of its own.

    A threads-mode `LocalCluster` of `num_workers` workers trains for 3
    epochs of `windows` windows; the first epoch (tracing, connections) is
    not timed. Returns, over the last two epochs, the commit rate, the CPU
    cores the cluster kept busy and its CPU time per commit; and the
    staleness of every applied commit.
    """
    logging.set_verbosity(logging.WARNING)
    data = Data(FLAGS.seed)
    # (wall-clock, CPU time of this process) at every epoch's end. In
    # threads mode every server runs in this process, so its CPU time is
    # the whole cluster's.
    epoch_ends = []
    timer = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: epoch_ends.append(
            (time.perf_counter(), time.process_time())
        )
    )
    with tf_agn.strategies.LocalCluster(
        num_workers=spec["num_workers"], mode="threads"
    ) as cluster:
        strategy = tf_agn.strategies.parameter_server(cluster)
        with strategy.scope():
            model = make_model(
                spec["algorithm"], spec["local_steps"], tuple(spec["hidden_units"])
            )
        history = tf_agn.strategies.fit(
            model,
            lambda context: data.dataset(),  # unseeded: every worker its own order
            epochs=3,
            steps_per_epoch=spec["windows"] * spec["local_steps"],
            callbacks=[timer],
            verbose=0,
        )
    values, counts = history.staleness.histogram()
    timed_commits = 2 * spec["windows"]
    wall_seconds = epoch_ends[2][0] - epoch_ends[0][0]
    cpu_seconds = epoch_ends[2][1] - epoch_ends[0][1]
    return {
        "commits": int(history.server.commits.numpy()),
        "commits_per_second": timed_commits / wall_seconds,
        "cores_busy": cpu_seconds / wall_seconds,
        "cpu_ms_per_commit": 1000 * cpu_seconds / timed_commits,
        "staleness_values": values.tolist(),
        "staleness_counts": counts.tolist(),
        "staleness_mean": history.staleness.mean,
    }


def divergence_run(spec):
    """DOWNPOUR, then AGN, on one processes-mode cluster of n workers.

    Each trains from the same initial center for the paper's budget in one
    epoch (an epoch's end is a barrier, which would lower the staleness);
    the center is evaluated after every n fetched windows while the workers
    go on.
    """
    logging.set_verbosity(logging.WARNING)
    data = Data(FLAGS.seed)
    num_workers = spec["num_workers"]
    local_steps = spec["local_steps"]
    windows = num_windows(data, num_workers, local_steps)
    runs = {}
    # Starting n TensorFlow processes on a few cores takes minutes.
    with tf_agn.strategies.LocalCluster(
        num_workers=num_workers, mode="processes", start_timeout=60 + 30 * num_workers
    ) as cluster:
        strategy = tf_agn.strategies.parameter_server(cluster)
        for algorithm in DIVERGENCE_ALGORITHMS:
            with strategy.scope():
                model = make_model(algorithm, local_steps, tuple(spec["hidden_units"]))
            curves = Curves(data, model, num_workers, windows)
            history = tf_agn.strategies.fit(
                model,
                lambda context: data.dataset(),  # unseeded: every worker its own order
                epochs=1,
                steps_per_epoch=windows * local_steps,
                callbacks=[
                    keras.callbacks.LambdaCallback(
                        on_train_batch_end=lambda batch, logs: curves.after_window(
                            batch
                        )
                    )
                ],
                verbose=0,
            )
            runs[algorithm] = curves.result(history.staleness.mean)
    return runs


CLUSTER_RUNS = {"rate": rate_run, "divergence": divergence_run}


def in_fresh_process(**spec):
    """Runs `CLUSTER_RUNS[spec["run"]](spec)` in a subprocess; returns its
    JSON answer."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--cluster_run={json.dumps(spec)}",
        f"--seed={FLAGS.seed}",
        f"--batch_size={FLAGS.batch_size}",
        f"--learning_rate={FLAGS.learning_rate}",
        f"--epochs={setting().epochs or FLAGS.epochs}",
        f"--min_rounds={FLAGS.min_rounds}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        # The tail: gRPC logs every peer it can no longer reach at exit.
        raise RuntimeError(
            f"The cluster run {spec} failed:\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def available_cores():
    return len(os.sched_getaffinity(0))


# The share of the cores in use above which the machine counts as saturated.
SATURATED = 0.9


def run_scaling():
    runs = []
    for num_workers in setting().scaling_workers:
        run = in_fresh_process(
            run="rate",
            algorithm="agn",
            num_workers=num_workers,
            local_steps=1,
            windows=setting().cluster_windows * num_workers,
            hidden_units=SCALING_HIDDEN_UNITS,
        )
        run["num_workers"] = num_workers
        runs.append(run)
        print(
            f"  scaling n={num_workers}: {run['commits_per_second']:.1f} "
            f"commits/s, {run['cores_busy']:.2f} cores busy, "
            f"{run['cpu_ms_per_commit']:.1f} CPU ms per commit",
            flush=True,
        )
    return {"runs": runs, **scaling_verdict(runs, available_cores())}


def scaling_verdict(runs, cores):
    """Does the rate grow past the paper's limit, or is its stop explained?

    The rate is (cores busy) / (CPU time per commit). Where the rate peaks
    with the cores saturated, adding workers cannot add commits: the stop
    is this machine's CPU, not the server. A peak with idle cores would be
    a server limit like the paper's, and fails.
    """
    rates = [run["commits_per_second"] for run in runs]
    peak = runs[int(np.argmax(rates))]
    beyond = [r for r in runs if r["num_workers"] > PAPER_SCALING_LIMIT]
    below = [r for r in runs if r["num_workers"] <= PAPER_SCALING_LIMIT]
    grows = bool(beyond) and max(r["commits_per_second"] for r in beyond) > max(
        r["commits_per_second"] for r in below
    )
    saturated = peak["cores_busy"] >= SATURATED * cores
    passed = grows or (saturated and peak is not runs[-1])
    measured = (
        f"peak {peak['commits_per_second']:.1f} commits/s at "
        f"n = {peak['num_workers']} with {peak['cores_busy']:.2f} of {cores} "
        f"cores busy ({peak['cpu_ms_per_commit']:.1f} CPU ms per commit; "
        f"{runs[-1]['cpu_ms_per_commit']:.1f} at n = {runs[-1]['num_workers']})"
    )
    if grows:
        verdict = (
            f"PASS: the commit rate still grows past {PAPER_SCALING_LIMIT} "
            f"workers: {measured}."
        )
    elif peak is runs[-1]:
        verdict = (
            f"FAIL: measured only up to n = {peak['num_workers']}, where the "
            f"rate still grows: {measured}."
        )
    elif saturated:
        verdict = (
            f"PASS (stop explained): the rate stops growing at n = "
            f"{peak['num_workers']} because the machine's CPU is saturated, "
            f"not the server: {measured}. Past the peak the rate falls as the "
            f"CPU time per commit grows (a coordinator thread and a server "
            f"per worker share the same {cores} cores); the paper's "
            f"Python-thread server stopped at {PAPER_SCALING_LIMIT}."
        )
    else:
        verdict = (
            f"FAIL: the rate stops growing at n = {peak['num_workers']} with "
            f"cores to spare (below {SATURATED:.0%} busy), a server limit: "
            f"{measured}."
        )
    return {"passed": passed, "verdict": verdict}


def run_staleness():
    runs = []
    for num_workers in setting().staleness_workers:
        for algorithm in setting().staleness_algorithms:
            run = in_fresh_process(
                run="rate",
                algorithm=algorithm,
                num_workers=num_workers,
                local_steps=FLAGS.local_steps,
                windows=setting().cluster_windows * num_workers,
                hidden_units=HIDDEN_UNITS[FLAGS.model],
            )
            run.update(algorithm=algorithm, num_workers=num_workers)
            runs.append(run)
            print(
                f"  staleness {algorithm} n={num_workers}: mean "
                f"{run['staleness_mean']:.2f} (paper's n − 1 = {num_workers - 1})",
                flush=True,
            )
    ratios = [run["staleness_mean"] / (run["num_workers"] - 1) for run in runs]
    passed = all(0.5 <= ratio <= 1.5 for ratio in ratios)
    verdict = (
        f"{'PASS' if passed else 'FAIL'}: real threads-mode cluster, measured "
        f"mean staleness / (n − 1) from {min(ratios):.2f} to {max(ratios):.2f} "
        f"(target: every one in [0.5, 1.5]; the simulator's round robin gives "
        f"exactly n − 1 after the first round)."
    )
    return {"runs": runs, "passed": passed, "verdict": verdict}


# Reports -----------------------------------------------------------------------


def markdown(results):
    """results.md: a section per experiment, its table and its verdict."""
    lines = [
        "# AGN paper findings",
        "",
        f"Setting: {results['config']['setting']}; model "
        f"{results['config']['model']} {results['config']['hidden_units']}; "
        f"batch {FLAGS.batch_size}; Adam learning rate {FLAGS.learning_rate}; "
        f"{results['config']['epochs']} epochs split over the n workers; "
        f"{results['config']['cpu_count']} CPU cores; TensorFlow {tf.__version__}.",
    ]
    if "divergence" in results:
        lines += [
            "",
            f"## Divergence ({RUNTIMES[results['divergence']['runtime']]})",
            "",
            "| algorithm | n | λ | windows | mean staleness | best test acc. "
            "| final test acc. | final train acc. | finite |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, run in results["divergence"]["runs"].items():
            algorithm, num_workers = name.split("_n")
            lines.append(
                f"| {algorithm} | {num_workers} | {FLAGS.local_steps} | "
                f"{run['windows']} | {run['staleness_mean']:.1f} | "
                f"{max(run['test_accuracy']):.3f} | "
                f"{run['test_accuracy'][-1]:.3f} | "
                f"{run['train_accuracy'][-1]:.3f} | {run['finite']} |"
            )
        lines += ["", results["divergence"]["verdict"]]
    if "grid" in results:
        lines += [
            "",
            "## Grid (simulator, round robin; AEASGD's workers run "
            f"{results['config']['aeasgd_optimizer']})",
            "",
            "| n | λ | "
            + " | ".join(f"E({NAMES[a]}, {NAMES[b]})" for a, b in GRID_COMPARISONS)
            + " | final train acc. "
            + " / ".join(NAMES[a] for a in GRID_ALGORITHMS)
            + " |",
            "|---|---|" + "---|" * (len(GRID_COMPARISONS) + 1),
        ]
        for cell in results["grid"]["cells"]:
            final = cell["final_train_accuracy"]
            lines.append(
                f"| {cell['num_workers']} | {cell['local_steps']} | "
                + " | ".join(f"{e:.3f}" for e in cell["efficiency"].values())
                + " | "
                + " / ".join(f"{final[a]:.3f}" for a in GRID_ALGORITHMS)
                + " |"
            )
        lines += ["", results["grid"]["verdict"]]
    if "scaling" in results:
        lines += [
            "",
            "## Scaling (real threads-mode cluster, AGN, λ = 1)",
            "",
            "| n | commits/s | CPU cores busy | CPU ms per commit |",
            "|---|---|---|---|",
        ]
        for run in results["scaling"]["runs"]:
            lines.append(
                f"| {run['num_workers']} | {run['commits_per_second']:.1f} | "
                f"{run['cores_busy']:.2f} of {results['config']['cpu_count']} | "
                f"{run['cpu_ms_per_commit']:.1f} |"
            )
        lines += ["", results["scaling"]["verdict"]]
    if "staleness" in results:
        lines += [
            "",
            f"## Staleness (real threads-mode cluster, λ = {FLAGS.local_steps})",
            "",
            "| algorithm | n | commits | mean staleness | paper's n − 1 | "
            "histogram (staleness: commits) |",
            "|---|---|---|---|---|---|",
        ]
        for run in results["staleness"]["runs"]:
            histogram = ", ".join(
                f"{v}: {c}"
                for v, c in zip(run["staleness_values"], run["staleness_counts"])
            )
            lines.append(
                f"| {run['algorithm']} | {run['num_workers']} | {run['commits']} | "
                f"{run['staleness_mean']:.2f} | {run['num_workers'] - 1} | "
                f"{histogram} |"
            )
        lines += ["", results["staleness"]["verdict"]]
    return "\n".join(lines) + "\n"


def plot(results, results_dir):
    """One small PNG per experiment; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    from matplotlib import pyplot

    written = []

    def save(figure, name):
        figure.tight_layout()
        figure.savefig(os.path.join(results_dir, name), dpi=72)
        pyplot.close(figure)
        written.append(name)

    if "divergence" in results:
        figure, axes = pyplot.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        largest = max(setting().divergence_workers)
        for name, run in results["divergence"]["runs"].items():
            algorithm, num_workers = name.split("_n")
            for ax, key in zip(axes, ("test_accuracy", "train_accuracy")):
                ax.plot(
                    run["time"],
                    run[key],
                    color=f"C{DIVERGENCE_ALGORITHMS.index(algorithm)}",
                    ls="-" if int(num_workers) == largest else "--",
                    label=f"{NAMES[algorithm]} n={num_workers}",
                )
        runtime = results["divergence"]["runtime"]
        for ax, title in zip(axes, ("test", "training subset")):
            ax.set(
                title=f"Center's {title} accuracy ({runtime}, "
                f"λ = {FLAGS.local_steps})",
                xlabel="rounds (n commits)",
                ylim=(0, 1),
            )
        axes[0].legend()
        save(figure, "divergence.png")
    if "grid" in results:
        cells = results["grid"]["cells"]
        workers = sorted({cell["num_workers"] for cell in cells})
        steps = sorted({cell["local_steps"] for cell in cells})
        figure, axes = pyplot.subplots(
            1, len(GRID_COMPARISONS), figsize=(4.5 * len(GRID_COMPARISONS), 3.5)
        )
        for ax, (a, b) in zip(axes, GRID_COMPARISONS):
            grid = np.full((len(workers), len(steps)), np.nan)
            for cell in cells:
                grid[
                    workers.index(cell["num_workers"]),
                    steps.index(cell["local_steps"]),
                ] = cell["efficiency"][f"{a}_vs_{b}"]
            image = ax.imshow(grid, cmap="RdBu", vmin=0, vmax=2, origin="lower")
            ax.set(
                title=f"E({NAMES[a]}, {NAMES[b]}) (simulator)",
                xlabel="λ",
                ylabel="n",
                xticks=range(len(steps)),
                xticklabels=steps,
                yticks=range(len(workers)),
                yticklabels=workers,
            )
            figure.colorbar(image, ax=ax)
        save(figure, "grid.png")
    if "scaling" in results:
        runs = results["scaling"]["runs"]
        workers = [run["num_workers"] for run in runs]
        cores = results["config"]["cpu_count"]
        figure, ax = pyplot.subplots(figsize=(5.5, 3.5))
        ax.plot(workers, [run["commits_per_second"] for run in runs], "o-")
        ax.set(
            xscale="log",
            xlabel="workers n",
            ylabel="commits / s",
            title=f"Threads-mode PS on {cores} CPU cores",
        )
        ax.axvline(PAPER_SCALING_LIMIT, color="gray", ls=":", label="paper's limit")
        busy = ax.twinx()
        busy.plot(workers, [run["cores_busy"] for run in runs], "s--", color="C1")
        busy.axhline(cores, color="C1", ls=":")
        busy.set(ylabel="CPU cores busy", ylim=(0, cores * 1.15))
        busy.yaxis.label.set_color("C1")
        ax.legend(loc="lower right")
        save(figure, "scaling.png")
    if "staleness" in results:
        runs = results["staleness"]["runs"]
        figure, ax = pyplot.subplots(figsize=(5, 3.5))
        for algorithm in setting().staleness_algorithms:
            mine = [run for run in runs if run["algorithm"] == algorithm]
            ax.plot(
                [run["num_workers"] for run in mine],
                [run["staleness_mean"] for run in mine],
                marker="o",
                label=algorithm,
            )
        workers = sorted({run["num_workers"] for run in runs})
        ax.plot(workers, [n - 1 for n in workers], "k--", label="n − 1 (paper)")
        ax.set(xlabel="workers n", ylabel="mean staleness", title="Real cluster")
        ax.legend()
        save(figure, "staleness.png")
    return written


def main(argv):
    del argv
    if FLAGS.cluster_run:
        spec = json.loads(FLAGS.cluster_run)
        print(json.dumps(CLUSTER_RUNS[spec["run"]](spec)))
        return
    unknown = set(FLAGS.experiments) - set(EXPERIMENTS)
    if unknown:
        raise app.UsageError(f"Unknown experiments {sorted(unknown)}.")
    for values in (FLAGS.grid_workers, FLAGS.grid_local_steps):
        grid_axis(values, ())  # bad values fail now, not after an hour
    tf.get_logger().setLevel("ERROR")
    os.makedirs(FLAGS.results_dir, exist_ok=True)
    data = Data(FLAGS.seed)
    results = {
        "config": {
            "setting": "smoke" if FLAGS.smoke else "small" if FLAGS.small else "paper",
            "model": FLAGS.model,
            "hidden_units": list(HIDDEN_UNITS[FLAGS.model]),
            "batch_size": FLAGS.batch_size,
            "learning_rate": FLAGS.learning_rate,
            "aeasgd_optimizer": FLAGS.aeasgd_optimizer,
            "epochs": setting().epochs or FLAGS.epochs,
            "local_steps": FLAGS.local_steps,
            "seed": FLAGS.seed,
            "cpu_count": available_cores(),
            "tensorflow": tf.__version__,
        }
    }
    runners = {
        "divergence": lambda: run_divergence(data),
        "grid": lambda: run_grid(data),
        "scaling": run_scaling,
        "staleness": run_staleness,
    }
    for name in EXPERIMENTS:
        if name in FLAGS.experiments:
            start = time.perf_counter()
            print(f"{name}:", flush=True)
            results[name] = runners[name]()
            print(
                f"  {results[name]['verdict']} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    with open(os.path.join(FLAGS.results_dir, "results.md"), "w") as f:
        f.write(markdown(results))
    with open(os.path.join(FLAGS.results_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed (the [bench] extra): tables only.")
    else:
        print(f"Plots: {', '.join(plot(results, FLAGS.results_dir))}")
    print(f"Results in {FLAGS.results_dir}")


if __name__ == "__main__":
    app.run(main)
