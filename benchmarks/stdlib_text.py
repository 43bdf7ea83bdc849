r"""Byte-level language modelling on the Python standard library's sources:
an offline task for benchmarks that train across worker processes.

The text is this interpreter's own standard library
(`sysconfig.get_paths()["stdlib"]`): no download. Two committed lists,
`data/stdlib_train.txt` and `data/stdlib_heldout.txt`, name its files
relative to that folder: every `.py` file that Python 3.11 and 3.12 both
have, outside `test`, `tests` and `idle_test` folders and
`site-packages`, so every machine reads the same files. A file is held out
when the SHA-256 of its path, modulo 100, is below `HELDOUT_PERCENT`.

Each line of a list is `path<TAB>bytes<TAB>sha256` as Python 3.11.7 has
the file. Contents differ a little between Python versions: a file whose
checksum differs here is read as it is and counted, and `load_split`
prints how many differ; a listed file that is missing raises. The text
is therefore the same on every run of one interpreter and close between
versions: Python 3.12.1 differs in 194 of the 656 training files and 4
of the 22 held-out ones, which moves the unigram figure by 0.001.

Training batches are windows of `context + 1` bytes at random offsets of
the training files' concatenation (windows may span two files): the
inputs are the first `context` bytes, the targets the last `context`.
The loss is the mean cross-entropy in nats per byte over every position
of a window. The module's defaults are the smallest configuration found
that reaches `TARGET_LOSS`, 0.4 ln 256 nats per byte, on the held-out
windows reliably with plain `model.fit` (Adam, one process on one core):
in 250 to 300 steps over 3 seeds, about 20 ms a step. The byte
frequencies of the training files give 3.29 nats per byte on the
held-out files.

Usage:

    python benchmarks/stdlib_text.py             # data summary, unigram
    taskset -c 0 python benchmarks/stdlib_text.py --calibrate
    python benchmarks/stdlib_text.py \
        --write_lists=$(pyenv root)/versions/3.12.1/lib/python3.12
"""

import hashlib
import math
import os
import pathlib
import sys
import sysconfig
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STDLIB = sysconfig.get_paths()["stdlib"]
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
LISTS = {
    "train": os.path.join(DATA_DIR, "stdlib_train.txt"),
    "heldout": os.path.join(DATA_DIR, "stdlib_heldout.txt"),
}
EXCLUDED_FOLDERS = {"test", "tests", "idle_test", "site-packages"}
HELDOUT_PERCENT = 4

# Calibrated defaults (see the module docstring).
CONTEXT = 64
BATCH_SIZE = 32
D_MODEL = 32
NUM_LAYERS = 1
NUM_HEADS = 2
LEARNING_RATE = 3e-3
HELDOUT_WINDOWS = 512
TARGET_LOSS = 0.4 * math.log(256)


def stdlib_files(stdlib):
    """The relative paths of the `.py` files under `stdlib` outside
    `EXCLUDED_FOLDERS`, sorted."""
    return sorted(
        os.path.relpath(os.path.join(folder, name), stdlib)
        for folder, subfolders, names in os.walk(stdlib)
        if not EXCLUDED_FOLDERS & set(os.path.relpath(folder, stdlib).split(os.sep))
        for name in names
        if name.endswith(".py")
    )


def is_heldout(path):
    """Whether the file at relative `path` belongs to the held-out split."""
    digest = hashlib.sha256(path.encode()).hexdigest()
    return int(digest, 16) % 100 < HELDOUT_PERCENT


def write_lists(other_stdlib, stdlib=STDLIB):
    """Writes the two lists: the files that `stdlib` and `other_stdlib` (the
    standard library folder of another Python version) both have, with their
    sizes and checksums in `stdlib`."""
    files = sorted(set(stdlib_files(stdlib)) & set(stdlib_files(other_stdlib)))
    for split, list_path in LISTS.items():
        with open(list_path, "w") as listing:
            for path in files:
                if is_heldout(path) == (split == "heldout"):
                    data = pathlib.Path(stdlib, path).read_bytes()
                    digest = hashlib.sha256(data).hexdigest()
                    listing.write(f"{path}\t{len(data)}\t{digest}\n")


