r"""Samples per second and accuracy of ADL against BP, in one run.

Every configuration trains the same deep MLP (`--depth` ReLU layers of
`--width` units on MNIST-sized inputs) through `tf_agn.decoupled.
DecoupledModel`, with Adam, on logical CPU devices:

- `bp_1`: exact backpropagation, the whole model on one device: the
  BASELINE;
- `adl_<K>`: ADL over K stages, one per device, for each `--stages`, with
  M = `--accumulation_steps` (0: 2 (K − 1), which keeps staleness <= 1).

Throughput: each configuration is traced and warmed up with one short fit,
then the configurations take turns over `--repeats` interleaved rounds
(the order rotates every round), each round one epoch of `--steps`
batches of synthetic data, timed from the start to the end of `fit`
(ADL's pipeline fill and drain included). The table reports the median
and the best round in samples per second, and the median's ratio to BP's.

Accuracy: each configuration then trains a fresh model from the same
initial weights on the offline MNIST subset ("mnist5k") for
`--budget_epochs` epochs and reports the test accuracy.

Target (from the issue): ADL at K = 2 reaches >= 1.5x BP's throughput on a
model large enough that stage compute dominates. Logical CPU devices share
the machine's cores: with fewer cores than stages the stages cannot all
run at once, and BP's large matrix products already use every core
through TensorFlow's intra-op threads. `--intra_op_threads=1` gives each
operation one core, the setting closest to one core per stage;
`--inter_op_threads=1` runs one operation at a time, so the stages of a
tick cannot overlap: the difference to the default is what overlap gains.

Usage:

    python benchmarks/adl_throughput.py
    python benchmarks/adl_throughput.py --intra_op_threads=1
    python benchmarks/adl_throughput.py --inter_op_threads=1 --budget_epochs=0
    python benchmarks/adl_throughput.py --width=64 --depth=4 --steps=8
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn.decoupled import DecoupledModel  # noqa: E402
from tf_agn.decoupled import split_model  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4"], "The K values ADL runs with.")
flags.DEFINE_integer(
    "accumulation_steps", 0, "ADL's M; 0 means 2 (K - 1) for each K.", 0
)
flags.DEFINE_integer("width", 1024, "Units per hidden layer.", 1)
flags.DEFINE_integer("depth", 4, "Hidden layers.", 1)
flags.DEFINE_integer("batch_size", 128, "Examples per batch (per tick).", 1)
flags.DEFINE_integer("steps", 64, "Batches per timed round.", 1)
flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds per config.", 1)
flags.DEFINE_integer("budget_epochs", 5, "Epochs of the accuracy run.", 0)
flags.DEFINE_integer(
    "train_samples", 0, "Accuracy run: first N MNIST samples; 0 = all.", 0
)
flags.DEFINE_integer(
    "intra_op_threads", 0, "TensorFlow's threads per operation; 0: default.", 0
)
flags.DEFINE_integer(
    "inter_op_threads",
    0,
    "TensorFlow's threads running independent operations at once; 1 runs "
    "the stages of a tick one after the other. 0: default.",
    0,
)

BASELINE = "bp_1"
TARGET = 1.5
LEARNING_RATE = 1e-3


class Config:
    """One schedule over K devices, with its timings."""

    def __init__(self, schedule, num_stages, accumulation_steps):
        self.name = f"{schedule}_{num_stages}"
        self.schedule = schedule
        self.num_stages = num_stages
        self.accumulation_steps = accumulation_steps
        self.seconds = []
        self.accuracy = None

    def build(self, devices):
        """A compiled DecoupledModel; the same initial weights every time."""
        keras.utils.set_random_seed(0)
        model = tf_agn.models.mlp((784,), 10, hidden_units=[FLAGS.width] * FLAGS.depth)
        decoupled = DecoupledModel(
            split_model(model, self.num_stages),
            devices[: self.num_stages],
            accumulation_steps=self.accumulation_steps,
            schedule=self.schedule,
        )
        decoupled.compile(
            keras.optimizers.Adam(LEARNING_RATE),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return decoupled


def configs():
    result = [Config("bp", 1, 1)]
    for num_stages in map(int, FLAGS.stages):
        steps = FLAGS.accumulation_steps or max(1, 2 * (num_stages - 1))
        result.append(Config("adl", num_stages, steps))
    return result


def synthetic_data(num_examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(num_examples, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=num_examples).astype(np.int32)
    return x, y


def time_throughput(configs, devices):
    x, y = synthetic_data(FLAGS.steps * FLAGS.batch_size)
    models = {}
    for config in configs:
        start = time.perf_counter()
        models[config.name] = config.build(devices)
        # Traces the tick function; the timed fits reuse it.
        models[config.name].fit(
            x[: 4 * FLAGS.batch_size],
            y[: 4 * FLAGS.batch_size],
            batch_size=FLAGS.batch_size,
            verbose=0,
        )
        print(
            f"  {config.name}: built and warmed up in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    for round_index in range(FLAGS.repeats):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            start = time.perf_counter()
            models[config.name].fit(
                x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0
            )
            config.seconds.append(time.perf_counter() - start)
        print(
            f"  round {round_index + 1}/{FLAGS.repeats} samples/s: "
            + ", ".join(f"{c.name} {len(x) / c.seconds[-1]:.0f}" for c in configs),
            flush=True,
        )
    return len(x)


def measure_accuracy(configs, devices):
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load("mnist5k")
    if FLAGS.train_samples:
        x_train = x_train[: FLAGS.train_samples]
        y_train = y_train[: FLAGS.train_samples]
    for config in configs:
        model = config.build(devices)
        model.fit(
            x_train,
            y_train,
            batch_size=FLAGS.batch_size,
            epochs=FLAGS.budget_epochs,
            verbose=0,
        )
        config.accuracy = model.evaluate(x_test, y_test, batch_size=500)[1]


def report(configs, samples_per_round):
    """Prints the table and the verdict; returns whether the target passed."""
    medians = {c.name: samples_per_round / float(np.median(c.seconds)) for c in configs}
    baseline = medians[BASELINE]
    print(
        f"\n  {'config':<8}{'K':>3}{'M':>4}{'samples/s':>11}{'best':>9}"
        f"{'/' + BASELINE:>8}{'test acc':>10}"
    )
    for c in configs:
        accuracy = "-" if c.accuracy is None else f"{c.accuracy:.4f}"
        print(
            f"  {c.name:<8}{c.num_stages:>3}{c.accumulation_steps:>4}"
            f"{medians[c.name]:>11.0f}"
            f"{samples_per_round / min(c.seconds):>9.0f}"
            f"{medians[c.name] / baseline:>8.2f}{accuracy:>10}"
        )
    if "adl_2" not in medians:
        print("  FAIL: no adl_2 configuration; add 2 to --stages.")
        return False
    ratio = medians["adl_2"] / baseline
    passed = ratio >= TARGET
    print(
        f"  {'PASS' if passed else 'FAIL'}: ADL at K=2 runs at {ratio:.2f}x "
        f"BP's throughput (target >= {TARGET}x) on {os.cpu_count()} CPU "
        "cores shared by the logical devices."
    )
    return passed


def main(argv):
    del argv
    # Before TensorFlow starts: split_cpu starts it.
    if FLAGS.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op_threads)
    if FLAGS.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    stage_counts = [int(k) for k in FLAGS.stages]
    devices = tf_agn.strategies.split_cpu(max(stage_counts + [1]))
    tf.get_logger().setLevel("ERROR")
    all_configs = configs()
    print(
        f"{os.cpu_count()} CPU cores, {len(devices)} logical CPU devices "
        f"sharing them; intra-op threads "
        f"{FLAGS.intra_op_threads or 'default'}, inter-op threads "
        f"{FLAGS.inter_op_threads or 'default'}; MLP 784-"
        f"{'-'.join([str(FLAGS.width)] * FLAGS.depth)}-10; batch "
        f"{FLAGS.batch_size}; {FLAGS.steps} batches x {FLAGS.repeats} rounds; "
        f"accuracy after {FLAGS.budget_epochs} epochs of mnist5k."
    )
    samples_per_round = time_throughput(all_configs, devices)
    if FLAGS.budget_epochs:
        measure_accuracy(all_configs, devices)
    report(all_configs, samples_per_round)


if __name__ == "__main__":
    app.run(main)
