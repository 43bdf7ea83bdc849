"""`tf_agn.decoupled.DecoupledModel`: BP is exact, ADL's delayed updates
match an independent reference, the schedule's delays and staleness are the
formula's, and ADL learns MNIST as well as BP."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from tf_agn.decoupled import DecoupledModel
from tf_agn.decoupled import split_model
from tf_agn.decoupled.schedule import Schedule


def tiny_stages(num_stages, width=4, seed=0):
    """K − 1 stages of one tanh layer on 3 features, then a linear head."""
    keras.utils.set_random_seed(seed)
    shapes = [3] + [width] * num_stages
    stages = [
        keras.Sequential(
            [keras.Input((n,)), keras.layers.Dense(width, activation="tanh")]
        )
        for n in shapes[:-2]
    ]
    stages.append(keras.Sequential([keras.Input((shapes[-2],)), keras.layers.Dense(2)]))
    return stages


def regression_data(num_examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, 3)).astype("float32")
    y = rng.normal(size=(num_examples, 2)).astype("float32")
    return x, y


def fit_tiny(devices, num_stages, num_batches, batch_size=4, **kwargs):
    """Trains `tiny_stages` for one epoch of `num_batches` with SGD(0.1)."""
    model = DecoupledModel(tiny_stages(num_stages), devices[:num_stages], **kwargs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = regression_data(num_batches * batch_size)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


# BP is backpropagation ----------------------------------------------------


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_bp_equals_single_model_training(devices, accumulation_steps):
    keras.utils.set_random_seed(0)
    model = tf_agn.models.mlp((784,), 10, hidden_units=(64, 32))
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    (x, y), _ = tf_agn.datasets.load("mnist5k")
    x, y = x[:512], y[:512]
    batch_size, epochs = 64, 2

    decoupled = DecoupledModel(
        split_model(model, 3),
        devices[:3],
        accumulation_steps=accumulation_steps,
        schedule="bp",
    )
    decoupled.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    decoupled.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)

    # The same batches in the same order through one model and one Adam,
    # the mean of every `accumulation_steps` batches' gradients per step.
    optimizer = keras.optimizers.Adam(1e-3)
    loss = keras.losses.SparseCategoricalCrossentropy()
    batches = [
        (x[i : i + batch_size], y[i : i + batch_size])
        for i in range(0, len(x), batch_size)
    ] * epochs
    for start in range(0, len(batches), accumulation_steps):
        grads = []
        for x_batch, y_batch in batches[start : start + accumulation_steps]:
            with tf.GradientTape() as tape:
                value = loss(y_batch, reference(x_batch, training=True))
            grads.append(tape.gradient(value, reference.trainable_variables))
        optimizer.apply(
            [tf.add_n(g) / accumulation_steps for g in zip(*grads)],
            reference.trainable_variables,
        )
    for got, want in zip(decoupled.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ADL's delayed, accumulated update ------------------------------------------


def adl_reference(stages, x, y, batch_size, learning_rate, steps, reduction):
    """ADL for K = 2 in numpy, float64, written out tick by tick.

    Stage 1 (D = 0) forwards, takes the MSE and backpropagates batch t − 1 at
    tick t. Stage 0 forwards batch t and backpropagates batch t − 2 (D = 2)
    by recomputing tanh(x W0 + b0) with its current weights, chained with
    the gradient stage 1 sent at tick t − 1. Both read their weights at the
    start of the tick and apply SGD at its end, after `steps` backward
    passes (mean or sum).
    """
    w0, b0 = (w.astype(np.float64) for w in stages[0].get_weights())
    w1, b1 = (w.astype(np.float64) for w in stages[1].get_weights())
    xs = x.astype(np.float64).reshape(-1, batch_size, x.shape[1])
    ys = y.astype(np.float64).reshape(-1, batch_size, y.shape[1])
    num_batches = len(xs)
    scale = learning_rate / (steps if reduction == "mean" else 1)
    sent_activation, sent_gradient = {}, {}
    accumulated = [[0, 0], [0, 0]]
    counts = [0, 0]
    for tick in range(num_batches + 2):
        updates = {}
        if 0 <= tick - 1 < num_batches:
            b = tick - 1
            activation = sent_activation[b]
            out = activation @ w1 + b1
            d_out = 2 * (out - ys[b]) / out.size
            sent_gradient[b] = d_out @ w1.T
            updates[1] = (activation.T @ d_out, d_out.sum(0))
        if 0 <= tick - 2 < num_batches:
            b = tick - 2
            hidden = np.tanh(xs[b] @ w0 + b0)
            d_pre = sent_gradient[b] * (1 - hidden**2)
            updates[0] = (xs[b].T @ d_pre, d_pre.sum(0))
        if tick < num_batches:
            sent_activation[tick] = np.tanh(xs[tick] @ w0 + b0)
        for k, (d_w, d_b) in updates.items():
            accumulated[k] = [accumulated[k][0] + d_w, accumulated[k][1] + d_b]
            counts[k] += 1
            if counts[k] == steps:
                if k == 0:
                    w0, b0 = (
                        w0 - scale * accumulated[0][0],
                        b0 - scale * accumulated[0][1],
                    )
                else:
                    w1, b1 = (
                        w1 - scale * accumulated[1][0],
                        b1 - scale * accumulated[1][1],
                    )
                accumulated[k], counts[k] = [0, 0], 0
    return [w0, b0, w1, b1]


@pytest.mark.parametrize(
    "accumulation_steps, reduction", [(1, "mean"), (2, "mean"), (2, "sum")]
)
def test_adl_update_matches_reference(devices, accumulation_steps, reduction):
    num_batches, batch_size = 6, 4
    stages = tiny_stages(2)
    expected = adl_reference(
        stages,
        *regression_data(num_batches * batch_size),
        batch_size,
        0.1,
        accumulation_steps,
        reduction,
    )
    model = fit_tiny(
        devices,
        2,
        num_batches,
        accumulation_steps=accumulation_steps,
        reduction=reduction,
    )
    # fit_tiny builds the same stages again from the same seed.
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sum_is_mean_with_a_learning_rate_m_times_larger(devices):
    def train(reduction, learning_rate):
        model = DecoupledModel(
            tiny_stages(2), devices[:2], accumulation_steps=3, reduction=reduction
        )
        model.compile(keras.optimizers.SGD(learning_rate), "mse")
        model.fit(*regression_data(36), batch_size=4, shuffle=False, verbose=0)
        return model.get_weights()

    for got, want in zip(train("sum", 0.05), train("mean", 0.15)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# The schedule: delays and staleness ----------------------------------------


@pytest.mark.parametrize(
    "schedule, delays", [("adl", [4, 2, 0]), ("ddg", [2, 1, 0]), ("bp", [0, 0, 0])]
)
def test_tick_trace_shows_the_delays(devices, schedule, delays):
    num_batches = 6
    model = fit_tiny(devices, 3, num_batches, schedule=schedule)
    trace = model.tick_trace  # [tick, forward/backward, stage]: batch ids
    # Stage 0 backpropagates the last batch D_0 ticks after it entered.
    assert len(trace) == num_batches + delays[0]
    for k in range(3):
        for batch in range(num_batches):
            (forward_tick,) = np.flatnonzero(trace[:, 0, k] == batch)
            (backward_tick,) = np.flatnonzero(trace[:, 1, k] == batch)
            assert backward_tick - forward_tick == delays[k]
    if schedule == "adl":
        # Tick 4: stage 0 forwards batch 4 and backpropagates batch 0,
        # stage 1 forwards 3 and backpropagates 1, stage 2 does both for 2.
        np.testing.assert_array_equal(trace[4], [[4, 3, 2], [0, 1, 2]])
        # While filling, stage 0 has nothing to backpropagate.
        np.testing.assert_array_equal(trace[:4, 1, 0], [-1] * 4)


# Measured staleness of 12 batches from an empty pipeline, K = 3 (D = 4, 2,
# 0), worked out by hand from the rule: batch b's staleness at stage k is the
# number of batches b' in [b − D_k, b − 1], b' >= 0, after whose backward
# stage k steps, i.e. with (b' + 1) % M == 0.
MEASURED_STALENESS = {
    # M = 1: min(b, D_k).
    1: [{0: 1, 1: 1, 2: 1, 3: 1, 4: 8}, {0: 1, 1: 1, 2: 10}, {0: 12}],
    # M = 2: the steady state, D_k / M = 2 and 1, from batch 4 and 2 on.
    2: [{0: 2, 1: 2, 2: 8}, {0: 2, 1: 10}, {0: 12}],
    # M = 4: stage 0 holds at 1 from batch 4; stage 1 alternates 1, 1, 0, 0.
    4: [{0: 4, 1: 8}, {0: 8, 1: 4}, {0: 12}],
}


@pytest.mark.parametrize("accumulation_steps", [1, 2, 4])
def test_measured_staleness_falls_with_m(devices, accumulation_steps):
    model = fit_tiny(devices, 3, 12, accumulation_steps=accumulation_steps)
    report = model.staleness()
    assert [r["delay"] for r in report] == [4, 2, 0]
    expected = MEASURED_STALENESS[accumulation_steps]
    assert [r["histogram"] for r in report] == expected
    assert Schedule("adl", 3).staleness(accumulation_steps, 12) == expected


def test_steady_state_staleness_is_d_over_m():
    schedule = Schedule("adl", 3)
    for steps, means in [(1, [4, 2, 0]), (2, [2, 1, 0]), (4, [1, 0.5, 0])]:
        histograms = schedule.staleness(steps)
        assert [
            sum(s * n for s, n in h.items()) / sum(h.values()) for h in histograms
        ] == means
    # M >= 2 (K − 1) = 4 keeps every stage's staleness at most 1.
    assert all(max(h) <= 1 for h in schedule.staleness(4))
    assert Schedule("ddg", 3).staleness(1) == [{2: 1}, {1: 1}, {0: 1}]


# Devices ---------------------------------------------------------------------


def tick_graph(model):
    x, y = regression_data(4)
    return model._pipeline.tick.get_concrete_function(
        tf.constant(x), tf.constant(y), tf.constant(0), tf.constant(0, tf.int64)
    ).graph


def test_each_stage_computes_on_its_device(devices):
    model = fit_tiny(devices, 3, 3)
    matmul_devices = {
        op.device.split("device:")[-1]
        for op in tick_graph(model).get_operations()
        if op.type == "MatMul"
    }
    assert matmul_devices == {"CPU:0", "CPU:1", "CPU:2"}
    assert model._pipeline.stored_inputs[1].device.endswith("CPU:1")


@pytest.mark.parametrize(
    "schedule, dependencies",
    [
        # ADL: within a tick, no stage waits for another.
        ("adl", set()),
        # DDG: the forward is chained; the delayed backwards are not.
        ("ddg", {(0, 1), (0, 2), (1, 2)}),
        # BP: the forward, then the backward, through every stage.
        ("bp", {(k, j) for k in range(3) for j in range(3) if k != j}),
    ],
)
def test_which_stages_wait_for_which_within_a_tick(devices, schedule, dependencies):
    """(k, j): a matrix product of stage j depends, through data or control
    edges of the tick's graph, on one of stage k."""
    graph = tick_graph(fit_tiny(devices, 3, 3, schedule=schedule))

    def stage(op):
        return int(op.device[-1]) if op.type == "MatMul" else None

    found = set()
    for op in graph.get_operations():
        if stage(op) is not None:
            found |= {
                (stage(before), stage(op))
                for before in ancestors(op)
                if stage(before) not in (None, stage(op))
            }
    assert found == dependencies


