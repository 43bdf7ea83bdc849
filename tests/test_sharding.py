"""Sharded optimizer state (`shard_optimizer_state=True`): each of 4
replicas keeps 1/4 of the state, and training is the unsharded optimizer's.

Over 50 steps of `model.fit` under `tf_agn.strategies.mirrored()` on 4
logical CPUs, the weight change w_T - w_0 and the optimizer's state,
gathered from every replica's part, equal those of the same optimizer
unsharded within 1e-6 by norm, tensor by tensor.
"""

import functools
import io
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from tf_agn import _compat
from tf_agn.optimizers import saving
from tf_agn.optimizers import sharding
from compression_model import build
from compression_model import data
from conftest import DEVICES
from error_feedback_reference import quantize_roundtrip

STEPS = 50
BATCH = 64
N = len(DEVICES)
TOLERANCE = 1e-6

OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=1e-3),
}


def train(strategy, make_optimizer, shard, method="mean", steps=STEPS, **settings):
    model = build(
        strategy,
        lambda: tf_agn.optimizers.DistributedOptimizer(
            make_optimizer(), aggregation_method=method, shard_optimizer_state=shard, **settings
        ),
    )
    before = model.get_weights()
    x, y = data(rows=steps * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    change = [after - start for after, start in zip(model.get_weights(), before)]
    return model, change


def whole_state(model, plain):
    """Every optimizer variable of `model` as `plain`'s unsharded optimizer
    holds it: a sharded variable's parts, one per replica, joined and
    unpadded; replica 0's copy of any other (its own accumulators). Also
    returns the elements one replica holds, and `plain`'s."""
    strategy = model.distribute_strategy
    state, held, plain_held = [], 0, 0
    for variable, like in zip(model.optimizer.variables, plain.optimizer.variables, strict=True):
        copies = [t.numpy() for t in strategy.experimental_local_results(variable.value)]
        held += copies[0].size
        plain_held += int(np.prod(like.shape))
        if copies[0].shape != tuple(like.shape):
            whole = np.concatenate(copies)[: int(np.prod(like.shape))]
            state.append(whole.reshape(like.shape))
        else:
            state.append(copies[0])
    return state, held, plain_held


def relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norm = np.linalg.norm(want)
    return np.linalg.norm(got - want) / norm if norm else np.linalg.norm(got)


def assert_same_training(sharded, unsharded):
    """Returns the elements of state one replica holds, sharded and not."""
    (model, change), (plain, plain_change) = sharded, unsharded
    for got, want in zip(change, plain_change):
        assert relative(got, want) <= TOLERANCE
    state, held, plain_held = whole_state(model, plain)
    plain_state, _, _ = whole_state(plain, plain)
    for got, want, variable in zip(state, plain_state, plain.optimizer.variables):
        assert relative(got, want) <= TOLERANCE, variable.path
    return held, plain_held


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_elementwise_optimizer_trains_as_unsharded(name):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local")
    sharded = train(strategy, OPTIMIZERS[name], True)
    held, plain_held = assert_same_training(sharded, train(strategy, OPTIMIZERS[name], False))
    # Each replica holds a quarter of the state (padding to whole parts of
    # 1539 weights' state, and a few scalars, aside).
    scalars = len([v for v in sharded[0].optimizer.variables if not v.shape])
    assert held - scalars <= (plain_held - scalars) / N + 4 * (plain_held // 1539)


@pytest.mark.parametrize("transport", ["local", "collective"])
@pytest.mark.parametrize("method", ["sum", "mean"])
def test_sum_and_mean_on_both_transports(transport, method):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    make = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    assert_same_training(train(strategy, make, True, method), train(strategy, make, False, method))


def test_several_steps_per_execution_train_as_one():
    strategy = tf_agn.strategies.mirrored(DEVICES)
    models = []
    for steps_per_execution in (1, 10):
        model = build(
            strategy,
            lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=True),
            steps_per_execution=steps_per_execution,
        )
        model.fit(*data(rows=20 * BATCH), batch_size=BATCH, verbose=0, shuffle=False)
        models.append(model)
    for got, want in zip(models[1].get_weights(), models[0].get_weights()):
        np.testing.assert_array_equal(got, want)
    saved = zip(saving.saved_values(models[1].optimizer), saving.saved_values(models[0].optimizer))
    for got, want in saved:
        np.testing.assert_array_equal(got, want)


def test_update_step_receives_each_replicas_part():
    seen = []

    class Recording(keras.optimizers.SGD):
        elementwise = True

        def update_step(self, gradient, variable, learning_rate):
            seen.append((tuple(gradient.shape), tuple(variable.shape)))
            super().update_step(gradient, variable, learning_rate)

    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local")
    train(strategy, lambda: Recording(0.1, momentum=0.5), True)
    # The 20x64 kernel, the 64 bias, the 64x3 kernel, the 3 bias (padded to
    # 4): a quarter each.
    assert set(seen) == {((320,), (320,)), ((16,), (16,)), ((48,), (48,)), ((1,), (1,))}


def test_one_replica_is_the_plain_optimizer():
    strategy = tf.distribute.get_strategy()
    model, change = train(strategy, OPTIMIZERS["adam"], True)
    plain, plain_change = train(strategy, OPTIMIZERS["adam"], False)
    for got, want in zip(change, plain_change):
        np.testing.assert_array_equal(got, want)
    assert [v.shape for v in model.optimizer.variables] == [v.shape for v in plain.optimizer.variables]


@pytest.mark.parametrize(
    "clipping", [{"clipvalue": 0.01}, {"clipnorm": 0.05}, {"global_clipnorm": 0.1}], ids=str
)
def test_clipping_sees_the_whole_gradient(clipping):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local")
    make = lambda: keras.optimizers.SGD(0.1, momentum=0.5, **clipping)  # noqa: E731
    sharded, plain = train(strategy, make, True), train(strategy, make, False)
    assert_same_training(sharded, plain)
    # The clipping bound: without it, training goes elsewhere.
    unclipped = train(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.5), False)
    assert relative(np.concatenate([c.ravel() for c in unclipped[1]]),
                    np.concatenate([c.ravel() for c in plain[1]])) > 0.01


