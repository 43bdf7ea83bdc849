"""Compares synchronous training with AGN: accuracy against communication.

Trains the same MLP on the same data under the same replicas once per
configuration:

- `sgd`: synchronous SGD (`tf_agn.optimizers.SGD`), one all-reduce a step;
- `adam`: synchronous Adam (`tf_agn.optimizers.Adam`), one all-reduce a step;
- `agn`: `tf_agn.optimizers.AGN` over Adam, once per λ in
  `--local_steps_list`: one all-reduce every λ steps;
- `agn_unnormalized`: the same with `normalize=False` (DOWNPOUR-style), for
  the first λ of the list.

    python examples/compare_sync.py                  # a few minutes, 2 cores
    python examples/compare_sync.py --configs=adam,agn --local_steps_list=2,4

It prints a Markdown table (final test accuracy, training wall time and
megabytes one replica sent), and writes to `--output_dir`:

- `results.md`: the same table;
- `results.json`: the settings and, per configuration, the per-epoch test
  accuracy, wall time and cumulative bytes sent;
- `compare_sync.png`: test accuracy against bytes sent and against wall
  time, if matplotlib (the `[bench]` extra) is installed.

AGN is validated at its center weights (`tf_agn.callbacks.EvaluateAtCenter`),
not at the replicas' mid-window explorations. Bytes are what one replica
contributes to the aggregations (`optimizer.communication_stats()`), read at
every epoch's end by `tf_agn.callbacks.CommunicationLogger`; the last epoch's
entry also holds the partial window AGN commits at the end of `fit`. Wall
time is training time: the per-epoch evaluations are not counted.
"""

import json
import os
import time

# Before TensorFlow loads: hide its CUDA and CPU-feature notices.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402

CONFIGS = ("sgd", "adam", "agn", "agn_unnormalized")

tf_agn.strategies.define_flags()  # --aggregation, --num_replicas, ...
flags.DEFINE_enum(
    "dataset", "mnist5k", tf_agn.datasets.NAMES, "Data set to train on."
)
flags.DEFINE_integer("epochs", 8, "Passes over the training set.", 1)
flags.DEFINE_integer(
    "batch_size",
    256,
    "Global batch size, split across the replicas (rounded down to a "
    "multiple of their number).",
    1,
)
flags.DEFINE_integer(
    "train_samples", 0, "Train on the first N samples only; 0 = all.", 0
)
flags.DEFINE_list(
    "local_steps_list",
    ["4", "8", "16"],
    "AGN's λ values (local steps per commit); the first one is also used "
    "for agn_unnormalized.",
)
flags.DEFINE_list(
    "configs",
    list(CONFIGS),
    f"Which configurations to run, a subset of {', '.join(CONFIGS)}.",
)
flags.DEFINE_float("sgd_learning_rate", 0.3, "Learning rate of sync SGD.")
flags.DEFINE_float(
    "adam_learning_rate", 4e-3, "Learning rate of sync Adam and AGN's Adam."
)
flags.DEFINE_float(
    "outer_learning_rate",
    1.0,
    "Learning rate of AGN's outer SGD, which applies the combined Δ.",
)
flags.DEFINE_string(
    "output_dir",
    os.path.join("/tmp", "tf_agn_compare"),
    "Where results.md, results.json and compare_sync.png go.",
)
flags.DEFINE_integer("seed", 0, "Seed of the weights and the shuffling.")
flags.DEFINE_integer(
    "verbose", 0, "Keras verbosity: 0 silent, 1 progress bar, 2 per epoch."
)
FLAGS = flags.FLAGS


@flags.validator("configs", f"--configs must be a subset of {CONFIGS}.")
def _valid_configs(values):
    return bool(values) and all(value in CONFIGS for value in values)


@flags.validator("local_steps_list", "--local_steps_list must be ints >= 1.")
def _valid_local_steps(values):
    try:
        return bool(values) and all(int(value) >= 1 for value in values)
    except ValueError:
        return False


