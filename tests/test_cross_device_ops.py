"""`AggregatingAllReduce` under a real 4-replica `MirroredStrategy`.

Every replica holds a different value (it depends on the replica id), and
every expectation is computed in numpy from those values, so a result from
the wrong replica or off by a factor of the replica count fails.

Two routes in `MirroredStrategy` bypass any `cross_device_ops` by design:
`strategy.reduce` to a CPU device, and int32 values, both go to
`tf.distribute.ReductionToOneDevice`. Tests that must reach our ops there
call the ops object itself. A batch that mixes int32 with other values, or
holds two int32 values, is refused by `MirroredStrategy` itself.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import DEVICES
from conftest import NUM_REPLICAS
import placed_values
import replica_aggregate
import tf_agn
from tf_agn import AggregatingAllReduce
from tf_agn import AggregationMethod
from tf_agn.collectives import packing

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN

# Relative tolerances: the results are rounded to their own dtype.
TOLERANCE = {
    tf.float16: 1e-3,
    tf.bfloat16: 1e-2,
    tf.float32: 1e-6,
    tf.float64: 1e-12,
}
FLOATS = list(TOLERANCE)


def name_of(value):
    """Test ids: "float16", "SUM", ..."""
    return value.name


class CountingAllReduce(AggregatingAllReduce):
    """Counts calls, to show that a code path reached these ops."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = collections.Counter()

    def batch_reduce_implementation(self, *args, **kwargs):
        self.calls["batch_reduce"] += 1
        return super().batch_reduce_implementation(*args, **kwargs)

    def broadcast_implementation(self, *args, **kwargs):
        self.calls["broadcast"] += 1
        return super().broadcast_implementation(*args, **kwargs)

    def _gather_implementation(self, *args, **kwargs):
        self.calls["gather"] += 1
        return super()._gather_implementation(*args, **kwargs)


def device_of(tensor):
    """`tensor`'s device, without the job/replica/task prefix."""
    return tensor.device[tensor.device.index("/device:") :]


def make_strategy(ops=None, **kwargs):
    ops = ops or AggregatingAllReduce(**kwargs)
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)


def replica_arrays(shape, dtype, seed=0):
    """A different array per replica, already rounded to `dtype`."""
    if dtype.is_integer:
        base = np.arange(int(np.prod(shape))).reshape(shape)
        arrays = [base * (r + 1) + r for r in range(NUM_REPLICAS)]
        return [a.astype(dtype.as_numpy_dtype) for a in arrays]
    base = np.random.default_rng(seed).uniform(0.5, 1.5, size=shape)
    arrays = [base * (r + 1) + r for r in range(NUM_REPLICAS)]
    return [tf.cast(a, dtype).numpy() for a in arrays]


def per_replica(strategy, arrays):
    """A `PerReplica` value holding `arrays[r]` on replica r's device."""
    return placed_values.per_replica(strategy, DEVICES, arrays)


def expected(reduce_op, arrays):
    total = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    return total / len(arrays) if reduce_op == MEAN else total


def assert_mirrored(value, want, dtype, placed=True):
    """Asserts `value` holds `want` in `dtype` for every replica.

    Args:
        value: a `DistributedValues`.
        want: the expected numpy array.
        dtype: the expected dtype.
        placed: whether to check that component r is on replica r's device.
            Not for values a `tf.function` returned: their eager tensors
            all report the device the function was called on.
    """
    local = value.values
    assert len(local) == NUM_REPLICAS
    if placed:
        assert [device_of(t) for t in local] == DEVICES
    rtol = TOLERANCE.get(dtype, 0)
    for tensor in local:
        assert tensor.dtype == dtype
        np.testing.assert_allclose(
            tensor.numpy().astype(np.float64), want, rtol=rtol
        )


