r"""What launching the gradient exchange during the backward pass saves,
timed across worker processes on shaped links.

Under `tf_agn.strategies.multi_worker_mirrored()` a Keras `fit` step
all-reduces its gradients in packs in backward order, each launched as
soon as its own gradients exist (`tests/test_overlap.py` reads it from the
traced step). Started without `TF_CONFIG`, this script runs itself as each
worker of a 2-worker cluster on localhost, each pinned to its own core and
sending through a link of `--mlp_link_mbit` or `--lm_link_mbit` Mbit/s
(`shaped_link.py`; root), on
`tf_agn.strategies.KerasMultiWorkerMirroredStrategy` with
`CommunicationOptions(bytes_per_pack=4 MiB)`, tf_agn's pack size; worker
0 prints the results.

Models (`--models`), trained by `model.fit` with Adam:

- `mlp`: 784-4096-4096-1024-10 (`--mlp_units`), ReLU (24.2M parameters),
  on random images, `--mlp_batch_size` per step over both workers;
- `lm`: `stdlib_text.py`'s byte Transformer, `--lm_d_model` wide, of
  `--lm_num_layers` blocks, on the standard library's sources,
  `--lm_batch_size` windows of `--context` bytes per step.

Candidates, each timed per step over `--steps` steps (a `fit` call from
the end of its first step until its last loss is read; or `--steps`
calls of a compiled function), in `--repeats` rounds whose order rotates,
the same on every worker:

- `compute`: `tf_agn.optimizers.Adam(aggregation_method="none")`, the step
  with nothing communicated;
- `forward`: the loss alone;
- `gradients`: the loss and its gradients, no update (the backward pass
  takes `gradients` − `forward`);
- `communication`: the exchange alone: `tf_agn.aggregate` (MEAN) of
  tensors shaped like the gradients, every pack as the optimizer sends it;
- `overlap`: `tf_agn.optimizers.Adam()`, tf_agn's all-reduce installed:
  packs in backward order, each launched when its gradients exist;
- `no_overlap`: the same, every gradient first made to wait for all the
  others (a control dependency), so that nothing is sent before the
  backward pass ends;
- `tf_collectives`: Keras's own `keras.optimizers.Adam` on the strategy's
  own `CollectiveAllReduce` (TensorFlow's collectives, the same
  `bytes_per_pack`).

The saving is `no_overlap` − `overlap` (the median over rounds of the
difference within a round). Verdicts, per model:

- (setup) `compute` takes `MIN_COMPUTE_SHARE` to `MAX_COMPUTE_SHARE` (0.3
  to 0.6) of `communication`'s time: pick the model's batch or link until
  it does;
- (target) the saving is at least `MIN_SAVED_SHARE` (half) of the smaller
  of the backward pass's time and `communication`'s.

It also prints each candidate's time as a share of `no_overlap`'s.

Each worker runs `--inter_op_threads` (2) inter-op threads on its one
core. A pack's collective launches when the one before it ends, on
TensorFlow's inter-op thread pool; with TensorFlow's default for one core,
a single thread, that launch waits for the kernel the thread is running (a
whole matmul of the MLP's backward pass) while the link idles.
`--inter_op_threads=0 --profile=mlp` shows it: with `--profile=MODEL`,
after MODEL's rounds each worker profiles one `fit` call of `no_overlap`
and of `overlap` (`step_profile.py`; one model a process, since a second
profile in one process crashed TensorFlow once in three runs), and
worker 0 prints a median step of each
(when each collective ran, and what the executor ran while none did) and,
with `--out` and matplotlib, draws both into `OUT_<model>_profile.png`.

Durations on 2 shared cores: about 12 minutes in all. Run it as root in
a network namespace of its own, as `streaming_diloco.py` says:

    unshare --net sh -c 'ip link set lo up && python benchmarks/overlap.py --profile=mlp \
        --out=benchmarks/results/overlap'
"""

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import shaped_link  # noqa: E402  (before TensorFlow: pins this worker to its core)