def read_list(split):
    """The entries of a split's list: `(path, bytes, sha256)` tuples.

    Raises:
        ValueError: if `split` is not "train" or "heldout".
    """
    if split not in LISTS:
        raise ValueError(f"split must be one of {sorted(LISTS)}, got {split!r}.")
    with open(LISTS[split]) as listing:
        return [
            (path, int(size), digest)
            for path, size, digest in (line.rstrip("\n").split("\t") for line in listing)
        ]


def load_split(split, stdlib=STDLIB):
    """The bytes of a split's files, concatenated in list order.

    Args:
        split: "train" or "heldout".
        stdlib: the standard library folder to read.

    Returns:
        A uint8 numpy array.

    Raises:
        FileNotFoundError: naming the first listed file missing in `stdlib`.
    """
    contents = []
    differing = 0
    for path, _, digest in read_list(split):
        full_path = pathlib.Path(stdlib, path)
        if not full_path.is_file():
            raise FileNotFoundError(
                f"{path}, listed in {LISTS[split]}, is not in {stdlib}: every "
                "listed file must exist in both Python 3.11 and 3.12."
            )
        data = full_path.read_bytes()
        differing += hashlib.sha256(data).hexdigest() != digest
        contents.append(data)
    if differing:
        print(
            f"stdlib_text: {differing} of {len(contents)} {split} files differ from "
            "Python 3.11.7's, which the list records; read as they are here."
        )
    return np.frombuffer(b"".join(contents), dtype=np.uint8)


def unigram_cross_entropy(train, heldout):
    """Held-out cross-entropy, in nats per byte, of the byte frequencies of
    `train` with add-one smoothing (so a byte unseen in training costs a
    finite amount)."""
    counts = np.bincount(train, minlength=256) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-np.bincount(heldout, minlength=256) @ log_probs / heldout.size)


def train_dataset(text, context=CONTEXT, batch_size=BATCH_SIZE, seed=0,
                  num_workers=1, worker_index=0):
    """An endless, deterministic dataset of training batches.

    The `k`-th batches of all workers together are `batch_size *
    num_workers` windows at offsets drawn from `(seed, k)`; worker `w` of
    `num_workers` takes windows `w`, `w + num_workers`, ... of them. So
    they are the `k`-th batch of a single process with `batch_size *
    num_workers` windows.

    Args:
        text: uint8 numpy array, e.g. `load_split("train")`.
        context: bytes of input per window.
        batch_size: windows per batch (per worker).
        seed: integer seed of the offsets.
        num_workers, worker_index: this worker's share.

    Returns:
        A `tf.data.Dataset` of `(inputs, targets)`, int32 of shape
        `(batch_size, context)`; `targets` are `inputs` shifted by one byte.

    Raises:
        ValueError: if `worker_index` is not in `[0, num_workers)`.
    """
    if not 0 <= worker_index < num_workers:
        raise ValueError(
            f"worker_index must be in [0, num_workers={num_workers}), got {worker_index}."
        )
    text = tf.constant(text)
    num_offsets = int(text.shape[0]) - context

    def windows(step):
        offsets = tf.random.stateless_uniform(
            [batch_size * num_workers], seed=[seed, step], maxval=num_offsets,
            dtype=tf.int64,
        )[worker_index::num_workers]
        span = tf.gather(text, offsets[:, None] + tf.range(context + 1, dtype=tf.int64))
        span = tf.cast(span, tf.int32)
        return span[:, :-1], span[:, 1:]

    return tf.data.Dataset.counter().map(windows).prefetch(1)


