"""`compression=` on tf_agn's optimizers: state as optimizer variables,
saving, resuming, `fit` on both transports, accumulation, errors.

The compressors' arithmetic is checked against numpy references in
tests/test_error_feedback.py; across worker processes in
tests/test_multi_worker.py.
"""

import functools
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from compression_model import build
from compression_model import data
from conftest import DEVICES
from multi_worker_data import COMPRESSION_STATE
from tf_agn import compression
from tf_agn.resuming import resizing

TRANSPORTS = ["local", "collective"]
BATCH = 64


def fit(model, epochs, **kwargs):
    x, y = data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False, **kwargs)


def per_replica_state(model, kinds=COMPRESSION_STATE):
    """Every replica's copy of every compression state variable, in order."""
    strategy = model.distribute_strategy
    return [
        [t.numpy() for t in strategy.experimental_local_results(v.value)]
        for v in model.optimizer.variables
        if v.path.endswith(kinds)
    ]


@functools.cache
def uncompressed_fit(transport):
    """Uncompressed SGD's loss history and `communication_stats` after 5
    epochs on `transport`: computed once per test process."""
    strategy = tf_agn.strategies.mirrored(devices=DEVICES, transport=transport)
    plain = build(strategy, lambda: tf_agn.optimizers.SGD(0.1))
    return fit(plain, 5).history["loss"], plain.optimizer.communication_stats()


@pytest.mark.parametrize(
    "transport", [pytest.param("local", marks=pytest.mark.slow), "collective"]
)
@pytest.mark.parametrize(
    "compressor, step_bytes",
    [
        # The 1539 values in one pack, padded for 4 replicas to one chunk
        # of 512 each: 2048 codes and 4 scales.
        ("int8", 2048 + 4 * 4),
        # The 20x64 kernel as (20 + 64) * 2 floats, the rest whole.
        (compression.PowerSGD(rank=2), 4 * ((20 + 64) * 2 + 64 + 64 * 3 + 3)),
    ],
    ids=["int8", "powersgd"],
)
def test_fit_trains_as_uncompressed_with_fewer_bytes(transport, compressor, step_bytes):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES, transport=transport)
    compressed = build(strategy, lambda: tf_agn.optimizers.SGD(0.1, compression=compressor))
    plain_loss, plain_stats = uncompressed_fit(transport)
    loss = fit(compressed, 5).history["loss"]
    assert loss[-1] < 0.5 * loss[0]
    np.testing.assert_allclose(loss[-1], plain_loss[-1], rtol=0.02)
    stats = compressed.optimizer.communication_stats()
    assert stats["all_reduce_calls"] == plain_stats["all_reduce_calls"] == 5 * 8
    assert stats["bytes_sent"] == 5 * 8 * step_bytes < 0.35 * plain_stats["bytes_sent"]
    # The replicas apply the same update: their weights stay equal.
    for weight in compressed.weights:
        copies = strategy.experimental_local_results(weight.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    # Each replica keeps its own residual (PowerSGD: its own M).
    (first, *_) = per_replica_state(compressed, ("_residual", "_powersgd_m"))
    assert not np.array_equal(first[0], first[1])


def test_the_state_follows_keras_own_variables():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    plain = build(strategy, lambda: keras.optimizers.Adam())
    model = build(strategy, lambda: tf_agn.optimizers.Adam(compression=compression.PowerSGD(rank=1)))
    fit(plain, 1)
    fit(model, 1)
    def names(optimizer):  # without the models' and layers' numbers
        return [re.sub(r"_\d+", "", v.path.split("/", 1)[1]) for v in optimizer.variables]

    keras_names = names(plain.optimizer)
    assert names(model.optimizer)[: len(keras_names)] == keras_names
    # Both kernels are compressed at rank 1 (64x3 gains 192/67 > 2x);
    # biases travel whole.
    # The residual is kept as its factors M, P^ and this replica's Q.
    assert names(model.optimizer)[len(keras_names) :] == [
        "sequential_dense_kernel_powersgd_local_q",
        "sequential_dense_kernel_powersgd_m",
        "sequential_dense_kernel_powersgd_p",
        "sequential_dense_kernel_powersgd_q",
    ] * 2


def test_strategy_compression_is_the_optimizers_default():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES, compression="int8")
    model = build(strategy, lambda: tf_agn.optimizers.SGD(0.1))
    assert isinstance(model.optimizer.compressor, compression.Int8)
    fit(model, 1)
    assert len(per_replica_state(model)) == 4  # a residual per variable
    own = build(strategy, lambda: tf_agn.optimizers.SGD(0.1, compression="fp16"))
    assert own.optimizer.compressor is compression.FP16


