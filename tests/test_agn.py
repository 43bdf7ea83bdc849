"""AGN under a real 4-replica MirroredStrategy, against numpy references."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import NUM_REPLICAS
from mlp import BATCH
from mlp import LEARNING_RATE
from mlp import build_mlp
from mlp import data
from mlp import initial_params
from reference import sgd_trajectory
from tf_agn.optimizers import AGN

SHARD = BATCH // NUM_REPLICAS


def linear_data(steps, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(BATCH * steps, 3)
    y = x @ rng.randn(3, 2) + 0.1 * rng.randn(BATCH * steps, 2)
    return x.astype("float32"), y.astype("float32")


def linear_model(kernel, bias):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([kernel, bias])
    return model


def linear_gradients(kernel, bias, x, y):
    """Closed-form gradients of the mean squared error of x @ kernel + bias."""
    residual = x @ kernel + bias - y
    scale = 2.0 / residual.size
    return scale * x.T @ residual, scale * residual.sum(0)


def agn_reference(x, y, method, local_steps, steps, normalize=True):
    """Per-replica weights after each step, and the center after each, of
    AGN with SGD(LEARNING_RATE) inside and SGD(1.0) outside."""
    rng = np.random.RandomState(1)
    center = [rng.randn(3, 2) * 0.5, rng.randn(2) * 0.1]
    replicas = [list(center) for _ in range(NUM_REPLICAS)]
    history = []
    for step in range(steps):
        for r in range(NUM_REPLICAS):
            rows = slice(step * BATCH + r * SHARD, step * BATCH + (r + 1) * SHARD)
            grads = linear_gradients(*replicas[r], x[rows], y[rows])
            replicas[r] = [w - LEARNING_RATE * g for w, g in zip(replicas[r], grads)]
        if (step + 1) % local_steps == 0:
            divisor = local_steps if normalize else 1
            deltas = [
                [(w - c) / divisor for w, c in zip(weights, center)]
                for weights in replicas
            ]
            stacked = [np.stack(parts) for parts in zip(*deltas)]
            combined = {
                "mean": [s.mean(0) for s in stacked],
                "sum": [s.sum(0) for s in stacked],
                "only_first_replica": [s[0] for s in stacked],
            }[method]
            center = [c + d for c, d in zip(center, combined)]
            replicas = [list(center) for _ in range(NUM_REPLICAS)]
        history.append(([list(w) for w in replicas], list(center)))
    return history


def initial_linear():
    rng = np.random.RandomState(1)
    return (rng.randn(3, 2) * 0.5).astype("float32"), (rng.randn(2) * 0.1).astype(
        "float32"
    )


class RecordStates(keras.callbacks.Callback):
    """Records every replica's weights and the center after each step."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        centers = [c.numpy() for c in self.model.optimizer.center_variables]
        self.states.append((tf_agn.replica_weights(self.model), centers))


def train_linear(method, local_steps, steps, normalize=True, strategy=None):
    """Fits one epoch; returns the model and the state after each step."""
    strategy = strategy or tf_agn.strategies.mirrored(DEVICES)
    x, y = linear_data(steps)
    with strategy.scope():
        model = linear_model(*initial_linear())
        model.compile(
            AGN(
                keras.optimizers.SGD(LEARNING_RATE),
                local_steps=local_steps,
                aggregation_method=method,
                normalize=normalize,
            ),
            loss="mse",
        )
    record = RecordStates()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[record])
    return model, record.states


@pytest.mark.parametrize("method", ["mean", "sum"])
def test_three_local_steps_match_hand_computed_reference(method):
    steps = 6
    x, y = linear_data(steps)
    reference = agn_reference(x, y, method, local_steps=3, steps=steps)
    _, states = train_linear(method, 3, steps)
    for step, (replicas, center) in enumerate(states):
        want_replicas, want_center = reference[step]
        for r in range(NUM_REPLICAS):
            for got, want in zip(replicas[r], want_replicas[r]):
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {step} replica {r}"
                )
        for got, want in zip(center, want_center):
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {step} center"
            )
        if step % 3 != 2:  # mid-window: the replicas explore apart
            assert not np.allclose(replicas[0][0], replicas[1][0])