def ancestors(op):
    """Every op `op` waits for in its graph: data inputs and control edges."""
    seen, pending = {}, [op]
    while pending:
        current = pending.pop()
        for before in [t.op for t in current.inputs] + current.control_inputs:
            if before.name not in seen:
                seen[before.name] = before
                pending.append(before)
    return list(seen.values())


# Learning ------------------------------------------------------------------


def test_adl_learns_mnist_as_well_as_bp(devices):
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load("mnist5k")

    def accuracy(schedule, accumulation_steps):
        keras.utils.set_random_seed(0)
        model = tf_agn.models.mlp((784,), 10)
        decoupled = DecoupledModel(
            split_model(model, 2),
            devices[:2],
            accumulation_steps=accumulation_steps,
            schedule=schedule,
        )
        decoupled.compile(
            keras.optimizers.Adam(2e-3),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        decoupled.fit(x_train, y_train, batch_size=64, epochs=5, verbose=0)
        return decoupled.evaluate(x_test, y_test, batch_size=500)[1]

    # Observed: BP 0.937, ADL (K = 2, M = 2) 0.939 (seed 1: 0.927, 0.928).
    bp = accuracy("bp", 1)
    adl = accuracy("adl", 2)
    print(f"BP {bp:.4f}, ADL {adl:.4f}")
    assert bp >= 0.9
    assert adl >= bp - 0.02


# The Keras-like interface --------------------------------------------------


def test_fit_evaluate_predict_and_callbacks(devices):
    class Counter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    x, y = regression_data(40)
    model = DecoupledModel(tiny_stages(2), devices[:2], accumulation_steps=2)
    assert model.staleness()[0]["mean"] is None
    model.compile("sgd", "mse", metrics=["mae"])
    counter = Counter()
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=5,
        callbacks=[counter],
        validation_data=(x[:16], y[:16]),
        verbose=0,
    )
    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == [0, 1]  # stopped by the callback
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae"}
    assert counter.batches == 10
    assert model.predict(x, batch_size=16).shape == (40, 2)
    loss, mae = model.evaluate(x, y, batch_size=16)
    assert model.evaluate(x, y, batch_size=16, return_dict=True) == pytest.approx(
        {"loss": loss, "mae": mae}
    )
    assert np.isfinite(loss) and loss > 0