PINNED_CORE = shaped_link.pin_to_own_core()

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import allreduce  # noqa: E402  (rounds, ratios)
import multi_worker_allreduce  # noqa: E402  (--num_workers, our ops, fit timing)
import stdlib_text  # noqa: E402  (the language model and its data)
import step_profile  # noqa: E402  (what a profile says of a step)
import tf_agn  # noqa: E402
from tf_agn import _compat  # noqa: E402
from tf_agn.collectives.packing import DEFAULT_BYTES_PER_PACK  # noqa: E402
from tf_agn.strategies import launch  # noqa: E402

# Targets.
MIN_COMPUTE_SHARE, MAX_COMPUTE_SHARE = 0.3, 0.6  # compute / communication
MIN_SAVED_SHARE = 0.5  # of min(backward, communication)
# A model's link at 0 ("full speed") where another model's is shaped.
FULL_SPEED_MBIT = 100_000

MODELS = ("mlp", "lm")
PROFILED = ("no_overlap", "overlap")
CANDIDATES = (
    "compute", "forward", "gradients", "communication", "overlap", "no_overlap", "tf_collectives",
)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(MODELS), f"Models to time: {', '.join(MODELS)}.")
flags.DEFINE_integer(
    "mlp_link_mbit", 700, "Each worker's uplink for the MLP, Mbit/s (0: loopback at full speed)."
)
flags.DEFINE_integer(
    "lm_link_mbit", 250, "Each worker's uplink for the language model, Mbit/s (0: full speed)."
)
flags.DEFINE_list("mlp_units", ["4096", "4096", "1024"], "The MLP's hidden layers' widths.")
# The setup's batches: on the recording machine compute took 0.34 (MLP) and
# 0.37 of communication's time (at 64 and 8: 0.15 and 0.24).
flags.DEFINE_integer("mlp_batch_size", 512, "The MLP's images per step, over all workers.")
flags.DEFINE_integer("lm_batch_size", 16, "The language model's windows per step, over all workers.")
flags.DEFINE_integer("lm_d_model", 256, "The language model's width.")
flags.DEFINE_integer("lm_num_layers", 4, "The language model's Transformer blocks.")
flags.DEFINE_integer("steps", 4, "Timed steps per candidate and round.")
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps per candidate after tracing.")
flags.DEFINE_integer(
    "inter_op_threads", 2,
    "Each worker's TensorFlow inter-op threads (0: TensorFlow's default, one per core it may "
    "use: 1 here; see the docstring).",
)
flags.DEFINE_enum(
    "profile", None, list(MODELS),
    "After its rounds, profile one fit call of no_overlap and of overlap of this model; worker "
    "0 prints a median step of each and, with --out and matplotlib, draws them into "
    "OUT_<model>_profile.png.",
)
flags.DEFINE_string("out", "", "If set, worker 0 writes the results to OUT.json.")
FLAGS.set_default("repeats", 5)


class WaitingAdam(tf_agn.optimizers.Adam):
    """tf_agn's Adam whose exchange starts after the whole backward pass."""

    def apply(self, grads, trainable_variables=None):
        present = [g for g in grads if g is not None]
        with tf.control_dependencies(present):
            grads = [None if g is None else tf.identity(g) for g in grads]
        return super().apply(grads, trainable_variables)


def make_model(name):
    """The uncompiled model `name`, and its loss."""
    keras.utils.set_random_seed(0)
    if name == "mlp":
        layers = [keras.Input((784,))]
        layers += [keras.layers.Dense(int(units), activation="relu") for units in FLAGS.mlp_units]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
    else:
        model = stdlib_text.byte_transformer(
            FLAGS.context, FLAGS.lm_d_model, FLAGS.lm_num_layers, stdlib_text.NUM_HEADS
        )
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def training_data(strategy, name):
    """Endless distributed batches for model `name`."""
    if name == "lm":
        return stdlib_text.training_batches(
            strategy, stdlib_text.load_split("train"), FLAGS.context, FLAGS.lm_batch_size, 0
        )
    rng = np.random.default_rng(0)

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(FLAGS.mlp_batch_size)
        x = rng.standard_normal((batch, 784), dtype=np.float32)
        y = rng.integers(0, 10, batch).astype(np.int32)
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    return strategy.distribute_datasets_from_function(dataset_fn)