def test_one_local_step_is_synchronous_sgd():
    x, y = data(steps=3)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = build_mlp(initial_params())
        model.compile(
            AGN(keras.optimizers.SGD(LEARNING_RATE), local_steps=1), loss="mse"
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    reference = sgd_trajectory(
        initial_params(), x, y, "mean", NUM_REPLICAS, BATCH, LEARNING_RATE
    )
    for copy, want in zip(tf_agn.replica_weights(model), reference):
        for got, expected in zip(copy, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_unnormalized_commit_is_lambda_times_larger():
    local_steps = 4
    start = initial_linear()
    _, [*_, (_, normalized)] = train_linear("mean", local_steps, local_steps)
    _, [*_, (_, unnormalized)] = train_linear(
        "mean", local_steps, local_steps, normalize=False
    )
    for s, n, u in zip(start, normalized, unnormalized):
        np.testing.assert_allclose(u - s, local_steps * (n - s), rtol=1e-4, atol=1e-6)


def test_bytes_sent_scale_as_one_over_local_steps():
    stats = {}
    for local_steps in (1, 4):
        model, _ = train_linear("mean", local_steps, 12)
        stats[local_steps] = model.optimizer.communication_stats()
    num_elements = 3 * 2 + 2
    assert stats[1] == {
        "all_reduce_calls": 12,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": 12 * num_elements * 4,
        "bytes_received": 12 * num_elements * 4,
    }
    assert stats[4] == {
        "all_reduce_calls": 3,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": 3 * num_elements * 4,
        "bytes_received": 3 * num_elements * 4,
    }


def test_without_strategy_local_steps_then_outer_step():
    steps = 4
    x, y = linear_data(steps)
    start = initial_linear()
    weights = [w.astype("float64") for w in start]
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        grads = linear_gradients(*weights, x[rows], y[rows])
        weights = [w - LEARNING_RATE * g for w, g in zip(weights, grads)]
    # One replica, one window of 4: the center moves by (θ - θ_c) / 4.
    expected_center = [s + (w - s) / 4 for s, w in zip(start, weights)]
    _, [*_, (replicas, center)] = train_linear(
        "mean", 4, steps, strategy=tf.distribute.get_strategy()
    )
    for got, want in zip(center, expected_center):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(replicas[0], expected_center):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fit_commits_a_partial_window_at_the_end():
    x, y = linear_data(5)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = linear_model(*initial_linear())
        model.compile(
            AGN(keras.optimizers.SGD(LEARNING_RATE), local_steps=3), loss="mse"
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    copies = tf_agn.replica_weights(model)
    centers = [c.numpy() for c in model.optimizer.center_variables]
    for copy in copies:
        for got, want in zip(copy, centers):
            np.testing.assert_array_equal(got, want)
    assert model.optimizer.communication_stats()["all_reduce_calls"] == 2


def test_config_round_trip():
    optimizer = AGN(
        keras.optimizers.Adam(1e-3),
        local_steps=8,
        aggregation_method="sum",
        outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
        normalize=False,
        reset_inner_state=True,
    )
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, AGN)
    assert restored.local_steps == 8
    assert restored.aggregation is tf_agn.AggregationMethod.SUM
    assert not restored.normalize and restored.reset_inner_state
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert (
        restored.outer_optimizer.nesterov and restored.outer_optimizer.momentum == 0.9
    )
    assert restored.get_config() == optimizer.get_config()


@pytest.mark.parametrize("local_steps", [0, -2, 2.5, True, "3", None])
def test_bad_local_steps(local_steps):
    with pytest.raises(ValueError, match="local_steps must be an int >= 1"):
        AGN(keras.optimizers.SGD(), local_steps=local_steps)


def test_bad_optimizers_and_outer_learning_rate():
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        AGN(object(), local_steps=2)
    with pytest.raises(TypeError, match="outer_optimizer"):
        AGN(keras.optimizers.SGD(), local_steps=2, outer_optimizer="sgd")
    for rate in (0.0, -1.0):
        with pytest.raises(
            ValueError, match="outer optimizer's learning rate must be > 0"
        ):
            AGN(
                keras.optimizers.SGD(),
                local_steps=2,
                outer_optimizer=keras.optimizers.SGD(rate),
            )


@pytest.mark.parametrize("algorithm", [AGN, tf_agn.optimizers.DOWNPOUR, tf_agn.optimizers.AEASGD])
def test_validation_mid_window_uses_the_center(algorithm):
    # λ = 4 and 2 steps: validation runs mid-window, before any commit, so
    # the center is still the initial weights.
    x, y = linear_data(2)
    x_val, y_val = linear_data(1, seed=5)
    kernel, bias = initial_linear()
    expected_loss = np.mean((x_val @ kernel + bias - y_val) ** 2)

    def run(callbacks):
        with tf_agn.strategies.mirrored(DEVICES).scope():
            model = linear_model(kernel, bias)
            model.compile(
                algorithm(keras.optimizers.SGD(LEARNING_RATE), local_steps=4), loss="mse"
            )
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            validation_data=(x_val, y_val),
            validation_batch_size=BATCH,
            callbacks=callbacks,
        )
        return history.history["val_loss"][0], model.get_weights()

    at_center, weights = run([tf_agn.callbacks.EvaluateAtCenter()])
    on_replicas, reference_weights = run([])
    np.testing.assert_allclose(at_center, expected_loss, rtol=1e-5)
    assert abs(on_replicas - expected_loss) > 1e-3
    # The swaps are exact: training ends where it would without them.
    for got, want in zip(weights, reference_weights):
        np.testing.assert_array_equal(got, want)


def test_communication_logger_reaches_the_history():
    x, y = linear_data(8)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = linear_model(*initial_linear())
        model.compile(
            AGN(keras.optimizers.SGD(LEARNING_RATE), local_steps=4), loss="mse"
        )
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[tf_agn.callbacks.CommunicationLogger()],
    )
    assert history.history["all_reduce_calls"] == [2, 4]
    assert history.history["bytes_sent"] == [2 * 8 * 4, 4 * 8 * 4]