def test_layer_lists_and_layers_are_stages(devices):
    model = DecoupledModel(
        [[keras.layers.Dense(4), keras.layers.ReLU()], keras.layers.Dense(2)],
        devices[:2],
    )
    model.compile("sgd", "mse")
    model.fit(*regression_data(16), batch_size=4, verbose=0)
    assert len(model.get_weights()) == 4


# Bad input -------------------------------------------------------------------


def test_bad_arguments_name_the_value_and_what_is_allowed(devices):
    stages = tiny_stages(2)
    with pytest.raises(ValueError, match=r"from 1 to .* 2; received 3"):
        split_model(tf_agn.models.mlp((3,), 2, hidden_units=(4,)), 3)
    for steps in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"int >= 1; received {steps!r}"):
            DecoupledModel(stages, devices[:2], accumulation_steps=steps)
    with pytest.raises(ValueError, match=r"one device per stage, 2; received 3"):
        DecoupledModel(stages, devices[:3])
    with pytest.raises(ValueError, match=r"devices must name devices this process has \(.*CPU:0.*\); received '/device:CPU:7'"):
        DecoupledModel(stages, [devices[0], "/device:CPU:7"])
    with pytest.raises(ValueError, match=r"devices must name .*; received '/GPU:0'"):
        DecoupledModel(stages, ["/GPU:0", devices[1]])
    with pytest.raises(ValueError, match=r"5 stages need 5 devices.*split_cpu\(5\)"):
        DecoupledModel(tiny_stages(5))
    with pytest.raises(ValueError, match=r"Unknown schedule 'gpipe'. Allowed: adl"):
        DecoupledModel(stages, devices[:2], schedule="gpipe")
    with pytest.raises(ValueError, match=r"Unknown reduction 'max'. Allowed: mean"):
        DecoupledModel(stages, devices[:2], reduction="max")
    with pytest.raises(ValueError, match=r"Stage 1 must be a Keras model.*'dense'"):
        DecoupledModel([stages[0], "dense"], devices[:2])
    with pytest.raises(RuntimeError, match="Call compile"):
        DecoupledModel(stages, devices[:2]).fit(*regression_data(8))


def test_short_names_of_devices_are_accepted(devices):
    model = DecoupledModel(tiny_stages(2), ["/CPU:1", "cpu:0"])
    assert model.devices == [devices[1], devices[0]]