def optimizer_for(candidate):
    if candidate == "compute":
        return tf_agn.optimizers.Adam(aggregation_method="none")
    if candidate == "no_overlap":
        return WaitingAdam()
    if candidate == "tf_collectives":
        return keras.optimizers.Adam()
    return tf_agn.optimizers.Adam()


def fit_runner(strategy, name, candidate, data):
    """Builds, compiles and warms up `candidate`'s model; returns a function
    that times `--steps` steps of `fit` (seconds per step)."""
    with strategy.scope():
        model, loss = make_model(name)
        model.compile(optimizer_for(candidate), loss=loss)
    multi_worker_allreduce.fit_steps(model, data, FLAGS.warmup_steps)

    def run():
        timer = multi_worker_allreduce.CallTimer()
        multi_worker_allreduce.fit_steps(model, data, FLAGS.steps + 1, [timer])
        return timer.seconds / FLAGS.steps

    return run, model


def function_runner(step):
    """Warms up `step` (a compiled function); returns a function that times
    `--steps` calls of it (seconds per call)."""
    for _ in range(FLAGS.warmup_steps):
        step().numpy()

    def run():
        step().numpy()
        start = time.perf_counter()
        for _ in range(FLAGS.steps - 1):
            step()
        step().numpy()
        return (time.perf_counter() - start) / FLAGS.steps

    return run