# strategy.reduce and batch_reduce_to.


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=name_of)
@pytest.mark.parametrize("dtype", FLOATS, ids=name_of)
def test_strategy_reduce(reduce_op, dtype):
    strategy = make_strategy()
    arrays = replica_arrays([3, 5], dtype)
    result = strategy.reduce(reduce_op, per_replica(strategy, arrays), None)
    assert result.dtype == dtype
    np.testing.assert_allclose(
        result.numpy().astype(np.float64),
        expected(reduce_op, arrays),
        rtol=TOLERANCE[dtype],
    )


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=name_of)
@pytest.mark.parametrize("dtype", FLOATS, ids=name_of)
def test_ops_reduce_to_one_device(reduce_op, dtype):
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([4], dtype)
    result = ops.reduce(
        reduce_op, per_replica(strategy, arrays), destinations=DEVICES[2]
    )
    # One destination: a plain tensor there, as ReductionToOneDevice gives.
    assert device_of(result) == DEVICES[2]
    assert result.dtype == dtype
    np.testing.assert_allclose(
        result.numpy().astype(np.float64),
        expected(reduce_op, arrays),
        rtol=TOLERANCE[dtype],
    )


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=name_of)
@pytest.mark.parametrize("dtype", FLOATS, ids=name_of)
def test_batch_reduce_to(reduce_op, dtype):
    ops = CountingAllReduce(bytes_per_pack=64)
    strategy = make_strategy(ops)
    shapes = [[2, 3], [7], [], [4, 1, 2]]
    arrays = [replica_arrays(s, dtype, seed) for seed, s in enumerate(shapes)]
    values = [per_replica(strategy, a) for a in arrays]
    results = strategy.extended.batch_reduce_to(
        reduce_op, [(v, v) for v in values]
    )
    assert ops.calls["batch_reduce"] == 1
    for result, replica_values in zip(results, arrays):
        assert_mirrored(result, expected(reduce_op, replica_values), dtype)


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64], ids=name_of)
def test_integers_sum_exactly(dtype):
    ops = CountingAllReduce(bytes_per_pack=16)
    strategy = make_strategy(ops)
    arrays = [replica_arrays(s, dtype) for s in ([2, 3], [5])]
    values = [per_replica(strategy, a) for a in arrays]
    pairs = [(v, v) for v in values]
    for results in (
        ops.batch_reduce(SUM, pairs),
        # MirroredStrategy sends int32 to a new ReductionToOneDevice per
        # value, so it can batch-reduce only one int32 value at a time.
        [strategy.extended.batch_reduce_to(SUM, [p])[0] for p in pairs],
    ):
        for result, replica_values in zip(results, arrays):
            want = np.sum(replica_values, axis=0)
            assert_mirrored(result, want, dtype)
            np.testing.assert_array_equal(result.values[0].numpy(), want)
    assert ops.calls["batch_reduce"] == (1 if dtype == tf.int32 else 3)


def test_integer_mean_is_refused():
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    value = per_replica(strategy, replica_arrays([3], tf.int64))
    with pytest.raises(ValueError, match="Cannot MEAN int64"):
        strategy.extended.batch_reduce_to(MEAN, [(value, value)])
    int32 = per_replica(strategy, replica_arrays([3], tf.int32))
    with pytest.raises(ValueError, match="integers can only be summed"):
        ops.reduce(MEAN, int32, destinations=int32)


# Replica context.

# float16, bfloat16, float32, float64 and int64 tensors, interleaved so that
# packing has to regroup them by dtype. (int32 cannot join, see the module
# docstring.)
MIXED = [
    ([3, 4], tf.float32),
    ([5], tf.float16),
    ([2, 2, 3], tf.float64),
    ([], tf.float32),
    ([6], tf.bfloat16),
    ([4], tf.int64),
    ([17], tf.float32),
    ([2, 5], tf.float16),
    ([3], tf.float64),
    ([8, 2], tf.float32),
]


@pytest.mark.parametrize("jit_compile", [True, False])
@pytest.mark.parametrize("flatten_packs", [True, False, "auto"])
def test_replica_all_reduce_in_tf_function(flatten_packs, jit_compile):
    # 32 bytes: most packs hold one to three tensors.
    ops = CountingAllReduce(
        bytes_per_pack=32, flatten_packs=flatten_packs, jit_compile=jit_compile
    )
    strategy = make_strategy(ops)
    sizes = [(dtype, max(1, int(np.prod(shape)))) for shape, dtype in MIXED]
    assert len(packing.plan_packs(sizes, 32)) >= 8
    arrays = [
        replica_arrays(shape, dtype, seed)
        for seed, (shape, dtype) in enumerate(MIXED)
    ]
    stacked = [np.stack(a) for a in arrays]
    floats = [i for i, (_, dtype) in enumerate(MIXED) if dtype.is_floating]
    placements = {}

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
            local = [tf.constant(s)[replica] for s in stacked]
            sums = context.all_reduce(SUM, local)
            means = context.all_reduce(MEAN, [local[i] for i in floats])
            # Where the graph places this replica's results.
            placements[int(tf.get_static_value(replica))] = {
                device_of(t) for t in sums + means
            }
            return sums, means

        return strategy.run(replica_fn)

    sums, means = step()
    assert ops.calls["batch_reduce"] == 2
    assert placements == {r: {d} for r, d in enumerate(DEVICES)}
    for result, replica_values, (_, dtype) in zip(sums, arrays, MIXED):
        want = expected(SUM, replica_values)
        assert_mirrored(result, want, dtype, placed=False)
    for result, i in zip(means, floats):
        want = expected(MEAN, arrays[i])
        assert_mirrored(result, want, MIXED[i][1], placed=False)