@pytest.mark.parametrize("compressor", ["int8", compression.PowerSGD(rank=2)], ids=["int8", "powersgd"])
def test_accumulation_compresses_the_window_once(compressor):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(
        strategy,
        lambda: tf_agn.optimizers.SGD(0.1, compression=compressor, gradient_accumulation_steps=2),
    )
    loss = fit(model, 4).history["loss"]
    assert loss[-1] < 0.7 * loss[0]
    assert model.optimizer.communication_stats()["all_reduce_calls"] == 4 * 8 // 2


@pytest.mark.parametrize(
    "compressor, atol",
    # PowerSGD's result depends on the replicas' residuals only through
    # their sum, which loading keeps (the residual is linear in its
    # factors, and P^ is the same on every replica); int8 rounds each
    # replica's own.
    [
        (compression.PowerSGD(rank=2), 1e-5),
        pytest.param("int8", 2e-3, marks=pytest.mark.slow),
    ],
    ids=["powersgd", "int8"],
)
def test_keras_file_mid_training_then_training_on(tmp_path, compressor, atol):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    optimizer_fn = lambda: tf_agn.optimizers.Adam(1e-2, compression=compressor)  # noqa: E731
    reference = build(strategy, optimizer_fn)
    fit(reference, 4)
    model = build(strategy, optimizer_fn)
    fit(model, 2)
    path = str(tmp_path / "model.keras")
    model.save(path)
    saved_sums = [np.sum(copies, axis=0) for copies in per_replica_state(model)]
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.compression.get_config() == model.optimizer.compression.get_config()
    loaded_sums = [np.sum(copies, axis=0) for copies in per_replica_state(loaded)]
    assert len(loaded_sums) == len(saved_sums) > 0
    for got, want in zip(loaded_sums, saved_sums):
        np.testing.assert_allclose(got, want, atol=1e-6)  # nothing lost
    fit(loaded, 2)
    for got, want in zip(loaded.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=atol)


def owed_in_all(model):
    """What the replicas owe altogether under error feedback, per
    compressed variable: the sum over replicas of `compressor.residual`."""
    strategy = model.distribute_strategy
    compressor, states = model.optimizer.compressor_state()
    return [
        np.sum([
            resizing.owed_by(compressor, dict(zip(state, replica)))
            for replica in zip(*(
                [c.numpy() for c in strategy.experimental_local_results(v.value)]
                for v in state.values()
            ))
        ], axis=0)
        for state in states
    ]


@pytest.mark.parametrize("then", [2, 4])
@pytest.mark.parametrize(
    "compressor", ["int8", compression.PowerSGD(rank=2)], ids=["int8", "powersgd"]
)
def test_a_keras_file_keeps_what_the_replicas_owe_on_any_replica_count(tmp_path, compressor, then):
    model = build(
        tf_agn.strategies.mirrored(devices=DEVICES),
        lambda: tf_agn.optimizers.SGD(0.1, compression=compressor),
    )
    fit(model, 1)
    owed = owed_in_all(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with tf_agn.strategies.mirrored(devices=DEVICES[:then]).scope():
        loaded = keras.models.load_model(path)
    got = owed_in_all(loaded)
    assert len(got) == len(owed) > 0
    for got_sum, want_sum in zip(got, owed, strict=True):
        np.testing.assert_allclose(got_sum, want_sum, rtol=1e-5, atol=1e-7)


def test_backup_and_restore_keeps_every_replicas_state(tmp_path):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    optimizer_fn = lambda: tf_agn.optimizers.SGD(0.1, compression="int8")  # noqa: E731
    reference = build(strategy, optimizer_fn)
    fit(reference, 3)
    backup_dir = str(tmp_path / "backup")
    model = build(strategy, optimizer_fn)
    fit(model, 2, callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)])
    resumed = build(strategy, optimizer_fn)
    fit(resumed, 3, callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir)])
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(per_replica_state(resumed), per_replica_state(reference), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert not os.path.exists(backup_dir)


def test_config_round_trip_and_distributed_optimizer():
    powersgd = compression.PowerSGD(rank=3, start_step=5)
    optimizer = tf_agn.optimizers.Adam(compression=powersgd)
    config = optimizer.get_config()
    again = tf_agn.optimizers.Adam.from_config(config)
    assert again.compression.get_config() == powersgd.get_config()
    assert tf_agn.optimizers.SGD(compression="int8").get_config()["compression"] == "int8"
    assert tf_agn.optimizers.SGD().get_config()["compression"] is None

    wrapper = tf_agn.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8")
    assert isinstance(wrapper.inner_optimizer.compression, compression.Int8)
    inner = tf_agn.optimizers.SGD(0.1, compression="int8")
    kept = tf_agn.optimizers.DistributedOptimizer(inner)
    assert isinstance(kept.inner_optimizer.compression, compression.Int8)
    with pytest.raises(ValueError, match="compression must be None or that of the optimizer"):
        tf_agn.optimizers.DistributedOptimizer(inner, compression="fp16")
    rebuilt = tf_agn.optimizers.DistributedOptimizer.from_config(wrapper.get_config())
    assert isinstance(rebuilt.inner_optimizer.compression, compression.Int8)

    declared = tf_agn.optimizers.Adam(sparse_gradients=["words"])
    assert tf_agn.optimizers.Adam.from_config(declared.get_config()).sparse_gradients == ["words"]
    wrapper = tf_agn.optimizers.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression="int8", sparse_gradients=["words"]
    )
    assert wrapper.inner_optimizer.sparse_gradients == ["words"]
    rebuilt = tf_agn.optimizers.DistributedOptimizer.from_config(wrapper.get_config())
    assert rebuilt.inner_optimizer.sparse_gradients == ["words"]
    assert "sparse_gradients" not in rebuilt.plain_inner_optimizer().get_config()


