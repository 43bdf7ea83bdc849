"""Exact asynchronous update rules, under the deterministic simulator.

Each algorithm's center and workers are checked against a numpy reference
written from ../shared/algorithms.md on its own: plain arrays, a
hand-written SGD step for a linear model under mean squared error, and the
paper's rules for pull, commit and server update.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from tf_agn.strategies import simulate

FEATURES = 3
BATCH = 4
LEARNING_RATE = 0.05
NUM_WORKERS = 3
LOCAL_STEPS = 2
NUM_WINDOWS = 7


def batches(worker, count):
    rng = np.random.default_rng(100 + worker)
    x = rng.normal(size=(count, BATCH, FEATURES)).astype(np.float32)
    y = rng.normal(size=(count, BATCH, 1)).astype(np.float32)
    return x, y


def dataset_fn(input_context):
    return tf.data.Dataset.from_tensor_slices(batches(input_context.input_pipeline_id, 40))


def linear_model(optimizer):
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def initial_weights():
    return [np.ones((FEATURES, 1), np.float32), np.zeros((1,), np.float32)]


def mse_gradients(weights, x, y):
    kernel, bias = weights
    residual = x @ kernel + bias - y
    return [2 * x.T @ residual / residual.size, 2 * residual.mean(axis=0)]


class SGDReference:
    """Keras' SGD, plain or with Nesterov momentum, in numpy."""

    def __init__(self, momentum=0.0):
        self.momentum = momentum
        self.velocity = None

    def step(self, weights, gradients):
        if not self.momentum:
            return [w - LEARNING_RATE * g for w, g in zip(weights, gradients)]
        if self.velocity is None:
            self.velocity = [np.zeros_like(w) for w in weights]
        self.velocity = [
            self.momentum * m - LEARNING_RATE * g
            for m, g in zip(self.velocity, gradients)
        ]
        return [
            w + self.momentum * m - LEARNING_RATE * g
            for w, m, g in zip(weights, self.velocity, gradients)
        ]


def reference(algorithm, order, moving_rate=None, momentum=0.0):
    """The paper's protocol in numpy; returns (center, workers, staleness)."""
    center = initial_weights()
    commits = 0
    data = [batches(w, 40) for w in range(NUM_WORKERS)]
    cursor = [0] * NUM_WORKERS
    optimizers = [SGDReference(momentum) for _ in range(NUM_WORKERS)]
    local = [initial_weights() for _ in range(NUM_WORKERS)]
    pulled = [None] * NUM_WORKERS
    commits_at_pull = [0] * NUM_WORKERS
    elastic = algorithm == "elastic"

    def pull(w):
        pulled[w] = [c.copy() for c in center]
        commits_at_pull[w] = commits
        if not elastic:
            local[w] = [c.copy() for c in center]

    for w in range(NUM_WORKERS):
        pull(w)
    staleness = []
    for w in order:
        for _ in range(LOCAL_STEPS):
            x, y = data[w][0][cursor[w]], data[w][1][cursor[w]]
            cursor[w] += 1
            local[w] = optimizers[w].step(local[w], mse_gradients(local[w], x, y))
        s = commits - commits_at_pull[w]
        if algorithm in ("agn", "agn_staleness_scaled"):
            scale = 1.0
            if algorithm == "agn_staleness_scaled":
                scale = min(1.0, LOCAL_STEPS / (s + 1))
            center = [
                c + scale * (t - p) / LOCAL_STEPS
                for c, t, p in zip(center, local[w], pulled[w])
            ]
        elif algorithm == "downpour":
            center = [c + (t - p) for c, t, p in zip(center, local[w], pulled[w])]
        elif algorithm == "dynsgd":
            center = [
                c + (t - p) / (s + 1) for c, t, p in zip(center, local[w], pulled[w])
            ]
        else:  # elastic: exchange with the center as it is now
            s = 0
            elastic_force = [moving_rate * (t - c) for t, c in zip(local[w], center)]
            local[w] = [t - e for t, e in zip(local[w], elastic_force)]
            center = [c + e for c, e in zip(center, elastic_force)]
        commits += 1
        staleness.append(s)
        pull(w)
    return center, local, staleness