# aggregate().


@pytest.mark.parametrize("value_scale", [1.0, 0.5])
@pytest.mark.parametrize("method", list(AggregationMethod))
def test_aggregate(method, value_scale):
    ops = AggregatingAllReduce(bytes_per_pack=24)
    strategy = make_strategy(ops)
    arrays = [
        replica_arrays(s, tf.float32, i) for i, s in enumerate([[3], [2, 2]])
    ]
    values = [per_replica(strategy, a) for a in arrays]
    results = replica_aggregate.aggregate(strategy, method, values, value_scale=value_scale)
    for result, replica_values in zip(results, arrays):
        local = [t.numpy() for t in result.values]
        assert [device_of(t) for t in result.values] == DEVICES
        scaled = [value_scale * a.astype(np.float64) for a in replica_values]
        if method is AggregationMethod.NONE:
            want = scaled
        elif method is AggregationMethod.SUM:
            want = [np.sum(scaled, axis=0)] * NUM_REPLICAS
        elif method is AggregationMethod.MEAN:
            want = [np.mean(scaled, axis=0)] * NUM_REPLICAS
        else:
            want = [scaled[0]] * NUM_REPLICAS
        for got, w in zip(local, want):
            np.testing.assert_allclose(got, w, rtol=1e-6)


def test_aggregate_mean_with_replica_count_scale_is_the_sum():
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([5], tf.float32)
    value = per_replica(strategy, arrays)
    (result,) = replica_aggregate.aggregate(strategy, "mean", [value], value_scale=NUM_REPLICAS)
    assert_mirrored(result, expected(SUM, arrays), tf.float32)


def test_aggregate_in_replica_context_in_tf_function():
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([2, 3], tf.float32)
    stacked = np.stack(arrays)

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            local = tf.constant(stacked)[context.replica_id_in_sync_group]
            (combined,) = tf_agn.aggregate(
                [local], AggregationMethod.ONLY_FIRST_REPLICA, value_scale=2.0
            )
            return combined

        return strategy.run(replica_fn)

    assert_mirrored(step(), 2.0 * arrays[0], tf.float32, placed=False)


def test_aggregate_integers():
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([3], tf.int64)
    value = per_replica(strategy, arrays)
    (first,) = replica_aggregate.aggregate(strategy, "only_first_replica", [value])
    assert_mirrored(first, arrays[0], tf.int64)
    with pytest.raises(ValueError, match="scale 2"):
        replica_aggregate.aggregate(strategy, "sum", [value], value_scale=2)


# Compression: `aggregate` compresses; TensorFlow's entry points stay exact
# (tests/test_compression.py).


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=name_of)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=name_of)
@pytest.mark.parametrize(
    "compression, tolerance", [("fp16", 1e-3), ("bf16", 1e-2)]
)
def test_compression(compression, tolerance, dtype, reduce_op):
    ops = AggregatingAllReduce(compression=compression, bytes_per_pack=64)
    strategy = make_strategy(ops)
    arrays = [replica_arrays(s, dtype, i) for i, s in enumerate([[40], [3, 7]])]
    values = [per_replica(strategy, a) for a in arrays]
    results = replica_aggregate.aggregate(strategy, 
        AggregationMethod.parse(reduce_op), values, compressor=ops.default_compressor
    )
    for result, replica_values in zip(results, arrays):
        exact = expected(reduce_op, replica_values)
        # Each replica's value is rounded once, so the error is bounded by
        # the tolerance times the magnitude of what was summed.
        magnitude = expected(reduce_op, [np.abs(a) for a in replica_values])
        for tensor in result.values:
            assert tensor.dtype == dtype
            error = np.abs(tensor.numpy() - exact)
            assert np.all(error <= tolerance * magnitude)
            # The values did travel compressed: the result is not exact.
            assert np.any(error > 0)