def test_callbacks_refuse_other_optimizers():
    model = linear_model(*initial_linear())
    model.compile(keras.optimizers.SGD(), loss="mse")
    x, y = linear_data(1)
    with pytest.raises(ValueError, match="EvaluateAtCenter needs"):
        model.evaluate(x, y, verbose=0, callbacks=[tf_agn.callbacks.EvaluateAtCenter()])
    with pytest.raises(ValueError, match="CommunicationLogger needs"):
        model.fit(x, y, verbose=0, callbacks=[tf_agn.callbacks.CommunicationLogger()])


def test_save_mid_window_resumes_from_replica_zero(tmp_path):
    # Documented behaviour: a .keras file saved mid-window holds replica 0's
    # copy of the weights and of the inner state, the center and the window
    # position; after loading, every replica continues the window from
    # replica 0's copy.
    x, y = linear_data(8)
    path = str(tmp_path / "agn.keras")
    strategy = tf_agn.strategies.mirrored(DEVICES)

    class SaveAfterFiveSteps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch != 4:
                return
            copies = tf_agn.replica_weights(self.model)
            assert not np.allclose(copies[0][0], copies[1][0])  # mid-window
            self.model.save(path)
            # Then do to this model what loading does to the saved one.
            for variable in self.model.weights + self.model.optimizer.variables:
                variable.assign(variable.numpy())

    with strategy.scope():
        model = linear_model(*initial_linear())
        model.compile(AGN(keras.optimizers.Adam(0.05), local_steps=4), loss="mse")
    model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[SaveAfterFiveSteps()],
    )

    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations.numpy()) == 5
    loaded.fit(
        x[5 * BATCH :], y[5 * BATCH :], batch_size=BATCH, shuffle=False, verbose=0
    )
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(
        loaded.optimizer.center_variables, model.optimizer.center_variables
    ):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["mean", "sum"])
def test_steps_per_execution_under_mirrored_strategy(method):
    steps = 6
    x, y = linear_data(steps)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = linear_model(*initial_linear())
        model.compile(
            AGN(keras.optimizers.SGD(LEARNING_RATE), local_steps=3, aggregation_method=method),
            loss="mse",
            steps_per_execution=2,
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    replicas, center = agn_reference(x, y, method, local_steps=3, steps=steps)[-1]
    for copy in tf_agn.replica_weights(model):
        for got, want in zip(copy, center):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = linear_data(6)
        with tf_agn.strategies.mirrored(DEVICES).scope():
            model = linear_model(*initial_linear())
            model.compile(
                AGN(keras.optimizers.SGD(LEARNING_RATE), local_steps=3), loss="mse"
            )
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _, center = agn_reference(x, y, "mean", local_steps=3, steps=6)[-1]
    for copy in tf_agn.replica_weights(model):
        for got, want in zip(copy, center):
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=3e-3)


