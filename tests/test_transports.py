"""`AggregatingAllReduce`'s two transports on 4 logical CPUs of one process.

The collective transport runs TensorFlow's real collective ops (a ring on
CPUs) across the 4 replicas. Every result is checked against numpy and
against the local transport, for every method, dtype, sparse values and
compression; and the path Keras takes (`replica_context.all_reduce` inside
`strategy.run`) is checked for placement, with inputs that carry their
device and inputs that do not.
"""

import textwrap

import numpy as np
import pytest
import tensorflow as tf

from conftest import DEVICES
from conftest import NUM_REPLICAS
import tf_agn
import replica_aggregate
from scripts import run_python
from tf_agn import AggregatingAllReduce
from tf_agn import AggregationMethod
from tf_agn import transports
from tf_agn.transports import groups

TRANSPORTS = ["local", "collective"]
Options = tf.distribute.experimental.CommunicationOptions
# Relative tolerances. "collective" sums float16 and bfloat16 (and what
# compression made so) in that dtype, one rounding per ring step, where
# "local" sums in float32 and rounds once.
TOLERANCE = {tf.float16: 4e-3, tf.bfloat16: 3e-2, tf.float32: 1e-6}
COMPRESSION_TOLERANCE = {"fp16": 4e-3, "bf16": 3e-2}
SHAPES = [(3, 5), (7,), (2, 2, 2), (11,)]


def strategy_for(**kwargs):
    ops = AggregatingAllReduce(**kwargs)
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops), ops


def replica_arrays(dtype, shapes=SHAPES, seed=0):
    """arrays[r][i]: replica r's i-th array, already rounded to `dtype`."""
    rng = np.random.default_rng(seed)
    bases = [rng.uniform(0.5, 1.5, size=s) for s in shapes]
    return [
        [tf.cast(b * (r + 1) + r, dtype).numpy() for b in bases]
        for r in range(NUM_REPLICAS)
    ]


def distribute(strategy, arrays, placed=True):
    """One `PerReplica` value per position i, holding arrays[r][i]."""

    def value_fn(index):
        def fn(context):
            array = arrays[context.replica_id_in_sync_group][index]
            if not placed:
                return tf.constant(array)
            with tf.device(DEVICES[context.replica_id_in_sync_group]):
                return tf.identity(tf.constant(array))

        return fn

    return [
        strategy.experimental_distribute_values_from_function(value_fn(i))
        for i in range(len(arrays[0]))
    ]


def reference(method, arrays, value_scale=1.0):
    """What every replica should hold, per replica, in float64."""
    wide = [[a.astype(np.float64) * value_scale for a in r] for r in arrays]
    if method is AggregationMethod.NONE:
        return wide
    if method is AggregationMethod.ONLY_FIRST_REPLICA:
        combined = wide[0]
    else:
        combined = [sum(column) for column in zip(*wide)]
        if method is AggregationMethod.MEAN:
            combined = [c / NUM_REPLICAS for c in combined]
    return [combined] * NUM_REPLICAS


def assert_placed(devices):
    """Replica r's result is on DEVICES[r] (full or short names)."""
    short = [d[d.index("/device:") :] if "/device:" in d else d for d in devices]
    assert short == DEVICES, devices


def assert_results(results, want, rtol):
    for index, value in enumerate(results):
        for replica, tensor in enumerate(value.values):
            np.testing.assert_allclose(
                tensor.numpy().astype(np.float64),
                want[replica][index],
                rtol=rtol,
                err_msg=f"value {index}, replica {replica}",
            )


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda d: d.name)
@pytest.mark.parametrize("method", list(AggregationMethod), ids=str)
def test_aggregate_matches_numpy(method, dtype, transport):
    # 64-byte packs split the values into several packs.
    strategy, ops = strategy_for(transport=transport, bytes_per_pack=64)
    arrays = replica_arrays(dtype)
    results = replica_aggregate.aggregate(strategy, method, distribute(strategy, arrays), value_scale=0.5)
    assert_results(results, reference(method, arrays, 0.5), TOLERANCE[dtype])
    for value in results:
        assert [t.dtype for t in value.values] == [dtype] * NUM_REPLICAS
        assert_placed([t.device for t in value.values])