def run(optimizer, order="round_robin"):
    model = linear_model(optimizer)
    simulation = simulate(model, dataset_fn, NUM_WORKERS, NUM_WINDOWS, order=order)
    return model, simulation


def assert_weights_close(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-6)


ROUND_ROBIN = [w % NUM_WORKERS for w in range(NUM_WINDOWS)]


def sgd():
    return keras.optimizers.SGD(LEARNING_RATE)


@pytest.mark.parametrize(
    "algorithm, make_optimizer",
    [
        ("agn", lambda: tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS)),
        (
            "agn_staleness_scaled",
            lambda: tf_agn.optimizers.AGN(
                sgd(), local_steps=LOCAL_STEPS, staleness_scaling=True
            ),
        ),
        (
            "downpour",
            lambda: tf_agn.optimizers.DOWNPOUR(sgd(), local_steps=LOCAL_STEPS),
        ),
        ("dynsgd", lambda: tf_agn.optimizers.DynSGD(sgd(), local_steps=LOCAL_STEPS)),
    ],
)
@pytest.mark.parametrize("order", ["round_robin", "random"])
def test_center_follows_the_papers_rule(algorithm, make_optimizer, order):
    model, simulation = run(make_optimizer(), order)
    center, _, staleness = reference(algorithm, simulation.order)
    assert_weights_close(model.get_weights(), center)
    assert sorted(simulation.staleness.values()) == sorted(staleness)


def test_round_robin_staleness_is_n_minus_one():
    _, simulation = run(tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS))
    assert simulation.order == ROUND_ROBIN
    # The first round sees 0, 1, .., n-1; every later commit n - 1.
    assert list(simulation.staleness.values()) == sorted([0, 1, 2, 2, 2, 2, 2])
    assert int(simulation.server.commits.numpy()) == NUM_WINDOWS


def test_callback_is_called_after_every_commit():
    model = linear_model(tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS))
    called = []
    simulate(model, dataset_fn, NUM_WORKERS, NUM_WINDOWS, callback=called.append)
    assert called == list(range(NUM_WINDOWS))


def test_agn_divides_by_lambda_and_downpour_does_not():
    # One worker, one window: no staleness, so the rules alone differ.
    def one_window(optimizer):
        model = linear_model(optimizer)
        simulate(model, dataset_fn, num_workers=1, num_windows=1)
        return [w - i for w, i in zip(model.get_weights(), initial_weights())]

    agn = one_window(tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS))
    downpour = one_window(tf_agn.optimizers.DOWNPOUR(sgd(), local_steps=LOCAL_STEPS))
    for a, d in zip(agn, downpour):
        assert np.abs(d).max() > 1e-3
        np.testing.assert_allclose(a * LOCAL_STEPS, d, rtol=1e-5)


def test_dynsgd_scales_by_one_over_staleness_plus_one():
    # Two workers in the order 0, 1: worker 1 commits with staleness 1, so
    # its Δ lands halved, where DOWNPOUR adds it whole.
    order = [0, 1]

    def center_after(optimizer):
        model = linear_model(optimizer)
        simulate(model, dataset_fn, num_workers=2, num_windows=2, order=order)
        return model.get_weights()

    dynsgd = center_after(tf_agn.optimizers.DynSGD(sgd(), local_steps=LOCAL_STEPS))
    downpour = center_after(tf_agn.optimizers.DOWNPOUR(sgd(), local_steps=LOCAL_STEPS))
    # Both workers pulled the initial weights, so worker 1's Δ is the same
    # under both rules: DOWNPOUR's center − (center after worker 0) = Δ_1.
    model = linear_model(tf_agn.optimizers.DOWNPOUR(sgd(), local_steps=LOCAL_STEPS))
    simulate(model, dataset_fn, num_workers=2, num_windows=1, order=[0])
    after_first = model.get_weights()
    for dyn, down, one in zip(dynsgd, downpour, after_first):
        assert np.abs(down - one).max() > 1e-3
        np.testing.assert_allclose(dyn - one, (down - one) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "make_optimizer, momentum",
    [
        (
            lambda: tf_agn.optimizers.AEASGD(
                local_steps=LOCAL_STEPS, rho=5.0, elastic_learning_rate=LEARNING_RATE
            ),
            0.0,
        ),
        (
            lambda: tf_agn.optimizers.EAMSGD(
                local_steps=LOCAL_STEPS, rho=5.0, elastic_learning_rate=LEARNING_RATE
            ),
            0.9,
        ),
    ],
)
def test_elastic_methods_move_worker_and_center_symmetrically(make_optimizer, momentum):
    model, simulation = run(make_optimizer(), "random")
    moving_rate = 5.0 * LEARNING_RATE
    center, local, _ = reference(
        "elastic", simulation.order, moving_rate=moving_rate, momentum=momentum
    )
    assert_weights_close(model.get_weights(), center)
    for worker, expected in zip(simulation.workers, local):
        assert_weights_close([w.numpy() for w in worker.weights], expected)
    # The elastic exchange pulls right before it commits: never stale.
    assert set(simulation.staleness.values()) == {0}