def test_synchronous_easgd_moves_replicas_and_center_symmetrically():
    # The elastic rule under MirroredStrategy: at a window's end each
    # replica moves by E_r = α(θ_r − θ_c) towards the center, and the center
    # by Σ_r E_r towards the replicas; replicas keep their own weights.
    steps, local_steps, moving_rate = 6, 3, 0.25
    x, y = linear_data(steps)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = linear_model(*initial_linear())
        model.compile(
            tf_agn.optimizers.AEASGD(
                keras.optimizers.SGD(LEARNING_RATE),
                local_steps=local_steps,
                rho=5.0,
                elastic_learning_rate=moving_rate / 5.0,
            ),
            loss="mse",
        )
    record = RecordStates()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[record])

    center = [w.astype(np.float64) for w in initial_linear()]
    replicas = [list(center) for _ in range(NUM_REPLICAS)]
    for step in range(steps):
        for r in range(NUM_REPLICAS):
            rows = slice(step * BATCH + r * SHARD, step * BATCH + (r + 1) * SHARD)
            grads = linear_gradients(*replicas[r], x[rows], y[rows])
            replicas[r] = [w - LEARNING_RATE * g for w, g in zip(replicas[r], grads)]
        if (step + 1) % local_steps == 0:
            forces = [
                [moving_rate * (w - c) for w, c in zip(weights, center)]
                for weights in replicas
            ]
            replicas = [
                [w - e for w, e in zip(weights, force)]
                for weights, force in zip(replicas, forces)
            ]
            center = [c + sum(parts) for c, parts in zip(center, zip(*forces))]
        got_replicas, got_center = record.states[step]
        for got, want in zip(got_center, center):
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-6, err_msg=f"step {step}"
            )
        for r in range(NUM_REPLICAS):
            for got, want in zip(got_replicas[r], replicas[r]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Unlike AGN, the replicas stay apart after an exchange.
    assert not np.allclose(record.states[-1][0][0][0], record.states[-1][0][1][0])


def test_memory_stats_count_centers_and_both_optimizers_states():
    strategy = tf_agn.strategies.mirrored(DEVICES)
    with strategy.scope():
        model = tf_agn.models.mlp((5,), 2, hidden_units=(4,))
        model.compile(
            tf_agn.optimizers.AGN(keras.optimizers.Adam(), local_steps=2, compression="int8"),
            "sparse_categorical_crossentropy",
        )
    x = np.zeros((16, 5), np.float32)
    model.fit(x, np.zeros(16), batch_size=16, verbose=0)
    weights = 4 * (5 * 4 + 4 + 4 * 2 + 2)
    counters = 3 * (8 + 4)  # the wrapper's, Adam's and the outer SGD's
    assert model.optimizer.memory_stats() == {
        "weights": weights, "gradients": weights, "accumulators": 0,
        # The centers, and Adam's two moments.
        "optimizer_state": 3 * weights + counters, "compressor_state": weights,
    }


def test_a_commit_moves_only_the_variables_the_optimizer_steps():
    # A GAN's shape: AGN is built on both variables but steps `own` alone;
    # a plain optimizer steps `other`, which AGN's commits must not touch.
    strategy = tf_agn.strategies.mirrored(DEVICES[:2])
    with strategy.scope():
        own, other = keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones(3, np.float32))
        agn = tf_agn.optimizers.AGN(keras.optimizers.SGD(0.1), local_steps=2)
        agn.build([own, other])
        plain = tf_agn.optimizers.SGD(0.1)
        plain.build([other])

    @tf.function
    def step():
        def replica():
            gradient = tf.fill([3], 1.0 / strategy.num_replicas_in_sync)  # Keras's 1/n
            agn.apply([gradient], [own])
            plain.apply([gradient], [other])

        strategy.run(replica)

    step()
    step()
    # Two local steps of -0.1 each, committed divided by λ = 2.
    np.testing.assert_allclose(own.numpy(), np.full(3, 0.9), rtol=1e-6)
    np.testing.assert_allclose(other.numpy(), np.full(3, 0.8), rtol=1e-6)


def test_a_windowed_optimizer_refuses_a_wrapper_inside():
    with pytest.raises(ValueError, match="AGN wraps a Keras optimizer, not DistributedOptimizer"):
        tf_agn.optimizers.AGN(
            tf_agn.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1)), local_steps=2
        )