def test_distributed_optimizer_trains_compressed():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(
        strategy,
        lambda: tf_agn.optimizers.DistributedOptimizer(
            keras.optimizers.SGD(0.1), compression=compression.PowerSGD(rank=2)
        ),
    )
    loss = fit(model, 3).history["loss"]
    assert loss[-1] < 0.7 * loss[0]
    # One kernel is compressed at rank 2: its Q and its residual's factors.
    assert len(per_replica_state(model)) == 4


def test_one_replica_sends_nothing_so_compresses_nothing():
    plain = build(tf.distribute.get_strategy(), lambda: tf_agn.optimizers.SGD(0.1))
    model = build(tf.distribute.get_strategy(), lambda: tf_agn.optimizers.SGD(0.1, compression="int8"))
    fit(plain, 1)
    fit(model, 1)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, want)


# The windowed optimizers compress their synchronous commits.


def commit_state(model):
    """Every replica's copy of the commits' residuals, in order."""
    return per_replica_state(model, "_residual")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_agn_commit_loses_nothing_it_does_not_keep(transport):
    """After one window, the compressed run's center plus what the replicas
    kept (the residuals, applied with the outer rate of 1) is the
    uncompressed run's center: the local steps of the first window are the
    same in both runs."""
    strategy = tf_agn.strategies.mirrored(devices=DEVICES, transport=transport)

    def agn(compressor):
        return lambda: tf_agn.optimizers.AGN(
            keras.optimizers.SGD(0.1), local_steps=2, compression=compressor
        )

    plain = build(strategy, agn(None))
    compressed = build(strategy, agn(compression.Int8(chunk_size=64)))
    x, y = data(rows=2 * BATCH)
    for model in (plain, compressed):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    residuals = commit_state(compressed)
    assert len(residuals) == len(compressed.weights) == 4
    assert not plain.optimizer.variables[-1].path.endswith("_residual")
    for got, want, copies in zip(compressed.get_weights(), plain.get_weights(), residuals):
        # MEAN: each replica's residual is in units of Δ_r / n.
        np.testing.assert_allclose(got + np.sum(copies, axis=0), want, atol=1e-6)
        assert np.abs(got - want).max() > 0  # the commit did travel compressed
    stats, plain_stats = (m.optimizer.communication_stats() for m in (compressed, plain))
    assert stats["all_reduce_calls"] == plain_stats["all_reduce_calls"] == 1
    # The 1539 values padded for 4 replicas to whole chunks of 64: 1792
    # codes and 28 scales.
    assert stats["bytes_sent"] == 1792 + 28 * 4 < 0.35 * plain_stats["bytes_sent"]


def test_agn_trains_with_compressed_commits_and_round_trips():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(
        strategy,
        lambda: tf_agn.optimizers.AGN(
            keras.optimizers.SGD(0.1), local_steps=2, compression=compression.PowerSGD(rank=2)
        ),
    )
    loss = fit(model, 4).history["loss"]
    assert loss[-1] < 0.7 * loss[0]
    config = model.optimizer.get_config()
    again = tf_agn.optimizers.AGN.from_config(config)
    assert again.compression.get_config() == compression.PowerSGD(rank=2).get_config()
    # Only the commits carry compression state; the local steps send nothing.
    inner_paths = [v.path for v in model.optimizer.inner_optimizer.variables]
    assert not any(p.endswith(COMPRESSION_STATE) for p in inner_paths)


def test_values_a_compressor_does_not_act_on_get_no_state():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    with strategy.scope():
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(3, dtype="float64")])
        optimizer = tf_agn.optimizers.SGD(0.1, compression="int8")
        optimizer.build(model.trainable_variables)
    # int8 acts on float32 only: float64 gradients travel exactly.
    assert [v for v in optimizer.variables if v.path.endswith("_residual")] == []


# Sparse gradients: an embedding table, read by a gather.

VOCABULARY, SEQUENCE = 50, 4