def test_a_non_finite_commit_is_rejected_and_counted():
    def poisoned(input_context):
        worker = input_context.input_pipeline_id
        x, y = batches(worker, 40)
        if worker == 1:
            x[0, 0, 0] = np.nan  # worker 1's first window
        return tf.data.Dataset.from_tensor_slices((x, y))

    model = linear_model(tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS))
    simulation = simulate(model, poisoned, NUM_WORKERS, NUM_WINDOWS)
    assert simulation.outcomes.count(tf_agn.strategies.REJECTED_NON_FINITE) == 1
    assert int(simulation.server.rejected.numpy()) == 1
    assert int(simulation.server.commits.numpy()) == NUM_WINDOWS - 1
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_bad_orders_and_models_are_refused():
    optimizer = tf_agn.optimizers.AGN(sgd(), local_steps=LOCAL_STEPS)
    model = linear_model(optimizer)
    with pytest.raises(ValueError, match="Unknown order 'fifo'"):
        simulate(model, dataset_fn, 2, 3, order="fifo")
    with pytest.raises(ValueError, match=r"needs 3 worker indices in \[0, 2\)"):
        simulate(model, dataset_fn, 2, 3, order=[0, 2, 1])
    with pytest.raises(ValueError, match="windowed optimizers"):
        simulate(linear_model(sgd()), dataset_fn, 2, 3)
    with pytest.raises(ValueError, match="local_steps must be an int >= 1; received 0"):
        tf_agn.optimizers.DOWNPOUR(local_steps=0)
    with pytest.raises(ValueError, match="rho \\* elastic_learning_rate must be in"):
        tf_agn.optimizers.AEASGD(rho=200.0, elastic_learning_rate=0.01)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: tf_agn.optimizers.AGN(sgd(), local_steps=4, normalize=False),
        lambda: tf_agn.optimizers.AGN(sgd(), local_steps=4, staleness_scaling=True),
        lambda: tf_agn.optimizers.DOWNPOUR(sgd(), local_steps=3),
        lambda: tf_agn.optimizers.DynSGD(local_steps=2),
        lambda: tf_agn.optimizers.AEASGD(local_steps=5, rho=2.0, elastic_learning_rate=0.1),
        lambda: tf_agn.optimizers.EAMSGD(local_steps=6),
    ],
)
def test_every_algorithm_saves_and_loads(make_optimizer, tmp_path):
    optimizer = make_optimizer()
    model = linear_model(optimizer)
    model.fit(
        *[a.reshape(-1, a.shape[-1]) for a in batches(0, 4)],
        batch_size=BATCH,
        verbose=0
    )
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(optimizer)
    assert loaded.optimizer.get_config() == optimizer.get_config()
    assert type(loaded.optimizer.inner_optimizer) is type(optimizer.inner_optimizer)
    assert_weights_close(loaded.get_weights(), model.get_weights())