def configurations():
    """`(name, label, optimizer factory, is_agn)` for each selected config."""
    local_steps = [int(value) for value in FLAGS.local_steps_list]
    aggregation = FLAGS.aggregation

    def sync(cls, learning_rate):
        return lambda: cls(
            learning_rate=learning_rate, aggregation_method=aggregation
        )

    def agn(steps, normalize):
        return lambda: tf_agn.optimizers.AGN(
            keras.optimizers.Adam(FLAGS.adam_learning_rate),
            local_steps=steps,
            aggregation_method=aggregation,
            outer_optimizer=keras.optimizers.SGD(FLAGS.outer_learning_rate),
            normalize=normalize,
        )

    found = []
    if "sgd" in FLAGS.configs:
        found.append(
            (
                "sgd",
                "sync SGD",
                sync(tf_agn.optimizers.SGD, FLAGS.sgd_learning_rate),
                None,
            )
        )
    if "adam" in FLAGS.configs:
        found.append(
            (
                "adam",
                "sync Adam",
                sync(tf_agn.optimizers.Adam, FLAGS.adam_learning_rate),
                None,
            )
        )
    if "agn" in FLAGS.configs:
        for steps in local_steps:
            found.append(
                (
                    f"agn{steps}",
                    f"AGN(Adam) λ={steps}",
                    agn(steps, True),
                    {"local_steps": steps, "normalize": True},
                )
            )
    if "agn_unnormalized" in FLAGS.configs:
        steps = local_steps[0]
        found.append(
            (
                f"agn{steps}_unnormalized",
                f"AGN(Adam) λ={steps}, normalize=False",
                agn(steps, False),
                {"local_steps": steps, "normalize": False},
            )
        )
    return found


class EpochRecorder(keras.callbacks.Callback):
    """Records, per epoch, the training wall time so far (evaluation left
    out), the test accuracy and the cumulative bytes sent.

    Put it after `CommunicationLogger`, which adds `bytes_sent` to the logs.
    """

    def __init__(self):
        super().__init__()
        self.history = {
            "epoch": [],
            "test_accuracy": [],
            "wall_time_s": [],
            "bytes_sent": [],
        }
        self._start = None
        self._evaluating_since = None
        self._evaluation_time = 0.0

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()
        self._evaluation_time = 0.0

    def on_test_begin(self, logs=None):
        self._evaluating_since = time.perf_counter()

    def on_test_end(self, logs=None):
        if self._evaluating_since is not None:
            self._evaluation_time += (
                time.perf_counter() - self._evaluating_since
            )
            self._evaluating_since = None

    def elapsed(self):
        return time.perf_counter() - self._start - self._evaluation_time

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self.history["epoch"].append(epoch + 1)
        self.history["test_accuracy"].append(float(logs["val_accuracy"]))
        self.history["wall_time_s"].append(self.elapsed())
        self.history["bytes_sent"].append(int(logs["bytes_sent"]))


def run_config(strategy, data, num_classes, name, label, make_optimizer, agn):
    """Trains one configuration; returns its results as a dict."""
    (x_train, y_train), (x_test, y_test) = data
    replicas = strategy.num_replicas_in_sync
    batch_size = tf_agn.strategies.even_batch_size(
        FLAGS.batch_size, len(x_train), replicas
    )
    test_batch_size = tf_agn.strategies.even_batch_size(
        FLAGS.batch_size, len(x_test), replicas
    )
    # The same initial weights and shuffling for every configuration.
    keras.utils.set_random_seed(FLAGS.seed)
    with strategy.scope():
        model = tf_agn.models.mlp(x_train.shape[1:], num_classes)
        optimizer = make_optimizer()
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    recorder = EpochRecorder()
    callbacks = [tf_agn.callbacks.CommunicationLogger(), recorder]
    if agn:
        callbacks.insert(0, tf_agn.callbacks.EvaluateAtCenter())
    model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=FLAGS.epochs,
        validation_data=(x_test, y_test),
        validation_batch_size=test_batch_size,
        callbacks=callbacks,
        verbose=FLAGS.verbose,
    )
    # `fit` has committed AGN's partial window: the model holds the center.
    wall_time = recorder.elapsed()
    stats = optimizer.communication_stats()
    _, accuracy = model.evaluate(
        x_test, y_test, batch_size=test_batch_size, verbose=0
    )
    history = recorder.history
    history["bytes_sent"][-1] = stats["bytes_sent"]
    history["test_accuracy"][-1] = float(accuracy)
    history["wall_time_s"][-1] = wall_time
    steps = int(optimizer.iterations.numpy())
    return {
        "name": name,
        "label": label,
        "optimizer": type(optimizer).__name__,
        "local_steps": agn["local_steps"] if agn else 1,
        "normalize": agn["normalize"] if agn else None,
        "steps": steps,
        "batch_size": batch_size,
        "final_test_accuracy": float(accuracy),
        "wall_time_s": wall_time,
        "bytes_sent": stats["bytes_sent"],
        "all_reduce_calls": stats["all_reduce_calls"],
        "num_parameters": int(model.count_params()),
        "history": history,
    }