def profiled_steps(runs):
    """Runs `runs` (candidates' timed `fit` calls) in one profile; returns
    the median `step_profile.Step` after the first of each call."""
    with tempfile.TemporaryDirectory() as logdir:
        # One profile for all: a second start and stop in one process can crash.
        with step_profile.recording(logdir):
            for run in runs:
                run()
        steps = step_profile.read_steps(logdir)
    calls = [steps[i + 1:i + FLAGS.steps + 1] for i in range(0, len(steps), FLAGS.steps + 1)]
    return [sorted(c, key=lambda step: step.duration)[len(c) // 2] for c in calls]


def loss_step(strategy, model, loss, data, gradients):
    """A compiled step of the loss of `model` on the next batch of `data`,
    and of its gradients if `gradients`; nothing is sent or updated."""
    iterator = iter(data)

    @tf.function
    def step():
        def replica(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            if not gradients:
                return value
            grads = tape.gradient(value, model.trainable_variables)
            return tf.add_n([tf.reshape(g, [-1])[0] for g in grads])

        results = strategy.run(replica, args=(next(iterator),))
        return strategy.experimental_local_results(results)[0]

    return step


def exchange_step(strategy, variables):
    @tf.function
    def step():
        def replica():
            tensors = [tf.ones(v.shape, v.dtype) for v in variables]
            combined = tf_agn.aggregate(tensors, "mean")
            return tf.add_n([tf.reshape(c, [-1])[0] for c in combined])

        return strategy.experimental_local_results(strategy.run(replica))[0]

    return step


def run_model(strategy, ours, stock, name, say):
    """Times every candidate on model `name`; returns its results, and the
    `step_profile.Step` profiled of each of `PROFILED` (if `--profile` is `name`)."""
    data = training_data(strategy, name)
    runners = {}
    for candidate in CANDIDATES:
        start = time.perf_counter()
        # Each candidate is traced with its all-reduce installed, and keeps it.
        _compat.replace_cross_device_ops(
            strategy.extended, stock if candidate == "tf_collectives" else ours
        )
        if candidate in ("forward", "gradients"):
            with strategy.scope():
                model, loss = make_model(name)
            step = loss_step(strategy, model, loss, data, gradients=candidate == "gradients")
            runners[candidate] = function_runner(step)
        elif candidate == "communication":
            # Shaped like the gradients of `compute`'s model, built before.
            variables = fit_model.trainable_variables
            runners[candidate] = function_runner(exchange_step(strategy, variables))
        else:
            runners[candidate], fit_model = fit_runner(strategy, name, candidate, data)
        say(f"  {candidate}: built, traced and warmed up in {time.perf_counter() - start:.1f} s")
    _compat.replace_cross_device_ops(strategy.extended, ours)
    seconds = {candidate: [] for candidate in CANDIDATES}

    def timed(candidate):
        return lambda: seconds[candidate].append(runners[candidate]())

    allreduce.time_rounds({c: timed(c) for c in CANDIDATES}, FLAGS.repeats)
    profiled = {}
    if FLAGS.profile == name:
        profiled = dict(zip(PROFILED, profiled_steps([runners[c] for c in PROFILED])))
    seconds = {c: np.array(s) for c, s in seconds.items()}
    params = fit_model.count_params()
    backward = seconds["gradients"] - seconds["forward"]
    saved = seconds["no_overlap"] - seconds["overlap"]
    median = {c: float(np.median(s)) for c, s in seconds.items()}
    say(
        f"\n-- {name}: {params:,} parameters ({4 * params / 2**20:.1f} MiB of gradients), "
        f"{FLAGS.mlp_batch_size if name == 'mlp' else FLAGS.lm_batch_size} per step, "
        f"{FLAGS.repeats} rounds of {FLAGS.steps} steps --\n"
        f"  {'candidate':<16}{'ms/step':>9}{'min ms':>9}{'/no_overlap':>13}"
    )
    for candidate in CANDIDATES:
        say(
            f"  {candidate:<16}{1e3 * median[candidate]:>9.1f}"
            f"{1e3 * seconds[candidate].min():>9.1f}"
            f"{allreduce._ratio(seconds[candidate], seconds['no_overlap']):>13.2f}"
        )
    compute_share = allreduce._ratio(seconds["compute"], seconds["communication"])
    bound = float(np.median(np.minimum(backward, seconds["communication"])))
    saved_median = float(np.median(saved))
    say(
        f"  backward pass (gradients - forward): {1e3 * np.median(backward):.1f} ms; "
        f"overlap saves {1e3 * saved_median:.1f} ms a step"
    )
    for candidate, step in profiled.items():
        say(f"  {candidate}, profiled: " + "\n  ".join(step_profile.describe(step)))
    return {
        "parameters": params,
        "seconds_per_step": {c: s.tolist() for c, s in seconds.items()},
        "compute_share": compute_share,
        "saved": saved_median,
        "bound": bound,
        "profiled": {c: step_profile.describe(step) for c, step in profiled.items()},
    }, profiled


def worker_main():
    tf.get_logger().setLevel("ERROR")
    if FLAGS.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    links = {name: FLAGS[f"{name}_link_mbit"].value for name in FLAGS.models}
    shaped = any(links.values())
    if shaped:
        # Before the strategy starts this worker's server, so that all it
        # sends goes through its link.
        shaped_link.limit_this_worker(links[FLAGS.models[0]] or FULL_SPEED_MBIT)
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=DEFAULT_BYTES_PER_PACK)
    strategy = tf_agn.strategies.KerasMultiWorkerMirroredStrategy(communication_options=options)
    stock = _compat.cross_device_ops(strategy.extended)
    ours = multi_worker_allreduce.our_ops(strategy)
    is_chief, say = multi_worker_allreduce.announce(
        strategy, PINNED_CORE,
        f"tf_collectives: {allreduce.describe_stock(strategy)}; inter-op threads: "
        f"{FLAGS.inter_op_threads or 'TensorFlow default'}",
    )
    verdicts = []
    results = {}
    for name in FLAGS.models:
        if shaped:
            shaped_link.limit_this_worker(links[name] or FULL_SPEED_MBIT)
        say(f"\n== {name}, on {f'{links[name]} Mbit/s links' if links[name] else 'loopback'} ==")
        shaped_before = shaped_link.shaped_bytes() if shaped else 0
        loopback_before = multi_worker_allreduce.loopback_bytes_sent()
        result, profiled = run_model(strategy, ours, stock, name, say)
        results[name] = result
        if is_chief and profiled and FLAGS.out and importlib.util.find_spec("matplotlib"):
            path = f"{FLAGS.out}_{name}_profile.png"
            titles = [f"{name}: {c}, {step.duration:.0f} ms" for c, step in profiled.items()]
            step_profile.plot(list(profiled.values()), titles, path)
            say(f"  Drew {path}")
        multi_worker_allreduce.sync_fn(strategy)().numpy()
        if links[name]:
            share = (shaped_link.shaped_bytes() - shaped_before) / (
                multi_worker_allreduce.loopback_bytes_sent() - loopback_before
            )
            say(f"  {share:.2%} of the bytes loopback carried went through the links.")
        share = result["compute_share"]
        verdicts.append(
            f"{'PASS' if MIN_COMPUTE_SHARE <= share <= MAX_COMPUTE_SHARE else 'FAIL'}: "
            f"(setup) {name}: compute takes {share:.2f} of communication's time "
            f"(must be in [{MIN_COMPUTE_SHARE}, {MAX_COMPUTE_SHARE}])."
        )
        saved_share = result["saved"] / result["bound"]
        verdicts.append(
            f"{'PASS' if saved_share >= MIN_SAVED_SHARE else 'FAIL'}: (target) {name}: overlap "
            f"saves {1e3 * result['saved']:.1f} ms a step, {saved_share:.2f} of "
            f"min(backward, communication) = {1e3 * result['bound']:.1f} ms "
            f"(target >= {MIN_SAVED_SHARE})."
        )
    say("\n== Verdicts ==\n" + "\n".join(f"  {line}" for line in verdicts))
    if is_chief and FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        config = {name: FLAGS[name].value for name in (
            "models", "mlp_link_mbit", "lm_link_mbit", "mlp_units", "mlp_batch_size",
            "lm_batch_size", "lm_d_model",
            "lm_num_layers", "context", "steps", "warmup_steps", "repeats", "num_workers",
            "inter_op_threads",
        )}
        with open(f"{FLAGS.out}.json", "w") as out:
            json.dump({"config": config, "results": results, "verdicts": verdicts}, out, indent=1)
        print(f"Wrote {FLAGS.out}.json")


def main(argv):
    del argv  # absl has taken the flags out; workers get the command line
    unknown = set(FLAGS.models) - set(MODELS)
    if unknown:
        raise app.UsageError(f"Unknown --models {sorted(unknown)}; allowed: {', '.join(MODELS)}.")
    if FLAGS.profile and FLAGS.profile not in FLAGS.models:
        raise app.UsageError(
            f"--profile={FLAGS.profile} is not among --models={','.join(FLAGS.models)}."
        )
    if FLAGS.num_workers != 2:
        raise app.UsageError(
            "A shaped link limits what each worker sends, not what it receives: "
            f"--num_workers must be 2; received {FLAGS.num_workers}."
        )
    if FLAGS.steps < 2:
        raise app.UsageError(f"--steps must be >= 2; received {FLAGS.steps}.")
    if "TF_CONFIG" not in os.environ:
        command = [sys.executable, *sys.argv]
        shaped = any(FLAGS[f"{name}_link_mbit"].value for name in FLAGS.models)
        with shaped_link.installed() if shaped else contextlib.nullcontext():
            sys.exit(launch.run_workers(command, FLAGS.num_workers))
    worker_main()


if __name__ == "__main__":
    app.run(main)
