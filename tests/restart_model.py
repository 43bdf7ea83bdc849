"""The tiny model and data of the restart tests (tests/test_restarts.py,
tests/restart_worker.py) and benchmarks/restart_cost.py: AGN with an inner
Adam, whose windows of 3 local steps straddle backups and epochs, so that
the replicas' weights and Adam moments differ whenever a backup is taken.

It imports no conftest and creates no strategy: the caller does."""

import keras
import numpy as np

import tf_agn

ROWS, FEATURES, CLASSES = 64, 6, 3
GLOBAL_BATCH = 16  # 4 steps per epoch
LOCAL_STEPS = 3
EPOCHS = 5


def data():
    """The training set, (x, y): fixed, so every process has the same."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, ROWS)
    return x, y


# Optimizers the restart tests train with besides AGN, by name: every kind
# of state a backup holds (AGN's per-replica window, sharded moments,
# accumulators, error feedback's residuals, a fragment's exchange in flight).
OPTIMIZERS = {
    "agn": None,
    "adam": lambda: tf_agn.optimizers.Adam(0.05),
    "adam_sharded": lambda: tf_agn.optimizers.Adam(0.05, shard_optimizer_state=True),
    "accumulation": lambda: tf_agn.optimizers.Adam(0.05, gradient_accumulation_steps=3),
    "int8": lambda: tf_agn.optimizers.Adam(
        0.05, compression=tf_agn.compression.Int8(chunk_size=8)
    ),
    # H = 6, F = 2, τ = 2: an exchange is in flight after steps ≡ 2 and 5 (mod 6).
    "streaming_diloco": lambda: tf_agn.optimizers.StreamingDiLoCo(
        keras.optimizers.Adam(0.05), local_steps=6, num_fragments=2, sync_delay=2
    ),
}


def build_model(strategy, make_optimizer=None, **compile_kwargs):
    """The compiled model with fixed initial weights, in `strategy`'s scope,
    with AGN's optimizer or `make_optimizer()`'s; `compile_kwargs` go to
    `compile` (e.g. `steps_per_execution`)."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer=make_optimizer() if make_optimizer else tf_agn.optimizers.AGN(
                keras.optimizers.Adam(0.05), local_steps=LOCAL_STEPS
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **compile_kwargs,
        )
    return model


def training_state(model):
    """Every replica's copy of every variable of the model and its
    optimizer (weights, AGN's center, the inner Adam's moments, counters):
    one list of numpy arrays per replica."""
    return tf_agn.replica_weights(model.variables + model.optimizer.variables)