def markdown_table(results):
    lines = [
        "| configuration | final test accuracy | wall time (s) | "
        "bytes communicated (MB) |",
        "|---|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result['label']} | {result['final_test_accuracy']:.4f} | "
            f"{result['wall_time_s']:.1f} | "
            f"{result['bytes_sent'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def plot(results, path):
    """Writes the two panels to `path`; returns False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        history = result["history"]
        megabytes = [b / 1e6 for b in history["bytes_sent"]]
        by_bytes.plot(
            megabytes,
            history["test_accuracy"],
            marker="o",
            label=result["label"],
        )
        by_time.plot(
            history["wall_time_s"],
            history["test_accuracy"],
            marker="o",
            label=result["label"],
        )
    by_bytes.set_xlabel("MB communicated (one replica, cumulative)")
    by_time.set_xlabel("training wall time (s)")
    for axes in (by_bytes, by_time):
        axes.set_ylabel("test accuracy")
        axes.grid(True, alpha=0.3)
    by_time.legend(loc="lower right", fontsize="small")
    figure.suptitle(
        f"{FLAGS.dataset}: sync vs AGN, "
        f"{results[0]['batch_size']} per batch, {FLAGS.epochs} epochs"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv):
    del argv  # Unused.
    # absl shows INFO logs, and TF's distribution code logs each reduction.
    tf.get_logger().setLevel("WARNING")
    # First: it splits the CPU, which only works before TensorFlow starts.
    strategy = tf_agn.strategies.strategy_from_flags()
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load(FLAGS.dataset)
    if FLAGS.train_samples:
        # The training set comes shuffled, so a prefix keeps every class.
        x_train = x_train[: FLAGS.train_samples]
        y_train = y_train[: FLAGS.train_samples]
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    data = ((x_train, y_train), (x_test, y_test))
    print(
        f"Training on {len(x_train)} {FLAGS.dataset} samples, "
        f"{strategy.num_replicas_in_sync} replicas, "
        f"aggregation={FLAGS.aggregation}, {FLAGS.epochs} epochs."
    )

    results = []
    for name, label, make_optimizer, agn in configurations():
        result = run_config(
            strategy, data, num_classes, name, label, make_optimizer, agn
        )
        print(
            f"{label}: test_accuracy={result['final_test_accuracy']:.4f} "
            f"wall_time={result['wall_time_s']:.1f}s "
            f"bytes_sent={result['bytes_sent']}",
            flush=True,
        )
        results.append(result)

    table = markdown_table(results)
    print()
    print(table)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(
        os.path.join(FLAGS.output_dir, "results.md"), "w", encoding="utf-8"
    ) as f:
        f.write(table + "\n")
    settings = {
        "dataset": FLAGS.dataset,
        "train_samples": len(x_train),
        "test_samples": len(x_test),
        "epochs": FLAGS.epochs,
        "batch_size": FLAGS.batch_size,
        "num_replicas": strategy.num_replicas_in_sync,
        "aggregation": FLAGS.aggregation,
        "local_steps_list": [int(v) for v in FLAGS.local_steps_list],
        "configs": list(FLAGS.configs),
        "seed": FLAGS.seed,
        "sgd_learning_rate": FLAGS.sgd_learning_rate,
        "adam_learning_rate": FLAGS.adam_learning_rate,
        "outer_learning_rate": FLAGS.outer_learning_rate,
    }
    with open(
        os.path.join(FLAGS.output_dir, "results.json"), "w", encoding="utf-8"
    ) as f:
        json.dump(
            {"settings": settings, "results": results},
            f,
            indent=2,
            ensure_ascii=False,
        )
    png = os.path.join(FLAGS.output_dir, "compare_sync.png")
    if plot(results, png):
        print(
            f"\nWrote {png}, results.md and results.json to "
            f"{FLAGS.output_dir}."
        )
    else:
        print(
            '\nmatplotlib is not installed (pip install -e ".[bench]"): '
            f"skipped the plot. Wrote results.md and results.json to "
            f"{FLAGS.output_dir}."
        )


if __name__ == "__main__":
    app.run(main)