@pytest.mark.parametrize("compression", list(COMPRESSION_TOLERANCE))
@pytest.mark.parametrize("method", ["sum", "mean", "only_first_replica"])
def test_compression_matches_numpy(method, compression):
    strategy, ops = strategy_for(transport="collective", compression=compression)
    arrays = replica_arrays(tf.float32)
    results = replica_aggregate.aggregate(strategy, method, distribute(strategy, arrays), compressor=ops.default_compressor)
    method = AggregationMethod.parse(method)
    assert_results(results, reference(method, arrays), COMPRESSION_TOLERANCE[compression])
    assert results[0].values[0].dtype == tf.float32


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("method", ["sum", "mean", "only_first_replica"])
def test_sparse_values_are_gathered(method, transport):
    strategy, ops = strategy_for(transport=transport)
    rng = np.random.default_rng(3)
    rows = [rng.uniform(size=(r + 1, 4)).astype(np.float32) for r in range(NUM_REPLICAS)]
    indices = [rng.integers(0, 6, size=r + 1) for r in range(NUM_REPLICAS)]

    def fn(context):
        r = context.replica_id_in_sync_group
        with tf.device(DEVICES[r]):
            return tf.IndexedSlices(
                tf.constant(rows[r]), tf.constant(indices[r]), tf.constant([6, 4])
            )

    value = strategy.experimental_distribute_values_from_function(fn)
    (result,) = replica_aggregate.aggregate(strategy, method, [value])
    dense = [np.zeros((6, 4)) for _ in range(NUM_REPLICAS)]
    for r in range(NUM_REPLICAS):
        np.add.at(dense[r], indices[r], rows[r])
    want = reference(AggregationMethod.parse(method), [[d] for d in dense])
    for replica, slices in enumerate(result.values):
        assert isinstance(slices, tf.IndexedSlices)
        got = tf.math.unsorted_segment_sum(slices.values, slices.indices, 6)
        np.testing.assert_allclose(got.numpy(), want[replica][0], rtol=1e-6)


def keras_path_step(strategy, placed_inputs):
    """A compiled step that all-reduces (SUM) from inside `strategy.run`, as
    Keras's optimizer does; returns per-replica results and their devices."""

    @tf.function
    def step(x, y):
        def replica_fn(x, y):
            if placed_inputs:  # computed on the replica's device
                x, y = x * 1.0, y * 1.0
            context = tf.distribute.get_replica_context()
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [x, y])
            return reduced, [t.device for t in reduced]

        return strategy.run(replica_fn, args=(x, y))

    return step