@pytest.mark.parametrize("reject_non_finite", [True, False])
def test_the_server_rejects_non_finite_commits_unless_told_not_to(reject_non_finite):
    from tf_agn.strategies.commit_server import CommitServer

    model = linear_model(tf_agn.optimizers.DynSGD(sgd(), local_steps=1))
    server = CommitServer(
        model.optimizer, model.trainable_variables, 2, reject_non_finite
    )
    delta = [np.full((FEATURES, 1), np.nan, np.float32), np.ones((1,), np.float32)]
    staleness, outcome = server.apply(
        [(d,) for d in delta], tf.constant(0, tf.int64), tf.constant(0, tf.int64)
    )
    assert int(staleness) == 0
    kernel, bias = model.get_weights()
    if reject_non_finite:
        assert int(outcome) == tf_agn.strategies.REJECTED_NON_FINITE
        assert np.isfinite(kernel).all() and bias[0] == 0
        assert int(server.rejected.numpy()) == 1 and int(server.commits.numpy()) == 0
    else:
        assert int(outcome) == tf_agn.strategies.APPLIED
        assert np.isnan(kernel).all() and bias[0] == 1
    # A second commit of the same window is dropped either way.
    _, again = server.apply(delta, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
    expected = (
        tf_agn.strategies.REJECTED_NON_FINITE
        if reject_non_finite
        else tf_agn.strategies.DUPLICATE
    )
    assert int(again) == expected


# Compressed asynchronous commits.


def wide_model(optimizer):
    """A 32x8 kernel: large enough for int8 chunks and rank-1 PowerSGD."""
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(8, kernel_initializer="ones")]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def wide_dataset_fn(input_context):
    rng = np.random.default_rng(7 + input_context.input_pipeline_id)
    x = rng.normal(size=(8, BATCH, 32)).astype(np.float32)
    y = rng.normal(size=(8, BATCH, 8)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y))


@pytest.mark.parametrize(
    "compressor, want_bytes",
    [
        # int8: 256 + 8 codes, one float32 scale per 16 (the bias: one).
        (tf_agn.compression.Int8(chunk_size=16), 256 + 16 * 4 + 8 + 4),
        # int4: the same codes, two to a byte.
        (tf_agn.compression.Int4(chunk_size=16), 256 // 2 + 16 * 4 + 8 // 2 + 4),
        # Rank 1: (32 + 8) floats for the kernel; the bias whole.
        (tf_agn.compression.PowerSGD(rank=1), (32 + 8) * 4 + 8 * 4),
    ],
    ids=["int8", "int4", "powersgd"],
)
def test_compressed_commit_loses_nothing_it_does_not_keep(compressor, want_bytes):
    """One worker, one window: the center that received the compressed
    commit, plus what the worker kept (its residual), is the center of the
    uncompressed run; the payload is what the compressor's bytes say."""

    def run(compression):
        model = wide_model(
            tf_agn.optimizers.AGN(
                keras.optimizers.SGD(LEARNING_RATE), local_steps=LOCAL_STEPS,
                compression=compression,
            )
        )
        return model, simulate(model, wide_dataset_fn, num_workers=1, num_windows=1)

    plain_model, plain = run(None)
    model, simulation = run(compressor)
    (worker,) = simulation.workers
    for center, want, state in zip(model.get_weights(), plain_model.get_weights(), worker.commit_state):
        residual = compressor.residual(state)
        kept = 0 if residual is None else residual.numpy()
        np.testing.assert_allclose(center + kept, want, atol=1e-6)
    kernel, bias = model.get_weights()
    assert np.abs(kernel - plain_model.get_weights()[0]).max() > 1e-6  # it was compressed
    server = simulation.server
    assert server.bytes_per_commit == want_bytes < plain.server.bytes_per_commit == (32 * 8 + 8) * 4
    assert int(server.bytes_received.numpy()) == want_bytes


def test_a_non_finite_commit_leaves_the_workers_residual_alone():
    model = wide_model(
        tf_agn.optimizers.AGN(
            keras.optimizers.SGD(LEARNING_RATE), local_steps=LOCAL_STEPS, compression="int8"
        )
    )

    def poisoned(input_context):
        return wide_dataset_fn(input_context).map(lambda x, y: (x * np.nan, y))

    simulation = simulate(model, poisoned, num_workers=1, num_windows=1)
    assert simulation.outcomes == [tf_agn.strategies.REJECTED_NON_FINITE]
    np.testing.assert_array_equal(simulation.workers[0].commit_state[0]["residual"].numpy(), 0)