def embedding_model(strategy, optimizer_fn, dense_dtype="float32"):
    """A 50x8 table ("words") under two Dense layers ("hidden", 32x16, and
    "out", 16x3), in a model named "net"."""
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((SEQUENCE,), dtype="int32"),
                keras.layers.Embedding(VOCABULARY, 8, name="words"),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="tanh", dtype=dense_dtype, name="hidden"),
                keras.layers.Dense(3, dtype=dense_dtype, name="out"),
            ],
            name="net",
        )
        model.compile(optimizer_fn(), "mse")
    return model


def fit_embedding(model, epochs=2):
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCABULARY, size=(4 * BATCH, SEQUENCE)).astype("int32")
    table = rng.normal(size=(VOCABULARY, 3))
    y = np.tanh(table[x].mean(axis=1)).astype("float32")
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False)


def state_names(optimizer):
    """The names of `optimizer`'s compression state variables, in order,
    without the model's name (a loaded model's variables' paths lack it)."""
    return [
        v.path.split("/", 1)[1].removeprefix("net_")
        for v in optimizer.variables
        if v.path.endswith(COMPRESSION_STATE)
    ]


POWERSGD_STATE = ["powersgd_local_q", "powersgd_m", "powersgd_p", "powersgd_q"]


@pytest.mark.parametrize(
    "compressor, names",
    [
        (
            "int8",
            [f"{v}_residual" for v in ("hidden_kernel", "hidden_bias", "out_kernel", "out_bias")],
        ),
        # Rank 1 compresses both kernels (16 * 3 >= 2 * (16 + 3)); the
        # biases travel whole.
        (
            compression.PowerSGD(rank=1),
            [f"{v}_{kind}" for v in ("hidden_kernel", "out_kernel") for kind in POWERSGD_STATE],
        ),
    ],
    ids=["int8", "powersgd"],
)
def test_variables_declared_with_sparse_gradients_get_no_state(tmp_path, compressor, names):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = embedding_model(
        strategy,
        lambda: tf_agn.optimizers.SGD(0.1, compression=compressor, sparse_gradients=["words"]),
    )
    initial_table = model.get_layer("words").embeddings.numpy()
    loss = fit_embedding(model).history["loss"]
    assert loss[-1] < loss[0]
    assert not np.array_equal(model.get_layer("words").embeddings.numpy(), initial_table)
    # Keras' own two (iteration, learning_rate), then the Dense layers' state.
    assert state_names(model.optimizer) == names
    assert len(model.optimizer.variables) == 2 + len(names)
    for weight in model.weights:
        copies = strategy.experimental_local_results(weight.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    # A `.keras` file keeps the declaration, so the loaded optimizer has
    # the same variables and loads them (Keras skips them all otherwise).
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.sparse_gradients == ["words"]
    assert state_names(loaded.optimizer) == names
    assert loaded.optimizer.iterations.numpy() == model.optimizer.iterations.numpy() == 8
    fit_embedding(loaded, epochs=1)


def test_a_sparse_gradient_travels_exactly_past_state_it_leaves_alone():
    """Undeclared, the table gets a residual, which its sparse gradients
    never use: they travel exactly and it stays 0. The Dense layers are
    float64, which int8 does not compress, so every weight is the
    uncompressed run's."""
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    plain = embedding_model(strategy, lambda: tf_agn.optimizers.SGD(0.1), dense_dtype="float64")
    model = embedding_model(
        strategy, lambda: tf_agn.optimizers.SGD(0.1, compression="int8"), dense_dtype="float64"
    )
    fit_embedding(plain)
    with pytest.warns(UserWarning, match="'net/words/embeddings' is sparse.*sparse_gradients"):
        fit_embedding(model)
    assert state_names(model.optimizer) == ["words_embeddings_residual"]
    (residuals,) = per_replica_state(model)
    assert not np.any(residuals)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert model.optimizer.communication_stats() == plain.optimizer.communication_stats()


def test_sparse_gradients_are_checked():
    with pytest.raises(ValueError, match="list of regular expressions"):
        tf_agn.optimizers.SGD(sparse_gradients="words")
    with pytest.raises(ValueError, match="not a regular expression"):
        tf_agn.optimizers.SGD(sparse_gradients=["words("])
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = embedding_model(
        strategy,
        lambda: tf_agn.optimizers.SGD(0.1, compression="int8", sparse_gradients=["hidden"]),
    )
    with pytest.raises(ValueError, match="names 'net/hidden/kernel', but its gradient is dense"):
        fit_embedding(model, epochs=1)
    # Accumulated, the table's window is dense: it travels compressed.
    with strategy.scope():
        accumulating = tf_agn.optimizers.SGD(
            0.1, compression="int8", sparse_gradients=["words"], gradient_accumulation_steps=2
        )
        accumulating.build(model.trainable_variables)
    assert state_names(accumulating)[0] == "words_embeddings_residual"