@pytest.mark.parametrize(
    "make, method, message",
    [
        (lambda: keras.optimizers.Adafactor(), "mean", "Adafactor's update_step is not one of Keras's element-wise"),
        (lambda: keras.optimizers.Adam(), "none", "aggregation NONE"),
        (lambda: keras.optimizers.Adam(), "only_first_replica", "aggregation ONLY_FIRST_REPLICA"),
        (lambda: keras.optimizers.Adam(use_ema=True), "mean", "use_ema=True"),
    ],
)
def test_what_cannot_shard_is_refused_by_name(make, method, message):
    strategy = tf_agn.strategies.mirrored(DEVICES)
    with pytest.raises(ValueError, match=message):
        train(strategy, make, True, method)


# Relative difference by norm from unsharded training with the same cast,
# after 50 steps: the cast's rounding of each partial sum, met in another
# order (measured 2.8e-4 to 3.5e-4, and 1.7e-3 to 2.6e-3).
CAST_TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2}


@pytest.mark.parametrize("transport", ["local", "collective"])
@pytest.mark.parametrize("cast", sorted(CAST_TOLERANCE))
def test_casts_compress_the_reduce_scatter(cast, transport):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    (model, change), (plain, plain_change) = (
        train(strategy, make, shard, compression=cast) for shard in (True, False)
    )
    difference = relative(np.concatenate([c.ravel() for c in change]),
                          np.concatenate([c.ravel() for c in plain_change]))
    assert difference <= CAST_TOLERANCE[cast]
    # The gradients travel in 2 bytes, the gathered weights in 4; sharded,
    # a float32 a step says whether every replica's summed parts are finite
    # (a cast can overflow on the wire).
    elements = sum(v.size for v in plain.get_weights())
    padded = sum(-(-v.size // N) * N for v in plain.get_weights())
    assert plain.optimizer.communication_stats()["bytes_sent"] == STEPS * 2 * elements
    assert model.optimizer.communication_stats()["bytes_sent"] == STEPS * (3 * padded + 4)


def test_a_windowed_optimizers_sharded_outer_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"outer_optimizer Adam\(shard_optimizer_state=True\) is not supported"):
        tf_agn.optimizers.AGN(
            keras.optimizers.SGD(0.1),
            outer_optimizer=tf_agn.optimizers.Adam(1e-3, shard_optimizer_state=True),
        )


def int8_sharded_reference(grads, residuals, packs, sizes, weight, chunk_size, bits=8):
    """One sharded int8 (or int4) step in numpy, as tf_agn.optimizers.sharding says:
    each replica's rows of a pack (its gradients times `weight`, flat,
    padded to n parts) plus its residual are quantized row by row in chunks
    of their own; the owner of part j sums the n dequantized rows j in
    float32; nothing is quantized twice.

    Returns:
        `(combined, residuals)`: each variable's combined gradient, flat,
        and each replica's new residual of each variable, flat.
    """
    n = len(grads)
    parts = [-(-size // n) for size in sizes]
    combined = [None] * len(sizes)
    new = [[None] * len(sizes) for _ in range(n)]
    for pack in packs:
        width = sum(parts[i] for i in pack)
        padded = -(-width // chunk_size) * chunk_size
        total = np.zeros((n, padded), np.float32)
        for r in range(n):
            rows = np.concatenate([
                np.pad(grads[r][i] * np.float32(weight) + residuals[r][i], (0, n * parts[i] - sizes[i]))
                .reshape(n, parts[i]) for i in pack
            ], axis=1).astype(np.float32)
            sent = np.pad(rows, [(0, 0), (0, padded - width)])
            restored = quantize_roundtrip(sent.reshape(-1), chunk_size, bits).reshape(n, padded)
            total += restored
            errors = np.split((sent - restored)[:, :width], np.cumsum([parts[i] for i in pack])[:-1], 1)
            for i, error in zip(pack, errors):
                new[r][i] = error.reshape(-1)[: sizes[i]]
        columns = np.split(total[:, :width], np.cumsum([parts[i] for i in pack])[:-1], 1)
        for i, column in zip(pack, columns):
            combined[i] = column.reshape(-1)[: sizes[i]]
    return combined, new


@pytest.mark.parametrize("transport, method, error_feedback, compressor", [
    ("local", "mean", True, tf_agn.compression.Int8), ("local", "sum", True, tf_agn.compression.Int8),
    ("collective", "mean", True, tf_agn.compression.Int8),
    ("collective", "sum", True, tf_agn.compression.Int8),
    ("local", "mean", False, tf_agn.compression.Int8),
    ("local", "mean", True, tf_agn.compression.Int4),
    ("collective", "sum", True, tf_agn.compression.Int4),
])
def test_int8_reduce_scatters_quantized_rows_as_a_numpy_reference(
    transport, method, error_feedback, compressor
):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    shapes, chunk_size = [(13, 5), (3,), (1,)], 8
    with strategy.scope():
        variables = [keras.Variable(np.zeros(shape, "float32")) for shape in shapes]
        optimizer = tf_agn.optimizers.SGD(
            1.0, aggregation_method=method, shard_optimizer_state=True,
            compression=compressor(chunk_size=chunk_size, error_feedback=error_feedback),
        )
        optimizer.build(variables)
    sizes = [int(np.prod(shape)) for shape in shapes]
    rng = np.random.default_rng(0)
    weights = [np.zeros(size, np.float32) for size in sizes]
    residuals = [[np.zeros(size, np.float32) for size in sizes] for _ in range(N)]
    for _ in range(3):
        grads = [[rng.standard_normal(size).astype(np.float32) for size in sizes] for _ in range(N)]
        stacked = [tf.constant(np.stack([g[i].reshape(shape) for g in grads])) for i, shape in enumerate(shapes)]

        @tf.function
        def step():
            def apply():
                rank = tf.distribute.get_replica_context().replica_id_in_sync_group
                optimizer.apply([tf.gather(g, rank) for g in stacked], variables)

            strategy.run(apply)

        step()
        # Keras hands each replica g_r / n; MEAN undoes that and divides by
        # n, SUM only undoes it.
        weight = 1 if method == "mean" else N
        combined, residuals = int8_sharded_reference(
            grads, residuals, optimizer.shards.packs(range(len(sizes))), sizes, weight, chunk_size,
            compressor.bits,
        )
        if not error_feedback:
            residuals = [[np.zeros_like(e) for e in replica] for replica in residuals]
        weights = [w - c for w, c in zip(weights, combined)]
        for variable, want in zip(variables, weights):
            # The owner may add the n rows in another order: a rounding of
            # float32 (int4's SUM reaches weights of about 20, ulp 2e-6).
            np.testing.assert_allclose(variable.numpy().reshape(-1), want, rtol=1e-6, atol=1e-6)
        if not error_feedback:
            assert optimizer.compressor_state() is None
            continue
        _, states = optimizer.compressor_state()
        for i, state in enumerate(states):
            copies = strategy.experimental_local_results(state["residual"].value)
            for r, copy in enumerate(copies):
                # What was sent less its codes: the values sent (under SUM
                # up to about 20, ulp 2e-6) may round unlike numpy's, and
                # the residual carries that from step to step (seen with
                # int4 on the collective transport); an int4 step is about 3.
                np.testing.assert_allclose(copy.numpy().reshape(-1), residuals[r][i], rtol=0, atol=1e-5)
    # The quantized rows and the float32 weights, each half an all-reduce.
    padded = [-(-sum(-(-sizes[i] // N) for i in pack) // chunk_size) * chunk_size
              for pack in optimizer.shards.packs(range(len(sizes)))]
    wire = sum(N * p * compressor.bits // 8 + 4 * N * p // chunk_size for p in padded)
    gathered = 4 * N * sum(-(-size // N) for size in sizes)
    assert optimizer.communication_stats()["bytes_sent"] == 3 * (wire // 2 + gathered // 2)


@pytest.mark.parametrize("accumulation", [None, 2])
def test_int8_trains_as_uncompressed_and_starts_at_its_start_step(accumulation):
    strategy = tf_agn.strategies.mirrored(DEVICES)
    make = lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=accumulation)  # noqa: E731
    model, change = train(strategy, make, True, compression=tf_agn.compression.Int8(start_step=10))
    _, plain_change = train(strategy, make, False)
    windows = STEPS // (accumulation or 1)
    difference = relative(np.concatenate([c.ravel() for c in change]),
                          np.concatenate([c.ravel() for c in plain_change]))
    assert 0 < difference <= 0.05
    # The first 10 optimizer steps (windows: Keras's `iterations` counts
    # them) send float32 (two halves of 4 bytes per element), the others
    # int8 rows (a code per element padded to whole chunks of 512, and a
    # scale per chunk) and the float32 weights.
    float32 = 10
    elements = sum(-(-v.size // N) * N for v in model.get_weights())
    sizes = [v.size for v in model.get_weights()]
    padded = [-(-sum(-(-sizes[i] // N) for i in pack) // 512) * 512
              for pack in model.optimizer.inner_optimizer.shards.packs(range(len(sizes)))]
    int8 = sum(N * p + 4 * N * p // 512 for p in padded) // 2 + 2 * elements
    # A window of micro-steps ends with one all-reduce of a float32: whether
    # every replica's part is finite.
    agreements = windows if accumulation else 0
    stats = model.optimizer.communication_stats()
    assert stats["bytes_sent"] == float32 * 4 * elements + (windows - float32) * int8 + 4 * agreements
    assert stats["reduce_scatter_calls"] == float32
    assert stats["all_to_all_calls"] == windows - float32
    assert stats["all_gather_calls"] == windows
    assert stats["all_reduce_calls"] == agreements


def test_compression_and_stock_strategies_are_refused_by_name():
    with pytest.raises(ValueError, match=r"compression='powersgd', which carries no reduce-scatter \(fp16, bf16, int8 and int4 shard"):
        build(
            tf_agn.strategies.mirrored(DEVICES),
            lambda: tf_agn.optimizers.SGD(
                0.1, compression=tf_agn.compression.PowerSGD(rank=1), shard_optimizer_state=True
            ),
        ).fit(*data(rows=BATCH), batch_size=BATCH, verbose=0)
    stock = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with pytest.raises(ValueError, match="MirroredStrategy without tf_agn's cross-device ops"):
        train(stock, OPTIMIZERS["adam"], True)


def saved_optimizer(path):
    """The optimizer's entries of a `.keras` or `.weights.h5` file, by their
    path in it."""
    entries = {}

    def keep(name, node):
        if name.startswith("optimizer") and isinstance(node, h5py.Dataset):
            entries[name] = node[()]

    if str(path).endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            path = io.BytesIO(archive.read("model.weights.h5"))
    with h5py.File(path, "r") as weights:
        weights.visititems(keep)
    return entries


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("wrapper", ["distributed", "drop_in", "mixed_float16"])
def test_a_sharded_run_saves_the_unsharded_optimizers_layout(wrapper, tmp_path, request):
    if wrapper == "mixed_float16":
        # Keras's LossScaleOptimizer saves its inner optimizer's variables
        # itself, beside the inner optimizer's own entry.
        request.getfixturevalue("mixed_float16")
    strategy = tf_agn.strategies.mirrored(DEVICES)
    files = {}
    for shard in (True, False):
        if wrapper == "drop_in":
            model = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=shard))
            model.fit(*data(rows=STEPS * BATCH), batch_size=BATCH, verbose=0, shuffle=False)
        else:
            model, _ = train(strategy, OPTIMIZERS["adam"], shard)
        files[shard] = tmp_path / f"{shard}.keras"
        model.save(files[shard])
    sharded, plain = saved_optimizer(files[True]), saved_optimizer(files[False])
    assert sorted(sharded) == sorted(plain)
    assert len(plain) >= 6  # Adam's two moments of 4 variables, and counters.
    for name, want in plain.items():
        assert sharded[name].shape == want.shape, name
        assert relative(sharded[name], want) <= TOLERANCE, name


class RecordingStore(dict):
    """A Keras saving store (what `save_own_variables` writes and
    `load_own_variables` reads) that notes each write and read in
    `events`."""

    def __init__(self, events, *args):
        super().__init__(*args)
        self.events = events

    def __setitem__(self, key, value):
        self.events.append(("write", int(key)))
        super().__setitem__(key, value)

    def __getitem__(self, key):
        self.events.append(("read", int(key)))
        return super().__getitem__(key)


def test_saving_gathers_a_pack_at_a_time_and_loading_assigns_a_value_at_a_time(monkeypatch):
    # Packs of at most 1 KiB whole: the 20x64 kernel's moments (5 KiB)
    # travel alone, the others two or three to a pack.
    bytes_per_pack = 1024
    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local", bytes_per_pack=bytes_per_pack)
    model = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=True))
    model.fit(*data(rows=BATCH), batch_size=BATCH, verbose=0)
    optimizer, sharded = model.optimizer, model.optimizer.shards
    states = {i for i, v in enumerate(optimizer.variables) if sharded.is_state(v)}
    # Each state variable's bytes as gathered: n parts, padded.
    padded = {
        i: 4 * N * sharded.part_sizes[sharded.index_of_state(optimizer.variables[i])] for i in states
    }
    events = []
    all_gather = sharding.all_gather

    def recording_all_gather(tensors, when=None):
        gathered = all_gather(tensors, when)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        nbytes = sum(tf.size(t) * t.dtype.size for t in gathered)

        def note(replica, nbytes):
            if replica == 0:
                events.append(("gather", int(nbytes)))

        tf.py_function(note, [replica, nbytes], [])
        return gathered

    monkeypatch.setattr(sharding, "all_gather", recording_all_gather)
    saved = RecordingStore(events)
    optimizer.save_own_variables(saved)
    gathers = [nbytes for kind, nbytes in events if kind == "gather"]
    assert max(gathers) <= max(bytes_per_pack, *padded.values())
    assert sum(gathers) == sum(padded.values()) and len(gathers) >= 4, events
    # Every state value gathered is written before the next gather.
    gathered = written = 0
    for kind, value in events:
        if kind == "gather":
            assert gathered == written, events
            gathered += value
        elif value in states:
            written += padded[value]
    assert gathered == written
    # The values are the unsharded optimizer's (the layout test compares
    # them with one).
    np.testing.assert_equal(list(saved.values()), saving.saved_values(optimizer))

    fresh = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=True))
    with strategy.scope():
        fresh.optimizer.build(fresh.trainable_variables)
    variables, fresh_sharded = fresh.optimizer.variables, fresh.optimizer.shards

    def holds_saved_value(i):
        index = fresh_sharded.index_of_state(variables[i])
        rows = fresh_sharded.rows(dict.__getitem__(saved, str(i)), index)
        copies = strategy.experimental_local_results(variables[i].value)
        return all(np.array_equal(c.numpy(), row) for c, row in zip(copies, rows.numpy()))

    assert not any(holds_saved_value(i) for i in states)
    events.clear()
    assigned_at_read = []

    class CheckingStore(RecordingStore):
        def __getitem__(self, key):
            if int(key) in states:
                assigned_at_read.append(sorted(i for i in states if holds_saved_value(i)))
            return super().__getitem__(key)

    fresh.optimizer.load_own_variables(CheckingStore(events, saved))
    read = [i for kind, i in events if kind == "read" and i in states]
    # When each state value is read, every one read before it is assigned.
    assert assigned_at_read == [sorted(read[:k]) for k in range(len(read))]
    np.testing.assert_equal(saving.saved_values(fresh.optimizer), list(saved.values()))


def continued(strategy, shard, path=None, load_model=False):
    """A model trained on the second half of the data, from `path` (a
    `.keras` file of the first half) or from the start on both halves."""
    x, y = data(rows=STEPS * BATCH)
    halves = [(x[: len(x) // 2], y[: len(y) // 2]), (x[len(x) // 2 :], y[len(y) // 2 :])]
    if load_model:
        with strategy.scope():
            model = keras.saving.load_model(path)
    else:
        model = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=shard))
        if path is not None:
            with strategy.scope():
                model.optimizer.build(model.trainable_variables)
            model.load_weights(path)
    for part in halves[path is not None :]:
        model.fit(*part, batch_size=BATCH, verbose=0, shuffle=False)
    return model


@functools.cache
def uninterrupted_run():
    return continued(tf_agn.strategies.mirrored(DEVICES), False)


@pytest.mark.parametrize(
    "first, then, load_model",
    [((4, True), (2, True), True), ((4, True), (2, False), False), ((2, False), (4, True), False)],
    ids=["sharded4-to-sharded2", "sharded4-to-unsharded2", "unsharded2-to-sharded4"],
)
def test_a_file_resumes_sharded_or_not_on_another_replica_count(first, then, load_model, tmp_path):
    (first_replicas, first_shard), (then_replicas, then_shard) = first, then
    x, y = data(rows=STEPS * BATCH)
    model = build(
        tf_agn.strategies.mirrored(DEVICES[:first_replicas]),
        lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=first_shard),
    )
    model.fit(x[: len(x) // 2], y[: len(y) // 2], batch_size=BATCH, verbose=0, shuffle=False)
    model.save(tmp_path / "half.keras")
    strategy = tf_agn.strategies.mirrored(DEVICES[:then_replicas])
    resumed = continued(strategy, then_shard, tmp_path / "half.keras", load_model)
    assert resumed.optimizer.shard_optimizer_state == then_shard
    uninterrupted = uninterrupted_run()
    # MEAN over another replica count sums in another order.
    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights()):
        assert relative(got, want) <= 1e-5
    saved = zip(saving.saved_values(resumed.optimizer), saving.saved_values(uninterrupted.optimizer))
    for got, want in saved:
        assert relative(got, want) <= 1e-5


def test_keras_checkpoints_save_a_sharded_run_whole_and_tf_checkpoints_refuse(tmp_path):
    strategy = tf_agn.strategies.mirrored(DEVICES)
    model = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, shard_optimizer_state=True))
    model.fit(
        *data(rows=4 * BATCH), batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
        callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.keras")),
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False),
        ],
    )
    want = saving.saved_values(model.optimizer)
    moment_shapes = sorted(tuple(v.shape) for v in model.trainable_variables for _ in range(2))
    for path in (tmp_path / "epoch2.keras", tmp_path / "backup" / "latest.weights.h5"):
        saved = saved_optimizer(path)
        assert sorted(v.shape for v in saved.values() if v.ndim) == moment_shapes, path
        for got, value in zip(saved.values(), want):
            np.testing.assert_array_equal(got, value)
    # TensorFlow's own checkpoints would keep one replica's part: refused.
    with pytest.raises(ValueError, match="VariableAggregation"):
        tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "tf_checkpoint"))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accumulation_reduce_scatters_each_window_once(reduction):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local")

    def make():
        optimizer = keras.optimizers.AdamW(
            1e-2, weight_decay=0.05, global_clipnorm=0.5, gradient_accumulation_steps=3
        )
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    sharded = train(strategy, make, True, accumulation_reduction=reduction)
    plain = train(strategy, make, False, accumulation_reduction=reduction)
    # Both runs spare the biases, as told (tests/test_wrapped_settings.py
    # compares such a run with stock Keras).
    for model, _ in (sharded, plain):
        decayed = {
            (v.name, _compat.uses_weight_decay(model.optimizer.inner_optimizer, v))
            for v in model.trainable_variables
        }
        assert decayed == {("kernel", True), ("bias", False)}, decayed
    assert_same_training(sharded, plain)
    stats = sharded[0].optimizer.communication_stats()
    windows = STEPS // 3
    assert stats["reduce_scatter_calls"] == stats["all_gather_calls"] == windows
    # Each window's global norm and its finite agreement.
    assert stats["all_reduce_calls"] == 2 * windows


def test_memory_stats_count_a_quarter_of_adams_moments():
    strategy = tf_agn.strategies.mirrored(DEVICES, transport="local")
    sharded, _ = train(strategy, OPTIMIZERS["adam"], True, steps=2)
    plain, _ = train(strategy, OPTIMIZERS["adam"], False, steps=2)
    weights = 4 * (20 * 64 + 64 + 64 * 3 + 3)
    parts = 4 * (320 + 16 + 48 + 1)  # a quarter of each variable, padded
    counters = 8 + 4  # Adam's iteration (int64) and learning rate
    assert plain.optimizer.memory_stats() == {
        "weights": weights, "gradients": weights, "accumulators": 0,
        "optimizer_state": 2 * weights + counters, "compressor_state": 0,
    }
    # The two moments' parts, and the part of the weights each step updates.
    assert sharded.optimizer.memory_stats()["optimizer_state"] == 3 * parts + counters
    # Accumulators and an int8 residual are whole, on every replica.
    accumulating, _ = train(
        strategy, lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), False,
        compression="int8", steps=2,
    )
    stats = accumulating.optimizer.memory_stats()
    assert stats["accumulators"] == stats["compressor_state"] == weights
    assert stats["optimizer_state"] == counters
