"""tf_agn's aggregating optimizers under a real 4-replica MirroredStrategy."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import stock_mirrored
from conftest import NUM_REPLICAS
from mlp import BATCH
from mlp import LEARNING_RATE
from mlp import METHODS
from mlp import build_mlp
from mlp import data
from mlp import initial_params
from reference import sgd_trajectory
from tf_agn.optimizers import DistributedOptimizer

def fit_mlp(strategy, optimizer_fn, steps=3, **fit_kwargs):
    x, y = data(steps)
    with strategy.scope():
        model = build_mlp(initial_params())
        model.compile(optimizer=optimizer_fn(), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    return model


def expected(method, steps=3, **kwargs):
    x, y = data(steps)
    return sgd_trajectory(
        initial_params(), x, y, method, NUM_REPLICAS, BATCH, LEARNING_RATE, **kwargs
    )


def assert_replicas_close(model, reference, atol=1e-5):
    actual = tf_agn.replica_weights(model)
    assert len(actual) == len(reference)
    for replica, (got, want) in enumerate(zip(actual, reference)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(
                g, w, rtol=1e-4, atol=atol, err_msg=f"replica {replica}"
            )


@pytest.mark.parametrize("method", METHODS)
def test_drop_in_sgd_matches_numpy_reference(method):
    strategy = tf_agn.strategies.mirrored(DEVICES)
    model = fit_mlp(
        strategy,
        lambda: tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method=method),
    )
    assert_replicas_close(model, expected(method))


@pytest.mark.parametrize("method", METHODS)
def test_strategy_default_aggregation_is_used(method):
    strategy = tf_agn.strategies.mirrored(DEVICES, aggregation=method)
    model = fit_mlp(strategy, lambda: tf_agn.optimizers.SGD(LEARNING_RATE))
    assert_replicas_close(model, expected(method))


def test_optimizer_method_wins_over_strategy_default():
    strategy = tf_agn.strategies.mirrored(DEVICES, aggregation="none")
    model = fit_mlp(
        strategy,
        lambda: tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method="sum"),
    )
    assert_replicas_close(model, expected("sum"))


@pytest.mark.parametrize("method", METHODS)
def test_distributed_optimizer_under_stock_cross_device_ops(method):
    # Stock ops: the optimizer falls back to a weighted all_reduce(SUM).
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    model = fit_mlp(
        strategy,
        lambda: DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE), method),
    )
    assert_replicas_close(model, expected(method))


def test_mean_equals_stock_keras():
    stock = fit_mlp(
        stock_mirrored(),
        lambda: keras.optimizers.SGD(LEARNING_RATE),
    )
    ours = fit_mlp(
        tf_agn.strategies.mirrored(DEVICES),
        lambda: DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE)),
    )
    for a, b in zip(stock.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["sum", "none"])
def test_distributed_optimizer_keeps_the_method_of_the_optimizer_it_wraps(method):
    # The strategy's default is MEAN: the wrapper must not put it in place of
    # the wrapped optimizer's own.
    model = fit_mlp(
        tf_agn.strategies.mirrored(DEVICES),
        lambda: DistributedOptimizer(
            tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method=method)
        ),
    )
    assert model.optimizer.aggregation is tf_agn.AggregationMethod.parse(method)
    assert model.optimizer.get_config()["aggregation_method"] == method
    assert_replicas_close(model, expected(method))


def test_distributed_optimizer_default_is_the_strategys_as_for_drop_ins():
    model = fit_mlp(
        tf_agn.strategies.mirrored(DEVICES, aggregation="sum"),
        lambda: DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE)),
    )
    assert model.optimizer.aggregation is tf_agn.AggregationMethod.SUM
    assert_replicas_close(model, expected("sum"))


def test_none_lets_replicas_drift_apart():
    strategy = tf_agn.strategies.mirrored(DEVICES)
    model = fit_mlp(
        strategy,
        lambda: tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method="none"),
    )
    copies = tf_agn.replica_weights(model)
    for r in range(1, NUM_REPLICAS):
        assert not np.allclose(copies[0][0], copies[r][0])


def test_global_clipnorm_applies_to_the_aggregated_gradient():
    # With SUM the combined gradient is ~4x each replica's, so clipping
    # before or after aggregation gives different weights.
    strategy = tf_agn.strategies.mirrored(DEVICES)
    model = fit_mlp(
        strategy,
        lambda: tf_agn.optimizers.SGD(
            LEARNING_RATE, aggregation_method="sum", global_clipnorm=0.05
        ),
    )
    assert_replicas_close(model, expected("sum", global_clipnorm=0.05))


def test_sparse_embedding_gradients():
    # Rows 0..7 of a 10-row table; replicas see different, overlapping ids,
    # so the gathered IndexedSlices carry repeated indices.
    ids = np.array([[0, 1], [1, 2], [2, 3], [3, 3], [4, 5], [5, 6], [6, 7], [7, 0]] * 2)
    targets = np.linspace(-1, 1, len(ids) * 2).reshape(len(ids), 2).astype("float32")
    table = np.random.RandomState(3).randn(10, 2).astype("float32")

    def reference(method):
        per_replica = []
        shard = BATCH // NUM_REPLICAS
        for r in range(NUM_REPLICAS):
            rows = slice(r * shard, (r + 1) * shard)
            variable = tf.Variable(table.astype("float64"))
            with tf.GradientTape() as tape:
                summed = tf.reduce_sum(tf.gather(variable, ids[rows]), axis=1)
                loss = tf.reduce_mean(tf.square(summed - targets[rows]))
            per_replica.append(tf.convert_to_tensor(tape.gradient(loss, variable)).numpy())
        grads = np.stack(per_replica)
        combined = {"sum": grads.sum(0), "mean": grads.mean(0), "only_first_replica": grads[0]}[method]
        return table - LEARNING_RATE * combined

    for method in ["sum", "mean", "only_first_replica"]:
        with tf_agn.strategies.mirrored(DEVICES).scope():
            inputs = keras.Input((2,), dtype="int32")
            embedded = keras.layers.Embedding(10, 2)(inputs)
            model = keras.Model(inputs, keras.ops.sum(embedded, axis=1))
            model.set_weights([table])
            model.compile(
                tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method=method), "mse"
            )
        model.fit(ids, targets, batch_size=BATCH, shuffle=False, verbose=0)
        for copy in tf_agn.replica_weights(model):
            np.testing.assert_allclose(copy[0], reference(method), rtol=1e-5, atol=1e-6)


def test_save_and_load_continue_training_identically(tmp_path):
    x, y = data(steps=4)
    strategy = tf_agn.strategies.mirrored(DEVICES)

    def compiled():
        model = build_mlp(initial_params())
        model.compile(
            DistributedOptimizer(keras.optimizers.Adam(0.01), aggregation_method="sum"),
            loss="mse",
        )
        return model

    with strategy.scope():
        uninterrupted = compiled()
        resumed = compiled()
    uninterrupted.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    resumed.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    resumed.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, DistributedOptimizer)
    assert loaded.optimizer.aggregation is tf_agn.AggregationMethod.SUM
    assert int(loaded.optimizer.iterations.numpy()) == 2
    loaded.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(uninterrupted.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [tf_agn.optimizers.SGD, tf_agn.optimizers.Adam, tf_agn.optimizers.AdamW, tf_agn.optimizers.RMSprop])
def test_drop_in_config_round_trip(cls):
    optimizer = cls(learning_rate=0.02, aggregation_method="ONLY_FIRST_REPLICA", clipnorm=1.5)
    config = optimizer.get_config()
    assert config["aggregation_method"] == "only_first_replica"
    restored = cls.from_config(config)
    assert restored.aggregation_method is tf_agn.AggregationMethod.ONLY_FIRST_REPLICA
    assert restored.clipnorm == 1.5
    assert restored.get_config() == config
    assert isinstance(restored, keras.optimizers.Optimizer)


def test_distributed_optimizer_config_round_trip():
    wrapped = DistributedOptimizer(keras.optimizers.RMSprop(0.003, rho=0.8), "sum")
    config = wrapped.get_config()
    assert config["optimizer"]["class_name"] == "RMSprop"
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(wrapped))
    assert isinstance(restored, DistributedOptimizer)
    assert restored.aggregation is tf_agn.AggregationMethod.SUM
    assert isinstance(restored.inner_optimizer, keras.optimizers.RMSprop)
    assert restored.inner_optimizer.rho == 0.8
    np.testing.assert_allclose(float(restored.learning_rate.numpy()), 0.003, rtol=1e-6)


@pytest.mark.parametrize(
    "strategy_fn",
    [
        lambda: tf.distribute.get_strategy(),
        lambda: tf.distribute.OneDeviceStrategy(DEVICES[0]),
        lambda: tf_agn.strategies.mirrored(DEVICES[:1]),
    ],
    ids=["no_strategy", "one_device", "mirrored_one_replica"],
)
@pytest.mark.parametrize("method", ["sum", "only_first_replica"])
def test_single_replica_is_plain_sgd(strategy_fn, method):
    # With one replica every method is the replica's own gradient.
    model = fit_mlp(
        strategy_fn(),
        lambda: tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method=method),
    )
    x, y = data()
    reference = sgd_trajectory(initial_params(), x, y, "none", 1, BATCH, LEARNING_RATE)
    assert_replicas_close(model, reference)


def test_steps_per_execution_without_strategy():
    single = fit_mlp(
        tf.distribute.get_strategy(),
        lambda: tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method="sum"),
        steps=4,
    )
    x, y = data(4)
    with tf.distribute.get_strategy().scope():
        model = build_mlp(initial_params())
        model.compile(
            tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method="sum"),
            loss="mse",
            steps_per_execution=2,
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_mixed_precision_under_mirrored_strategy():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = fit_mlp(
            tf_agn.strategies.mirrored(DEVICES),
            lambda: DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE), "mean"),
            steps=4,
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, DistributedOptimizer)
    # float16 activations: within float16 resolution of the float32 path,
    # and every replica applied the same update.
    assert_replicas_close(model, expected("mean", steps=4), atol=3e-3)
    copies = tf_agn.replica_weights(model)
    for copy in copies[1:]:
        for a, b in zip(copy, copies[0]):
            np.testing.assert_array_equal(a, b)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="average.*Allowed: none, sum, mean, only_first_replica"):
        tf_agn.optimizers.Adam(aggregation_method="average")
    with pytest.raises(ValueError, match="Allowed"):
        DistributedOptimizer(keras.optimizers.SGD(), aggregation_method="max")
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        DistributedOptimizer(tf.Module())
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        DistributedOptimizer("sgd")


@pytest.mark.parametrize("method", ["mean", "only_first_replica", "none"])
def test_steps_per_execution_under_mirrored_strategy(method):
    # Stock Keras 3.15 fails here (keras-team/keras#19246). Our update path
    # updates each replica's copy in replica context, so the step's tf.cond
    # holds no cross-device update.
    x, y = data(4)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = build_mlp(initial_params())
        model.compile(
            tf_agn.optimizers.SGD(LEARNING_RATE, aggregation_method=method),
            loss="mse",
            steps_per_execution=2,
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_replicas_close(model, expected(method, steps=4))


@pytest.mark.parametrize(
    "method, compression, calls, bytes_per_element",
    [
        ("mean", None, 3, 4),
        ("only_first_replica", None, 3, 4),
        ("sum", "fp16", 3, 2),
        ("none", None, 0, 0),
    ],
)
def test_communication_stats(method, compression, calls, bytes_per_element):
    model = fit_mlp(
        tf_agn.strategies.mirrored(DEVICES, compression=compression),
        lambda: DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE), method),
    )
    num_elements = sum(p.size for p in initial_params())
    assert model.optimizer.communication_stats() == {
        "all_reduce_calls": calls,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": calls * num_elements * bytes_per_element,
        "bytes_received": calls * num_elements * bytes_per_element,
    }


def test_optimizer_created_outside_the_scope_is_refused_clearly():
    optimizer = tf_agn.optimizers.SGD(LEARNING_RATE)
    with pytest.raises(ValueError, match="Create it inside the `strategy.scope"):
        fit_mlp(tf_agn.strategies.mirrored(DEVICES), lambda: optimizer)


@pytest.mark.parametrize(
    "name, accumulation",
    [("SGD", None), ("Adam", None), ("AdamW", None), ("RMSprop", None), ("SGD", 2)],
)
def test_state_is_keras_own_and_loads_from_it(name, accumulation):
    """A drop-in's variables are those of Keras' class of the same name, in
    the same order, so state saved by either loads into the other."""
    kwargs = {"gradient_accumulation_steps": accumulation}
    if name != "Adam":  # the others keep no moments unless asked
        kwargs.update({"SGD": {"momentum": 0.9}, "AdamW": {}, "RMSprop": {"momentum": 0.5}}[name])
    strategy = tf_agn.strategies.mirrored(DEVICES)
    x, y = data(steps=4)
    with strategy.scope():
        model = build_mlp(initial_params())
        ours = getattr(tf_agn.optimizers, name)(0.01, **kwargs)
        model.compile(ours, loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    # Keras' own, trained on one device.
    keras_model = build_mlp(initial_params())
    keras_own = getattr(keras.optimizers, name)(0.01, **kwargs)
    keras_model.compile(keras_own, loss="mse")
    keras_model.fit(x[: 3 * BATCH], y[: 3 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)

    def names(optimizer):
        # Layer names carry a counter (dense_3); what follows is Keras' name.
        return [
            re.sub(r"^sequential(_\d+)?_dense(_\d+)?_", "", v.path.split("/")[-1])
            for v in optimizer.variables
        ]

    assert len(ours.variables) == len(keras_own.variables)
    assert names(ours) == names(keras_own)
    keras_state = {}
    keras_own.save_own_variables(keras_state)
    ours.load_own_variables(keras_state)
    for got, want in zip(ours.variables, keras_own.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    ours_state = {}
    ours.save_own_variables(ours_state)
    assert sorted(ours_state) == sorted(keras_state)