def test_compression_leaves_half_precision_and_integers_alone():
    ops = AggregatingAllReduce(compression="bf16")
    strategy = make_strategy(ops)
    halves = replica_arrays([9], tf.float16)
    ints = replica_arrays([4], tf.int64)
    values = [per_replica(strategy, halves), per_replica(strategy, ints)]
    half, integer = replica_aggregate.aggregate(strategy, "sum", values, compressor=ops.default_compressor)
    # float32 holds sums of four float16 values exactly, so the result is
    # their sum rounded once to float16; bfloat16 on the way would not be.
    want = np.sum(halves, axis=0, dtype=np.float64).astype(np.float16)
    assert_mirrored(half, want, tf.float16)
    np.testing.assert_array_equal(half.values[1].numpy(), want)
    np.testing.assert_array_equal(
        integer.values[3].numpy(), np.sum(ints, axis=0)
    )


# Sparse values.


def replica_slices(num_rows=6, width=3):
    """Per-replica `(values, indices)`, with repeated indices."""
    rng = np.random.default_rng(1)
    slices = []
    for r in range(NUM_REPLICAS):
        indices = np.array([r % num_rows, 2, 2, 5, r % 2], np.int64)
        rows = rng.uniform(size=(len(indices), width)).astype(np.float32)
        slices.append((rows + r, indices))
    return slices


def per_replica_slices(strategy, slices):
    """A `PerReplica` of `tf.IndexedSlices` with 6 x 3 dense shapes."""

    def value_fn(context):
        replica = context.replica_id_in_sync_group
        rows, indices = slices[replica]
        with tf.device(DEVICES[replica]):
            return tf.IndexedSlices(
                tf.identity(tf.constant(rows)),
                tf.identity(tf.constant(indices)),
                tf.identity(tf.constant([6, 3], tf.int64)),
            )

    return strategy.experimental_distribute_values_from_function(value_fn)


def densify(rows, indices, num_rows=6):
    dense = np.zeros((num_rows, rows.shape[1]), np.float64)
    np.add.at(dense, indices, rows)
    return dense


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=name_of)
def test_indexed_slices_reduce(reduce_op):
    strategy = make_strategy()
    slices = replica_slices()
    value = per_replica_slices(strategy, slices)
    (result,) = strategy.extended.batch_reduce_to(reduce_op, [(value, value)])
    want = expected(reduce_op, [densify(*s) for s in slices])
    for local in result.values:
        assert isinstance(local, tf.IndexedSlices)
        np.testing.assert_allclose(
            tf.convert_to_tensor(local).numpy(), want, rtol=1e-6
        )


def test_indexed_slices_from_gather_gradient():
    strategy = make_strategy()
    slices = replica_slices()
    indices = np.stack([s[1] for s in slices])
    weights = np.stack([s[0] for s in slices])
    with strategy.scope():
        table = tf.Variable(tf.zeros([6, 3]))

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
            with tf.GradientTape() as tape:
                rows = tf.gather(table, tf.constant(indices)[replica])
                loss = tf.reduce_sum(rows * tf.constant(weights)[replica])
            grad = tape.gradient(loss, table)
            reduced = context.all_reduce(SUM, grad)
            return (
                isinstance(grad, tf.IndexedSlices),
                tf.convert_to_tensor(reduced),
            )

        return strategy.run(replica_fn)

    sparse, reduced = step()
    assert sparse
    want = expected(SUM, [densify(*s) for s in slices])
    for local in reduced.values:
        np.testing.assert_allclose(local.numpy(), want, rtol=1e-6)


def test_aggregate_indexed_slices_only_first_replica():
    ops = AggregatingAllReduce()
    strategy = make_strategy(ops)
    slices = replica_slices()
    value = per_replica_slices(strategy, slices)
    (result,) = replica_aggregate.aggregate(strategy, "only_first_replica", [value], value_scale=3.0)
    for local in result.values:
        np.testing.assert_allclose(
            tf.convert_to_tensor(local).numpy(),
            3.0 * densify(*slices[0]),
            rtol=1e-6,
        )


# Gather and broadcast.


def test_strategy_gather():
    ops = CountingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([2, 3], tf.float32)
    value = per_replica(strategy, arrays)
    for axis in (0, 1):
        gathered = strategy.gather(value, axis=axis)
        np.testing.assert_array_equal(
            gathered.numpy(), np.concatenate(arrays, axis=axis)
        )
    assert ops.calls["gather"] == 2


