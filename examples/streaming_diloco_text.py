r"""Trains a byte-level Transformer language model with Streaming DiLoCo,
across worker processes that synchronize one fragment of the model at a
time.

    python -m tf_agn.strategies.launch --multi_worker 2 -- \
        python examples/streaming_diloco_text.py
    python examples/streaming_diloco_text.py --cpu_replicas=2   # one process

Each replica takes H = `--local_steps` Adam steps on its share of every
batch; the layers are split into F = `--num_fragments` fragments, one of
which the replicas average every H/F steps, its exchange overlapping
τ = `--sync_delay` local steps and travelling in 4 bits
(`--compression=int4`, the default here; `none` for float32). The text is
this interpreter's own standard library, as `benchmarks/stdlib_text.py`
reads it: real text, no download. Every `--eval_every` steps the held-out
loss is measured at the centers (the weights the exchanges agree on). The
last lines printed are `heldout_loss=...` (nats per byte; a byte-frequency
model gets 3.29) and `bytes_sent=...` (by this worker's optimizer).

See `benchmarks/streaming_diloco.py` for the comparison with synchronous
training and DiLoCo, on shaped links.
"""

import os
import sys

# Before TensorFlow loads: hide its CUDA and CPU-feature notices.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The task, its data and its model are the benchmarks'.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import stdlib_text  # noqa: E402  (--context, --batch_size, --d_model, --learning_rate, ...)
import tf_agn  # noqa: E402

tf_agn.strategies.define_flags()  # --aggregation, --compression, --cpu_replicas, ...
flags.DEFINE_integer("steps", 256, "Training steps (a multiple of --eval_every).", 1)
flags.DEFINE_integer("local_steps", 32, "H: local steps per window.", 1)
flags.DEFINE_integer("num_fragments", 4, "F: fragments, each synchronized once a window.", 1)
flags.DEFINE_integer("sync_delay", 1, "τ: local steps an exchange overlaps (τ < H/F).", 0)
flags.DEFINE_float("outer_learning_rate", 1.0, "The outer SGD's learning rate.")
flags.DEFINE_float("outer_momentum", 0.0, "The outer SGD's Nesterov momentum (0: none).")
flags.DEFINE_integer(
    "verbose", 2, "Keras verbosity: 0 silent, 1 progress bar, 2 per evaluation."
)
FLAGS = flags.FLAGS
FLAGS.set_default("compression", "int4")
FLAGS.set_default("cpu_replicas", 2)
FLAGS.set_default("eval_every", 32)


def main(argv):
    del argv  # Unused.
    tf.get_logger().setLevel("WARNING")
    if FLAGS.steps % FLAGS.eval_every:
        raise app.UsageError(
            f"--steps={FLAGS.steps} must be a multiple of --eval_every={FLAGS.eval_every}."
        )
    # First: it splits the CPU, which only works before TensorFlow starts.
    strategy = tf_agn.strategies.strategy_from_flags()
    keras.utils.set_random_seed(FLAGS.seed)
    training = stdlib_text.training_batches(
        strategy, stdlib_text.load_split("train"), FLAGS.context, FLAGS.batch_size, FLAGS.seed
    )
    heldout = stdlib_text.heldout_batches(
        strategy, stdlib_text.load_split("heldout"), FLAGS.context, FLAGS.heldout_windows
    )
    print(
        f"Training on {strategy.num_replicas_in_sync} replicas: H = {FLAGS.local_steps}, "
        f"F = {FLAGS.num_fragments}, τ = {FLAGS.sync_delay}, compression={FLAGS.compression}."
    )
    with strategy.scope():
        model = stdlib_text.byte_transformer(
            FLAGS.context, FLAGS.d_model, FLAGS.num_layers, FLAGS.num_heads
        )
        optimizer = tf_agn.optimizers.StreamingDiLoCo(
            keras.optimizers.Adam(FLAGS.learning_rate),
            local_steps=FLAGS.local_steps,
            num_fragments=FLAGS.num_fragments,
            sync_delay=FLAGS.sync_delay,
            outer_optimizer=keras.optimizers.SGD(
                FLAGS.outer_learning_rate,
                momentum=FLAGS.outer_momentum,
                nesterov=FLAGS.outer_momentum > 0,
            ),
        )
        stdlib_text.compile_for_bytes(model, optimizer)
    history = model.fit(
        training,
        validation_data=heldout,
        steps_per_epoch=FLAGS.eval_every,
        epochs=FLAGS.steps // FLAGS.eval_every,
        callbacks=[tf_agn.callbacks.EvaluateAtCenter()],
        verbose=FLAGS.verbose,
    )
    print(f"heldout_loss={history.history['val_loss'][-1]:.4f}")
    print(f"bytes_sent={optimizer.communication_stats()['bytes_sent']}")


if __name__ == "__main__":
    app.run(main)
