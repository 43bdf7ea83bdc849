"""One replica's float16 overflow, and the no-strategy references it is
checked against; shared by test_non_finite.py and non_finite_worker.py.

The scenario: the test MLP under `mixed_float16`, 2 replicas, 3 global
batches of 8 rows. The second batch overflows on replica 1 only: one of its
targets is far beyond what a scaled float16 gradient holds, so replica 1's
gradients are inf and replica 0's finite. The other two are finite: with
`gradient_accumulation_steps=2` they make one window around the overflow.
"""

import contextlib

import keras
import numpy as np

import tf_agn
from mlp import build_mlp
from mlp import data
from mlp import initial_params

NUM_REPLICAS = 2
BATCH = 8  # global: 4 rows per replica
LEARNING_RATE = 0.05
NUM_BATCHES = 3
OVERFLOW_BATCH = 1
OVERFLOW_REPLICA = 1

# name: (Keras' class, whether tf_agn wraps it in DistributedOptimizer
# rather than using its drop-in).
OPTIMIZERS = {
    "sgd": (keras.optimizers.SGD, False),
    "adam": (keras.optimizers.Adam, False),
    "distributed_adam": (keras.optimizers.Adam, True),
}

# (optimizer name, gradient_accumulation_steps) the multi-worker test runs:
# each drop-in and DistributedOptimizer, with and without accumulation.
MULTI_WORKER_CASES = [(name, steps) for name in OPTIMIZERS for steps in (None, 2)]


def case_key(name, accumulation_steps):
    """The prefix of a case's results in a worker's file."""
    return f"{name}_{accumulation_steps or 1}"


@contextlib.contextmanager
def mixed_float16():
    """Keras' `mixed_float16` policy while active."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def batches():
    """The scenario's data: (x, y) of NUM_BATCHES global batches."""
    x, y = data()
    x, y = x[: NUM_BATCHES * BATCH], y[: NUM_BATCHES * BATCH].copy()
    shard = BATCH // NUM_REPLICAS
    y[OVERFLOW_BATCH * BATCH + OVERFLOW_REPLICA * shard] = 1e4
    return x, y


def batch(x, y, index):
    """The `index`-th global batch of (x, y)."""
    return x[index * BATCH : (index + 1) * BATCH], y[index * BATCH : (index + 1) * BATCH]


def finite_batches(x, y):
    """(x, y) without the overflowing batch."""
    keep = np.ones(len(x), bool)
    keep[OVERFLOW_BATCH * BATCH : (OVERFLOW_BATCH + 1) * BATCH] = False
    return x[keep], y[keep]


def tf_agn_optimizer(name, accumulation_steps=None):
    """tf_agn's optimizer for `name`, as a user compiles it."""
    keras_class, wrapped = OPTIMIZERS[name]
    if wrapped:
        return tf_agn.optimizers.DistributedOptimizer(
            keras_class(LEARNING_RATE), gradient_accumulation_steps=accumulation_steps
        )
    return tf_agn.optimizers.aggregating_class(keras_class)(
        LEARNING_RATE, gradient_accumulation_steps=accumulation_steps
    )


def fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


def reference_weights(name, x, y, accumulation_steps=None):
    """The weights stock Keras reaches without a strategy, under
    `mixed_float16`, from the initial ones on the finite (x, y)."""
    keras_class, _ = OPTIMIZERS[name]
    with mixed_float16():
        model = build_mlp(initial_params())
        model.compile(
            optimizer=keras_class(
                LEARNING_RATE, gradient_accumulation_steps=accumulation_steps
            ),
            loss="mse",
        )
        fit(model, x, y)
    return model.get_weights()


def reference_loss_scale():
    """Keras' `LossScaleOptimizer` without a strategy after a finite step,
    then one whose gradients are all inf: (scale, step counter)."""
    variable = keras.Variable(np.ones(2, np.float32))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.apply([np.ones(2, np.float32)], [variable])
    optimizer.apply([np.full(2, np.inf, np.float32)], [variable])
    return float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy())


def loss_scale_per_replica(model):
    """Every replica's (scale, step counter) of the model's
    `LossScaleOptimizer`."""
    optimizer = model.optimizer
    copies = tf_agn.replica_weights([optimizer.dynamic_scale, optimizer.step_counter])
    return [(float(scale), int(counter)) for scale, counter in copies]
