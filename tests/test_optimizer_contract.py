"""Keras's optimizer contract under tf_agn's optimizers: `apply` takes any
of the built variables, in any order, skips None gradients, and updates
each variable with its own state (Keras finds every variable's slots by its
key); sparse gradients give stock Keras's numbers, sharded too.

Each step here is a GAN's: two optimizers, each applied to its own subset
of a model's variables, in reversed order, with an output that has no loss
(None gradients). Two of the variables have the same shape, so state
matched by position in a call would be traded silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES

N = 2
STEPS = 4
BATCH = 8  # per replica

rng = np.random.default_rng(7)
X = rng.normal(size=(STEPS * N * BATCH, 8)).astype("float32")
Y = rng.normal(size=(STEPS * N * BATCH, 1)).astype("float32")
IDS = rng.integers(0, 40, (STEPS * N * BATCH, 5)).astype("int32")


def two_heads():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="tanh", name="a")(inputs)
    hidden = keras.layers.Dense(8, activation="tanh", name="b")(hidden)  # a's shape
    outputs = [keras.layers.Dense(1, name="out")(hidden), keras.layers.Dense(3, name="aux")(hidden)]
    return keras.Model(inputs, outputs)


def train_two_optimizers(strategy, make_optimizer, order):
    """The model's weights and their change after `STEPS` steps in which
    one optimizer updates layers a and out, another layer b, each called
    with its variables in `order` ("built" or "reversed")."""
    with strategy.scope():
        model = two_heads()
        first, second = make_optimizer(), make_optimizer()
        variables = model.trainable_variables
        subsets = [
            [v for v in variables if v.path.startswith(("a/", "out/", "aux/"))],
            [v for v in variables if v.path.startswith("b/")],
        ]
        for optimizer, subset in zip((first, second), subsets):
            optimizer.build(subset)
    before = [v.numpy() for v in variables]

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            out, _ = model(x)  # "aux" has no loss: its gradients are None
            # Keras divides each replica's loss by the replicas in sync.
            loss = tf.reduce_mean(tf.square(out - y)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, variables)
        by_variable = {id(v): g for v, g in zip(variables, grads)}
        for optimizer, subset in zip((first, second), subsets):
            if order == "reversed":
                subset = subset[::-1]
            optimizer.apply([by_variable[id(v)] for v in subset], subset)

    @tf.function
    def step(x, y):
        strategy.run(replica_step, args=(x, y))

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(N * BATCH)
    for x, y in strategy.experimental_distribute_dataset(dataset):
        step(x, y)
    return before, [v.numpy() for v in variables]


def deviation(got, want, start):
    """‖got − want‖ / ‖want − start‖ over all the weights together."""
    norm = lambda arrays: np.sqrt(sum(np.sum(np.square(a)) for a in arrays))
    return norm([g - w for g, w in zip(got, want)]) / norm([w - s for w, s in zip(want, start)])


def stock_strategy():
    # Not the default ops: on CPUs they are collectives whose keys TensorFlow
    # draws afresh per strategy, and they meet the keys of the collective
    # transports made before in this process.
    return tf.distribute.MirroredStrategy(
        DEVICES[:N], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


SETTINGS = {
    "plain": {},
    "sharded": {"shard_optimizer_state": True},
    "accumulated": {"gradient_accumulation_steps": 2},
    "sharded_accumulated": {"shard_optimizer_state": True, "gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("setting", ["plain", "sharded"])
@pytest.mark.parametrize("transport", ["local", "collective"])
def test_subsets_in_any_order_train_as_stock_keras(setting, transport):
    start, want = train_two_optimizers(
        stock_strategy(), lambda: keras.optimizers.Adam(0.05), "reversed"
    )
    _, got = train_two_optimizers(
        tf_agn.strategies.mirrored(DEVICES[:N], transport=transport),
        lambda: tf_agn.optimizers.Adam(0.05, **SETTINGS[setting]),
        "reversed",
    )
    assert deviation(got, want, start) <= 1e-6
    # The aux head had no gradient and moved on no path.
    assert np.array_equal(got[-2], start[-2]) and np.array_equal(got[-1], start[-1])


@pytest.mark.parametrize("compressed", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_reordered_call_sends_and_updates_as_the_built_order(setting, compressed):
    # On the collective transport, where every replica's collectives must
    # carry the same values in the same order; int8's packs (and so its
    # chunks of 8 and their scales) would differ with the call's order.
    compression = tf_agn.compression.Int8(chunk_size=8) if compressed else None
    strategy = lambda: tf_agn.strategies.mirrored(DEVICES[:N], transport="collective")
    make = lambda: tf_agn.optimizers.Adam(0.05, compression=compression, **SETTINGS[setting])
    _, built = train_two_optimizers(strategy(), make, "built")
    _, reversed_ = train_two_optimizers(strategy(), make, "reversed")
    for b, r in zip(built, reversed_):
        np.testing.assert_array_equal(b, r)


def embedding_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(40, 6, name="words"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])


def fit_embedding(strategy, make_optimizer):
    with strategy.scope():
        model = embedding_model()
        model.compile(make_optimizer(), loss="mse")
    before = model.get_weights()
    model.fit(IDS, Y, batch_size=N * BATCH, epochs=1, shuffle=False, verbose=0)
    return model, before, model.get_weights()


@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
@pytest.mark.parametrize("setting", ["plain", "sharded"])
def test_sparse_gradients_train_as_stock_keras(optimizer, setting):
    # Keras's update rules treat tf.IndexedSlices slice by slice (Adam
    # squares each slice before repeated rows are summed): a densified
    # gradient puts the table tens of percent away.
    _, start, want = fit_embedding(
        stock_strategy(), lambda: getattr(keras.optimizers, optimizer)(0.05)
    )
    _, _, got = fit_embedding(
        tf_agn.strategies.mirrored(DEVICES[:N]),
        lambda: getattr(tf_agn.optimizers, optimizer)(0.05, **SETTINGS[setting]),
    )
    assert deviation(got, want, start) <= 1e-6


def test_sharded_int8_keeps_no_state_for_a_declared_sparse_table():
    model, start, got = fit_embedding(
        tf_agn.strategies.mirrored(DEVICES[:N]),
        lambda: tf_agn.optimizers.Adam(
            0.05, compression="int8", sparse_gradients=["words"], shard_optimizer_state=True
        ),
    )
    residuals = [v.path for v in model.optimizer.variables if "residual" in v.path]
    assert residuals and not [path for path in residuals if "words" in path]
    # The table travels uncompressed, so it moves as with stock Keras's Adam
    # until the int8-compressed head's error reaches it through the loss.
    _, _, want = fit_embedding(stock_strategy(), lambda: keras.optimizers.Adam(0.05))
    assert deviation(got, want, start) <= 0.05