def heldout_windows(text, context=CONTEXT, num_windows=HELDOUT_WINDOWS):
    """`num_windows` windows evenly spaced over `text` (the held-out bytes):
    `(inputs, targets)`, int32 numpy arrays of shape `(num_windows, context)`.
    """
    last = text.size - context - 1
    starts = np.arange(num_windows, dtype=np.int64) * last // max(num_windows - 1, 1)
    span = text[starts[:, None] + np.arange(context + 1)].astype(np.int32)
    return span[:, :-1], span[:, 1:]


def training_batches(strategy, text, context, batch_size, seed):
    """`train_dataset`'s batches for `strategy`'s replicas, `batch_size`
    windows over all of them: worker w reads its share of every global
    batch, and its replicas take turns at that share's batches."""

    def dataset_fn(input_context):
        return train_dataset(
            text, context, input_context.get_per_replica_batch_size(batch_size), seed,
            input_context.num_input_pipelines, input_context.input_pipeline_id,
        )

    return strategy.distribute_datasets_from_function(dataset_fn)


def heldout_batches(strategy, text, context, num_windows, batch_size=64):
    """`heldout_windows`' windows for `strategy`'s replicas, at most
    `batch_size` per replica at a time: worker w evaluates windows w,
    w + num_workers, ... (as many as its replicas share evenly); Keras's
    loss is their mean over all replicas."""
    inputs, targets = heldout_windows(text, context, num_windows)

    def dataset_fn(input_context):
        share = slice(input_context.input_pipeline_id, None, input_context.num_input_pipelines)
        replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
        per_replica = min(batch_size, len(inputs[share]) // replicas)
        # Whole batches for every replica: Keras cannot sum an empty one.
        kept = len(inputs[share]) // (per_replica * replicas) * per_replica * replicas
        windows = tf.data.Dataset.from_tensor_slices((inputs[share][:kept], targets[share][:kept]))
        return windows.batch(per_replica)

    return strategy.distribute_datasets_from_function(dataset_fn)


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to its `(batch, length, width)`
    inputs."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.length, input_shape[-1]), initializer="uniform", name="embeddings"
        )

    def call(self, inputs):
        return inputs + self.embeddings[: keras.ops.shape(inputs)[1]]

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def byte_transformer(context=CONTEXT, d_model=D_MODEL, num_layers=NUM_LAYERS,
                     num_heads=NUM_HEADS):
    """A small pre-LN causal Transformer over bytes; uncompiled.

    Call `keras.utils.set_random_seed` first for reproducible weights.

    Args:
        context: input length.
        d_model: width of the embeddings (a multiple of `num_heads`).
        num_layers: Transformer blocks.
        num_heads: attention heads per block.

    Returns:
        A `keras.Model` from int32 `(batch, context)` bytes to float32
        logits `(batch, context, 256)` of each next byte.
    """
    if d_model % num_heads:
        raise ValueError(
            f"d_model must be a multiple of num_heads={num_heads}, got {d_model}."
        )
    inputs = keras.Input((context,), dtype="int32")
    x = PositionEmbedding(context)(keras.layers.Embedding(256, d_model)(inputs))
    for _ in range(num_layers):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(num_heads, d_model // num_heads)(
            h, h, use_causal_mask=True
        )
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * d_model, activation="gelu")(h)
        x = x + keras.layers.Dense(d_model)(h)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(inputs, keras.layers.Dense(256)(x))