@pytest.mark.parametrize("placed_inputs", [True, False], ids=["placed", "unplaced"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_keras_path_results_sit_on_their_replica(transport, placed_inputs):
    strategy, _ = strategy_for(transport=transport)
    arrays = replica_arrays(tf.float32, shapes=[(4, 3), (5,)])
    x, y = distribute(strategy, arrays, placed=False)
    reduced, devices = keras_path_step(strategy, placed_inputs)(x, y)
    want = reference(AggregationMethod.SUM, arrays)
    assert_results(reduced, want, 1e-6)
    for per_value in devices:
        assert_placed([d.numpy().decode() for d in per_value.values])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_pattern_matches_numpy(transport):
    """The vocabulary each transport offers, one entry per local replica in
    and out: all-reduce (weighted), reduce-scatter, all-gather, all-to-all."""
    strategy, ops = strategy_for(transport=transport)
    n = NUM_REPLICAS
    rng = np.random.default_rng(4)
    arrays = [rng.normal(size=(n, 6)).astype(np.float32) for _ in range(n)]
    (value,) = distribute(strategy, [[a] for a in arrays])
    patterns = ops.transport_for(value)
    local = list(value.values)

    def run(tensors):
        return (
            [r for (r,) in patterns.all_reduce([[t] for t in tensors], [0.5] * n)],
            patterns.reduce_scatter(tensors),
            patterns.all_gather(tensors),
            patterns.all_to_all(tensors),
        )

    reduced, scattered, gathered, exchanged = patterns.eager(("patterns_test",), run)(local)
    total = sum(arrays)
    for r in range(n):
        np.testing.assert_allclose(reduced[r].numpy(), 0.5 * total, rtol=1e-6)
        np.testing.assert_allclose(scattered[r].numpy(), total[r], rtol=1e-6)
        np.testing.assert_array_equal(gathered[r].numpy(), np.concatenate(arrays))
        np.testing.assert_array_equal(exchanged[r].numpy(), np.stack([a[r] for a in arrays]))
    for results in (reduced, scattered, gathered, exchanged):
        assert_placed([t.device for t in results])


def test_device_less_values_take_their_replica_device():
    """Function inputs carry the device "": the ops must place each
    replica's work on the strategy's device of the same index, not leave
    it to the placer (which puts everything on one device)."""
    strategy, ops = strategy_for(transport="local", flatten_packs=False)
    arrays = replica_arrays(tf.float32, shapes=[(2, 2)])

    @tf.function
    def reduce(x):
        assert [t.device for t in x.values] == [""] * NUM_REPLICAS
        (result,) = replica_aggregate.aggregate(strategy, "sum", [x])
        return [t.device for t in result.values]

    (x,) = distribute(strategy, arrays, placed=False)
    with strategy.scope():
        devices = reduce(x)
    assert_placed([d.numpy().decode() for d in devices])


def test_replica_context_collective_without_merge_call():
    """`MultiWorkerMirroredStrategy` on GPUs calls `_all_reduce` from each
    replica without merge_call; every replica launches its own part."""
    strategy, ops = strategy_for(transport="collective")
    arrays = replica_arrays(tf.float32, shapes=[(3,), (2, 2)])
    values = distribute(strategy, arrays)

    @tf.function
    def step(x, y):
        def replica_fn(x, y):
            context = tf.distribute.get_replica_context()
            # A Python int, as the strategy passes it.
            replica = int(tf.get_static_value(context.replica_id_in_sync_group))
            return ops._all_reduce("mean", [x * 1.0, y * 1.0], replica, None)

        return strategy.run(replica_fn, args=(x, y))

    reduced = step(*values)
    assert_results(reduced, reference(AggregationMethod.MEAN, arrays), 1e-6)


def count_ops(function, *args, op_type):
    graph = function.get_concrete_function(*args).graph
    return sum(op.type == op_type for op in graph.get_operations())


def test_callers_bytes_per_pack_overrides_the_constructors():
    strategy, _ = strategy_for(transport="collective", bytes_per_pack=1 << 20)
    arrays = replica_arrays(tf.float32, shapes=[(64,)] * 6)
    values = distribute(strategy, arrays)

    def step_with(options):
        @tf.function
        def step(*values):
            def replica_fn(*values):
                context = tf.distribute.get_replica_context()
                return context.all_reduce("sum", [v * 1.0 for v in values], options)

            return strategy.run(replica_fn, args=values)

        return step

    # 6 tensors of 256 bytes: one pack by the constructor's bound, three
    # of two tensors by the caller's 512 bytes. One collective per replica
    # and pack.
    one_pack = count_ops(step_with(None), *values, op_type="CollectiveReduceV2")
    three = count_ops(step_with(Options(bytes_per_pack=512)), *values, op_type="CollectiveReduceV2")
    assert (one_pack, three) == (NUM_REPLICAS, 3 * NUM_REPLICAS)
    reduced = step_with(Options(bytes_per_pack=512))(*values)
    assert_results(reduced, reference(AggregationMethod.SUM, arrays), 1e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_tensor_of_32m_floats(transport):
    strategy, ops = strategy_for(transport=transport)
    size = 32 * 2**20

    def fn(context):
        with tf.device(DEVICES[context.replica_id_in_sync_group]):
            return tf.fill([size], float(context.replica_id_in_sync_group + 1))

    value = strategy.experimental_distribute_values_from_function(fn)
    (result,) = replica_aggregate.aggregate(strategy, "mean", [value])
    want = np.mean(np.arange(1, NUM_REPLICAS + 1))
    for tensor in result.values:
        got = tensor.numpy()
        assert got.shape == (size,)
        assert got.min() == got.max() == want


def test_strategies_with_collective_transports_do_not_collide():
    """Each AggregatingAllReduce draws its own collective group keys: two of
    them reduce values of different shapes in one process."""
    pairs = [strategy_for(transport="collective") for _ in range(2)]
    for round_ in range(2):
        for index, (strategy, ops) in enumerate(pairs):
            arrays = replica_arrays(tf.float32, shapes=[(index + 2, 3)], seed=round_)
            results = replica_aggregate.aggregate(strategy, "sum", distribute(strategy, arrays))
            assert_results(results, reference(AggregationMethod.SUM, arrays), 1e-6)


def test_eager_calls_do_not_retrace():
    """Eagerly every call of one kind runs one function, traced once."""
    strategy, ops = strategy_for(transport="collective", bytes_per_pack=4096 + 4)
    arrays = replica_arrays(tf.float32, shapes=[(4, 3), (5,)])
    group = transports.collective_group(DEVICES, NUM_REPLICAS, 0)
    before = set(group.eager_functions)
    for round_ in range(3):
        results = replica_aggregate.aggregate(strategy, "mean", distribute(strategy, arrays))
        assert_results(results, reference(AggregationMethod.MEAN, arrays), 1e-6)
    # An odd pack size: a kind of call no other test made.
    (key,) = set(group.eager_functions) - before
    assert group.eager_functions[key].experimental_get_tracing_count() == 1


def test_collective_keys_come_from_the_group_not_from_how_many_ops_exist():
    """Every worker derives the same group key for its part of a group
    (the task differs, the local devices do not); other groups differ."""
    def on_task(task, indices):
        return [f"/job:worker/replica:0/task:{task}/device:CPU:{i}" for i in indices]

    key = groups.group_key(on_task(0, [0, 1]), group_size=4)
    assert groups.group_key(on_task(1, [0, 1]), group_size=4) == key
    assert groups.group_key(on_task(0, [0, 1]), group_size=2) != key
    assert groups.group_key(on_task(0, [0]), group_size=4) != key
    # Building more ops objects changes nothing: they share the group.
    before = transports.collective_group(DEVICES, len(DEVICES), 0)
    for _ in range(3):
        AggregatingAllReduce(transport="collective")
    assert transports.collective_group(DEVICES, len(DEVICES), 0) is before


def threads():
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def test_collectives_wait_for_ever_by_default_and_hold_no_thread_per_call():
    """TensorFlow sleeps a thread through each timed collective's timeout:
    under a default of 600 s a job of days ran out of threads. Untimed
    collectives keep the thread count flat."""
    assert transports.DEFAULT_TIMEOUT_SECONDS is None
    assert AggregatingAllReduce().options.timeout_seconds is None

    def growth(timeout_seconds):
        strategy = tf_agn.strategies.mirrored(
            DEVICES, transport="collective", timeout_seconds=timeout_seconds
        )

        @tf.function
        def step():
            return strategy.run(
                lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.ones([4]))
            )

        step()
        before = threads()
        for _ in range(25):
            step()
        return threads() - before

    assert growth(None) < 10
    # The cost a timeout has (its threads end 5 s later).
    assert growth(5) >= 25


@pytest.mark.slow
def test_collective_timeout_turns_a_missing_peer_into_an_error():
    """A group of 2 workers whose second never comes: the caller's
    `timeout_seconds` ends the wait with DeadlineExceededError. A collective
    that timed out aborts the process's collectives, so it runs apart."""
    script = textwrap.dedent(
        """
        import time
        import tensorflow as tf
        import tf_agn
        devices = tf_agn.strategies.split_cpu(2)
        ops = tf_agn.AggregatingAllReduce(
            transport="collective", num_workers=2, worker_index=0)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        value = strategy.experimental_distribute_values_from_function(
            lambda context: tf.fill([3], 1.0))
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=2)

        @tf.function
        def step(x):
            return strategy.run(
                lambda x: tf.distribute.get_replica_context().all_reduce(
                    "sum", x * 1.0, options=options),
                args=(x,))

        start = time.monotonic()
        try:
            step(value)
        except tf.errors.DeadlineExceededError:
            print("deadline exceeded after", time.monotonic() - start)
        """
    )
    result = run_python("-c", script, timeout=120)
    lines = [l for l in result.stdout.splitlines() if l.startswith("deadline")]
    assert lines, result.stdout + result.stderr
    assert float(lines[0].split()[-1]) < 30


def test_auto_transport_is_local_on_logical_cpus_and_collective_across_workers():
    assert transports.choose_transport(DEVICES, num_workers=1) == "local"
    assert transports.choose_transport(DEVICES, num_workers=2) == "collective"
    assert transports.default_implementation(DEVICES).name == "RING"


def ring_traffic(num_replicas):
    """Pack volumes each device sends plus receives in an explicit ring
    all-reduce: reduce-scatter then all-gather, n - 1 steps each, every
    device passing one chunk of 1/n of the pack per step."""
    moved = [0.0] * num_replicas
    for _phase in ("reduce-scatter", "all-gather"):
        for _step in range(num_replicas - 1):
            for device in range(num_replicas):
                moved[device] += 1 / num_replicas  # sends a chunk
                moved[(device + 1) % num_replicas] += 1 / num_replicas  # receives it
    return moved


def star_traffic(num_replicas):
    """The local transport: every other device sends its pack to device 0
    and receives the result back."""
    moved = [0] * num_replicas
    for device in range(1, num_replicas):
        moved[0] += 2
        moved[device] += 2
    return moved


@pytest.mark.parametrize("num_replicas", [2, 3, 8, 64])
def test_traffic_matches_explicit_schedules(num_replicas):
    ring = ring_traffic(num_replicas)
    star = star_traffic(num_replicas)
    assert transports.traffic("collective", num_replicas) == pytest.approx(
        (max(ring), min(ring))
    )
    assert transports.traffic("local", num_replicas) == (max(star), min(star))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"transport": "nccl"}, "Unknown transport 'nccl'"),
        ({"implementation": "mpi"}, "Unknown implementation 'mpi'"),
        ({"timeout_seconds": -1}, "timeout_seconds must be None or >= 0"),
        ({"num_workers": 0}, "num_workers must be a positive int"),
        ({"num_workers": 2, "worker_index": 2}, "worker_index in range"),
        ({"num_workers": 2, "transport": "local"}, 'transport="local" cannot'),
    ],
)
def test_bad_transport_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AggregatingAllReduce(**kwargs)