def test_replica_all_gather():
    ops = CountingAllReduce()
    strategy = make_strategy(ops)
    arrays = replica_arrays([2, 3], tf.float32)
    stacked = np.stack(arrays)

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            local = tf.constant(stacked)[context.replica_id_in_sync_group]
            return context.all_gather(local, axis=1)

        return strategy.run(replica_fn)

    want = np.concatenate(arrays, axis=1)
    assert_mirrored(step(), want, tf.float32, placed=False)
    assert ops.calls["gather"] == 1


def test_broadcast_to_distributed_values():
    ops = CountingAllReduce()
    strategy = make_strategy(ops)
    destinations = per_replica(strategy, replica_arrays([3], tf.float32))
    source = np.array([1.5, -2.0, 4.0], np.float32)
    result = strategy.extended.broadcast_to(
        tf.constant(source), destinations=destinations
    )
    assert_mirrored(result, source, tf.float32)
    assert ops.calls["broadcast"] == 1


# packing.plan_packs.


F32, F16, I64 = tf.float32, tf.float16, tf.int64


def test_plan_packs_groups_by_dtype_in_order():
    sizes = [(F32, 1), (F16, 1), (F32, 1), (I64, 1), (F16, 1), (F32, 1)]
    assert packing.plan_packs(sizes, 1024) == [[0, 2, 5], [1, 4], [3]]


def test_plan_packs_respects_the_bound_exactly():
    # 4 float32 = 16 bytes fit a 16-byte pack; a fifth opens a new one.
    sizes = [(F32, 2), (F32, 2), (F32, 1), (F16, 8), (F16, 1)]
    assert packing.plan_packs(sizes, 16) == [[0, 1], [2], [3], [4]]


def test_plan_packs_puts_an_oversized_tensor_alone():
    sizes = [(F32, 1), (F32, 1), (F32, 100), (F32, 1), (F32, 1)]
    assert packing.plan_packs(sizes, 16) == [[0, 1], [2], [3, 4]]


def test_plan_packs_covers_everything_within_the_bound():
    rng = np.random.default_rng(0)
    dtypes = [F32, F16, I64, tf.float64]
    sizes = [
        (dtypes[rng.integers(4)], int(rng.integers(1, 300))) for _ in range(200)
    ]
    bound = 512
    packs = packing.plan_packs(sizes, bound)
    assert sorted(i for pack in packs for i in pack) == list(range(200))
    for pack in packs:
        assert pack == sorted(pack)
        assert len({sizes[i][0] for i in pack}) == 1
        nbytes = sum(sizes[i][1] * sizes[i][0].size for i in pack)
        assert nbytes <= bound or len(pack) == 1


# Bad arguments.


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4096", None])
def test_bad_bytes_per_pack(bad):
    with pytest.raises(ValueError, match="bytes_per_pack") as error:
        AggregatingAllReduce(bytes_per_pack=bad)
    assert repr(bad) in str(error.value)


@pytest.mark.parametrize("bad", ["fp8", "int2", 16])
def test_bad_compression(bad):
    with pytest.raises(ValueError, match="Unknown compression") as error:
        AggregatingAllReduce(compression=bad)
    assert repr(bad) in str(error.value)


def test_bad_aggregation():
    with pytest.raises(ValueError, match="'average'") as error:
        AggregatingAllReduce(aggregation="average")
    for name in AggregationMethod.names():
        assert name in str(error.value)


def test_bad_flatten_packs():
    with pytest.raises(ValueError, match="flatten_packs"):
        AggregatingAllReduce(flatten_packs="yes")


# Keras.


def fit_history(cross_device_ops):
    """Trains a small classifier with `model.fit`; returns its history."""
    strategy = make_strategy(cross_device_ops)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=False,
        )
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return history.history


def test_keras_fit_matches_reduction_to_one_device():
    ops = CountingAllReduce()
    ours = fit_history(ops)
    stock = fit_history(tf.distribute.ReductionToOneDevice())
    assert ops.calls["batch_reduce"] > 0
    assert set(ours) == {"loss", "accuracy"}
    for name in ours:
        np.testing.assert_allclose(ours[name], stock[name], rtol=1e-5)
    # Training did something, so matching histories mean matching updates.
    assert ours["loss"][-1] < ours["loss"][0]