def compile_for_bytes(model, optimizer):
    """Compiles `model` with the mean next-byte cross-entropy (nats)."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


FLAGS = flags.FLAGS
flags.DEFINE_string(
    "write_lists", None, "Rewrite the lists from this interpreter's standard "
    "library and this other one's (Python 3.12's) folder."
)
flags.DEFINE_bool("calibrate", False, "Train with model.fit; print the loss curve.")
flags.DEFINE_integer("context", CONTEXT, "Bytes of input per window.")
flags.DEFINE_integer("batch_size", BATCH_SIZE, "Windows per step.")
flags.DEFINE_integer("d_model", D_MODEL, "Model width.")
flags.DEFINE_integer("num_layers", NUM_LAYERS, "Transformer blocks.")
flags.DEFINE_integer("num_heads", NUM_HEADS, "Attention heads.")
flags.DEFINE_float("learning_rate", LEARNING_RATE, "Adam's learning rate.")
flags.DEFINE_integer("heldout_windows", HELDOUT_WINDOWS, "Held-out windows.")
flags.DEFINE_integer("eval_every", 25, "Steps between held-out evaluations.")
flags.DEFINE_integer("max_steps", 1000, "Training steps of the calibration.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the windows.")


class StepTimes(keras.callbacks.Callback):
    """Times each epoch's training steps, without its validation."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_test_begin(self, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def calibrate(train, heldout):
    """Trains with `model.fit` for `--max_steps`; prints the held-out loss
    curve, the first step at which it reached TARGET_LOSS, and the time per
    step."""
    keras.utils.set_random_seed(FLAGS.seed)
    model = byte_transformer(FLAGS.context, FLAGS.d_model, FLAGS.num_layers, FLAGS.num_heads)
    compile_for_bytes(model, keras.optimizers.Adam(FLAGS.learning_rate))
    times = StepTimes()
    history = model.fit(
        train_dataset(train, FLAGS.context, FLAGS.batch_size, FLAGS.seed),
        validation_data=heldout_windows(heldout, FLAGS.context, FLAGS.heldout_windows),
        steps_per_epoch=FLAGS.eval_every,
        epochs=FLAGS.max_steps // FLAGS.eval_every,
        callbacks=[times],
        shuffle=False,  # The windows are already random; Keras warns otherwise.
        verbose=0,
    )
    print(
        f"context {FLAGS.context}, batch {FLAGS.batch_size}, d_model {FLAGS.d_model}, "
        f"{FLAGS.num_layers} layers, {FLAGS.num_heads} heads, Adam {FLAGS.learning_rate}: "
        f"{model.count_params()} parameters, CPUs {sorted(os.sched_getaffinity(0))}"
    )
    for epoch, (loss, val_loss, seconds) in enumerate(
        zip(history.history["loss"], history.history["val_loss"], times.seconds)
    ):
        print(
            f"  step {(epoch + 1) * FLAGS.eval_every:5d}: train {loss:.3f}, "
            f"held-out {val_loss:.3f} nats/byte, {1e3 * seconds / FLAGS.eval_every:.1f} ms/step"
        )
    reached = [
        (epoch + 1) * FLAGS.eval_every
        for epoch, loss in enumerate(history.history["val_loss"])
        if loss <= TARGET_LOSS
    ]
    median = 1e3 * np.median(times.seconds[1:] or times.seconds) / FLAGS.eval_every
    print(
        f"  held-out {TARGET_LOSS:.3f} first reached at step "
        f"{reached[0] if reached else None}; median {median:.1f} ms/step (the first "
        f"{FLAGS.eval_every} steps, with tracing, left out); training {sum(times.seconds):.0f} s"
    )


def main(argv):
    del argv
    if FLAGS.write_lists:
        write_lists(FLAGS.write_lists)
    train, heldout = load_split("train"), load_split("heldout")
    print(
        f"{STDLIB}: {len(read_list('train'))} training files, {train.size} bytes; "
        f"{len(read_list('heldout'))} held-out files, {heldout.size} bytes "
        f"({100 * heldout.size / (train.size + heldout.size):.1f}%)"
    )
    print(
        f"unigram held-out cross-entropy: {unigram_cross_entropy(train, heldout):.4f} "
        f"nats/byte (ln 256 = {math.log(256):.4f}; target {TARGET_LOSS:.4f})"
    )
    if FLAGS.calibrate:
        calibrate(train, heldout)


if __name__ == "__main__":
    sys.exit(app.run(main))
