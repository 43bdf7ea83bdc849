"""tf_agn's aggregating optimizers and ops under a real
`tf_agn.strategies.multi_worker_mirrored()`: two or three processes on
localhost, one CPU replica each, so gradients travel through
`AggregatingAllReduce`'s collective transport between processes.

The workers (tests/multi_worker_worker.py) train the test MLP of
test_optimizers.py once per aggregation method with `model.fit`, run every
method, dtype and compression through the ops, check that ops which
compress still reduce exactly through TensorFlow's entry points, and try the two reductions
Keras's `fit` makes, in a single cluster start; the checks below compare
what each wrote with numpy references. They also run the whole
`CrossDeviceOps` contract (tests/contract.py), `_all_reduce` of ops used
on their own, `predict`, `evaluate` and `steps_per_execution=3`, with
worker 0 having built two more ops objects than the others.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from contract import contract_results
from contract import reference_methods
from multi_worker_data import COMPRESSION_STATE
from multi_worker_data import large_values
from multi_worker_data import replica_arrays
from multi_worker_data import replica_slices
from multi_worker_data import stateful_compressors
from reference import sgd_trajectory
from mlp import LEARNING_RATE
from mlp import METHODS
from mlp import build_mlp
from mlp import data
from mlp import initial_params
from worker_cluster import run_workers

ROWS_STEPS = 3  # data(3): 48 rows
# Global batch per cluster size: 3 steps of 16 rows, or 2 of 24.
BATCH = {2: 16, 3: 24}
TIMEOUT_S = 240
WORKER_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "multi_worker_worker.py"
)
# As test_optimizers.py's assert_replicas_close. The workers match the
# reference to ~1e-7; a 2x-off gradient or another replica's shard moves
# these weights by more than 0.1 in 3 steps (_assert_matches checks that
# such wrong references fall outside the tolerance).
RTOL, ATOL = 1e-4, 1e-5
# The collective sums float16 and bfloat16 (and fp16-compressed float32)
# in that dtype, one rounding per ring step.
AGGREGATE_RTOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-6}
COMPRESSED_RTOL = 4e-3


def _run_cluster(workdir, num_workers):
    """Runs every worker to completion and returns their results."""
    x, y = data(ROWS_STEPS)
    inputs = str(workdir / "inputs.npz")
    np.savez(
        inputs, x=x, y=y, batch_size=BATCH[num_workers], learning_rate=LEARNING_RATE,
        methods=np.array(METHODS),
    )
    model = str(workdir / "mlp.keras")
    build_mlp(initial_params()).save(model)
    return run_workers(WORKER_SCRIPT, [inputs, model], workdir, num_workers, TIMEOUT_S)


# The 3-worker cluster runs with the slow tests (in CI, not in the README's
# quick command).
@pytest.fixture(
    scope="module",
    params=[2, pytest.param(3, marks=pytest.mark.slow)],
    ids=lambda n: f"{n}_workers",
)
def cluster(request, tmp_path_factory):
    """(num_workers, every worker's results)."""
    num_workers = request.param
    workdir = tmp_path_factory.mktemp(f"multi_worker_{num_workers}")
    return num_workers, _run_cluster(workdir, num_workers)


def _weights(result, method):
    count = len(initial_params())
    return [result[f"{method}/{i}"] for i in range(count)]


def _close(got, want):
    return all(
        np.allclose(g, w, rtol=RTOL, atol=ATOL) for g, w in zip(got, want, strict=True)
    )


def _assert_matches(got, want, wrong, message):
    """`got` matches `want`, and the tolerance is tight enough that none of
    the `wrong` references (other scale, other replica) would have."""
    for name, alternative in wrong.items():
        assert not _close(alternative, want), f"{message}: {name} is indistinguishable"
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(
            g, w, rtol=RTOL, atol=ATOL, err_msg=f"{message}, weight {index}"
        )


def _rotate_replica_shards(x, num_workers, batch):
    """`x` with the shards of every global batch rotated by one, so that
    replica r of the reference sees what replica r + 1 saw."""
    shards = x.reshape(-1, num_workers, batch // num_workers, *x.shape[1:])
    return np.roll(shards, -1, axis=1).reshape(x.shape)


def _shard_rows(index, num_workers):
    batch = BATCH[num_workers]
    half = batch // num_workers
    steps = len(data(ROWS_STEPS)[0]) // batch
    return np.arange(steps)[:, None] * batch + index * half + np.arange(half)


def test_each_worker_is_one_replica_fed_its_own_shard(cluster):
    num_workers, workers = cluster
    for index, result in enumerate(workers):
        assert int(result["task_index"]) == index
        assert int(result["num_replicas_in_sync"]) == num_workers
        assert int(result["num_local_replicas"]) == 1
        assert int(result["replica_id"]) == index
        assert result["uses_tf_agn_ops"]
        np.testing.assert_array_equal(result["rows"], _shard_rows(index, num_workers))


@pytest.mark.parametrize("method", METHODS)
def test_fit_weights_match_numpy_reference(cluster, method):
    num_workers, workers = cluster
    batch = BATCH[num_workers]
    x, y = data(ROWS_STEPS)

    def reference(x, y, learning_rate=LEARNING_RATE):
        return sgd_trajectory(
            initial_params(), x, y, method, num_workers, batch, learning_rate
        )

    want = reference(x, y)
    doubled = reference(x, y, 2 * LEARNING_RATE)
    halved = reference(x, y, LEARNING_RATE / 2)
    # Each replica's shard in another's place.
    rotated = reference(
        _rotate_replica_shards(x, num_workers, batch),
        _rotate_replica_shards(y, num_workers, batch),
    )
    for index, result in enumerate(workers):
        wrong = {"2x scale": doubled[index], "0.5x scale": halved[index]}
        if method in ("only_first_replica", "none"):
            wrong["another replica"] = rotated[index]
        _assert_matches(
            _weights(result, method), want[index], wrong,
            f"{method}, worker {index}",
        )


def test_keras_optimizer_fit_averages_across_workers(cluster):
    """Keras's own SGD under our strategy trains on the mean gradient of
    all workers. With one replica per worker, TensorFlow's CrossDeviceOps
    skip the reduction unless the ops report several workers: each worker
    then trains alone on its shard."""
    num_workers, workers = cluster
    x, y = data(ROWS_STEPS)
    want = sgd_trajectory(
        initial_params(), x, y, "mean", num_workers, BATCH[num_workers], LEARNING_RATE
    )
    alone = sgd_trajectory(
        initial_params(), x, y, "none", num_workers, BATCH[num_workers], LEARNING_RATE
    )
    for index, result in enumerate(workers):
        _assert_matches(
            _weights(result, "keras_sgd"), want[index],
            {"each worker alone": alone[index]},
            f"keras.optimizers.SGD, worker {index}",
        )


def test_none_trains_each_worker_on_its_own_shard_alone(cluster):
    num_workers, workers = cluster
    x, y = data(ROWS_STEPS)
    finals = []
    for index, result in enumerate(workers):
        rows = _shard_rows(index, num_workers).reshape(-1)
        (alone,) = sgd_trajectory(
            initial_params(), x[rows], y[rows], "none", 1,
            BATCH[num_workers] // num_workers, LEARNING_RATE,
        )
        got = _weights(result, "none")
        for i, (g, w) in enumerate(zip(got, alone, strict=True)):
            np.testing.assert_allclose(
                g, w, rtol=RTOL, atol=ATOL, err_msg=f"worker {index}, weight {i}"
            )
        finals.append(got)
    assert not _close(finals[0], finals[1]), "NONE: the workers did not drift apart"


@pytest.mark.parametrize("method", ["sum", "mean", "only_first_replica"])
def test_synchronized_methods_keep_workers_equal(cluster, method):
    _, workers = cluster
    first = _weights(workers[0], method)
    for other in workers[1:]:
        for i, (a, b) in enumerate(zip(first, _weights(other, method), strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"weight {i}")


@pytest.mark.parametrize(
    "compression, dtype_name",
    [("none", "float16"), ("none", "bfloat16"), ("none", "float32"), ("fp16", "float32")],
)
@pytest.mark.parametrize("method", tf_agn.AggregationMethod.names())
def test_aggregate_matches_numpy_across_workers(cluster, method, dtype_name, compression):
    num_workers, workers = cluster
    arrays = [
        [a.astype(np.float64) for a in replica_arrays(r, dtype_name)]
        for r in range(num_workers)
    ]
    rtol = COMPRESSED_RTOL if compression == "fp16" else AGGREGATE_RTOL[dtype_name]
    for replica, result in enumerate(workers):
        for i in range(len(arrays[0])):
            column = [0.5 * a[i] for a in arrays]
            want = {
                "sum": sum(column),
                "mean": sum(column) / num_workers,
                "only_first_replica": column[0],
                "none": column[replica],
            }[method]
            got = result[f"aggregate/{compression}/{dtype_name}/{method}/{i}"]
            np.testing.assert_allclose(
                got, want, rtol=rtol, err_msg=f"replica {replica}, value {i}"
            )


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_reduce_of_compressing_ops_stays_exact_across_workers(cluster, compression):
    """`strategy.reduce` and Keras's metric logs reach the ops through
    `reduce` and `batch_reduce`: values past float16's range and integers
    it (or bfloat16) cannot hold must come back exact."""
    num_workers, workers = cluster
    total = np.sum([large_values(r).astype(np.float64) for r in range(num_workers)], 0)
    want = {"reduce_sum": total, "batch_reduce_mean": total / num_workers}
    for replica, result in enumerate(workers):
        for mode in ("eager", "traced"):
            for call, value in want.items():
                # A MEAN over 3 is rounded; compression would be off by
                # 5e-4 (2049 in float16) or more.
                np.testing.assert_allclose(
                    result[f"exact/{compression}/{mode}/{call}"],
                    value,
                    rtol=1e-6,
                    err_msg=f"replica {replica}, {mode} {call}",
                )


@pytest.mark.parametrize("method", ["sum", "mean", "only_first_replica"])
def test_sparse_values_are_gathered_across_workers(cluster, method):
    num_workers, workers = cluster
    dense = []
    for replica in range(num_workers):
        rows, indices = replica_slices(replica)
        table = np.zeros((6, 4))
        np.add.at(table, indices, rows)
        dense.append(table)
    want = {
        "sum": sum(dense),
        "mean": sum(dense) / num_workers,
        "only_first_replica": dense[0],
    }[method]
    for replica, result in enumerate(workers):
        got = np.zeros((6, 4))
        np.add.at(got, result[f"sparse/{method}/indices"], result[f"sparse/{method}/values"])
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"replica {replica}")


@pytest.mark.parametrize("reduce_op", ["sum", "mean"])
def test_all_reduce_of_ops_on_their_own_across_workers(cluster, reduce_op):
    """TensorFlow's `CollectiveOpsTest` calls `_all_reduce` on ops made
    without a strategy, outside any strategy's scope."""
    num_workers, workers = cluster
    dense = [replica_arrays(r, "float32")[0].astype(np.float64) for r in range(num_workers)]
    tables = []
    for replica in range(num_workers):
        rows, indices = replica_slices(replica)
        tables.append(np.zeros((6, 4)))
        np.add.at(tables[-1], indices, rows)
    scale = 1 / num_workers if reduce_op == "mean" else 1
    for replica, result in enumerate(workers):
        message = f"replica {replica}"
        key = f"own_all_reduce/{reduce_op}"
        np.testing.assert_allclose(
            result[f"{key}/dense"], scale * sum(dense), rtol=1e-6, err_msg=message
        )
        np.testing.assert_allclose(
            result[f"{key}/sparse"], scale * sum(tables), rtol=1e-6, err_msg=message
        )


def test_keras_fit_reductions_fail_stock_and_work_with_ours(cluster):
    """The library's fix is needed: the stock strategy's `reduce` fails on
    both calls Keras's `fit` makes. If a TensorFlow release fixes them,
    this fails and tells us the fix can go."""
    _, workers = cluster
    for result in workers:
        stock, ours = result["keras_fix/stock"], result["keras_fix/ours"]
        assert list(ours) == ["", "", ""], ours
        assert "PerReplica" in stock[0], stock
        assert "Invalid reduction dimension" in stock[1], stock
        num_replicas = len(workers)
        assert result["keras_fix/integer_mean"] == pytest.approx((num_replicas + 1) / 2)


def test_gradient_accumulation_combines_once_per_window_across_workers(cluster):
    num_workers, workers = cluster
    batch = BATCH[num_workers]
    x, y = data(ROWS_STEPS)
    window = 2 * batch  # a trailing micro-step stays in the accumulators
    want = sgd_trajectory(
        initial_params(), x[:window], y[:window], "mean", num_workers, batch,
        LEARNING_RATE, accumulation_steps=2,
    )
    every_step = sgd_trajectory(
        initial_params(), x[:window], y[:window], "mean", num_workers, batch,
        LEARNING_RATE,
    )
    for index, result in enumerate(workers):
        _assert_matches(
            [result[f"accumulated/{i}"] for i in range(len(initial_params()))],
            want[index], {"no accumulation": every_step[index]},
            f"accumulation, worker {index}",
        )
        assert int(result["accumulated_calls"]) == 1


def _copies(result, prefix):
    """`{name: [array per copy]}` of the results stored under `prefix/`."""
    found = {}
    for key in result:
        if key.startswith(prefix + "/"):
            name, copy = key[len(prefix) + 1 :].rsplit("/", 1)
            found.setdefault(name, {})[int(copy)] = result[key]
    return {name: [c[i] for i in sorted(c)] for name, c in found.items()}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_contract_matches_one_process_reduction_to_one_device(cluster, traced):
    """Every CrossDeviceOps entry point across workers gives what
    TensorFlow's ReductionToOneDevice gives one process with as many
    replicas: reduce, reduce_to and batch_reduce_to with mixed
    destinations, broadcast, gather of ragged rows on two axes, a replica
    context's all_gather, IndexedSlices, integers and float16."""
    num_workers, workers = cluster
    mode = "traced" if traced else "eager"
    reference = contract_results(
        tf.distribute.MirroredStrategy(
            DEVICES[:num_workers], cross_device_ops=tf.distribute.ReductionToOneDevice()
        ),
        traced,
    )
    for index, result in enumerate(workers):
        got = _copies(result, f"contract/{mode}")
        assert sorted(got) == sorted(reference)
        for name, copies in reference.items():
            want = copies[index] if len(copies) > 1 else copies[0]
            (mine,) = got[name]  # one replica per worker
            rtol = 2e-3 if "half" in name or name == "batch_1_host" else 1e-6
            np.testing.assert_allclose(
                mine, want, rtol=rtol, err_msg=f"{name}, worker {index}"
            )
        # Each worker's gather holds every worker's rows: 1 + 2 (+ 3).
        assert got["gather_rows"][0].shape[0] == num_workers * (num_workers + 1) // 2


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_many_packs_with_sparse_values_and_every_method(cluster, traced):
    num_workers, workers = cluster
    mode = "traced" if traced else "eager"
    for index, result in enumerate(workers):
        got = _copies(result, f"many_packs/{mode}")
        for name, want in reference_methods(num_workers, index).items():
            (mine,) = got[name]
            np.testing.assert_allclose(mine, want, rtol=1e-6, err_msg=f"{name}, worker {index}")


def test_predict_returns_every_row_in_order(cluster):
    num_workers, workers = cluster
    x, _ = data(ROWS_STEPS)
    want = build_mlp(initial_params())(x[:40]).numpy()
    w1, b1, w2, b2 = initial_params()
    np.testing.assert_allclose(want, np.tanh(x[:40] @ w1 + b1) @ w2 + b2, rtol=1e-5)
    for index, result in enumerate(workers):
        np.testing.assert_allclose(
            result["predict"], want, rtol=1e-6, atol=1e-7, err_msg=f"worker {index}"
        )


def test_evaluate_equals_one_process(cluster):
    num_workers, workers = cluster
    x, y = data(ROWS_STEPS)
    model = build_mlp(initial_params())
    model.compile(loss="mse", metrics=["mae"])
    want = model.evaluate(x[:40], y[:40], batch_size=BATCH[num_workers], verbose=0)
    for index, result in enumerate(workers):
        np.testing.assert_allclose(
            result["evaluate"], want, rtol=1e-6, err_msg=f"worker {index}"
        )


def test_steps_per_execution_3_matches_one_step_per_call(cluster):
    """Three steps per call run their collectives inside Keras's
    tf.while_loop and tf.cond; the weights equal one step per call's."""
    _, workers = cluster
    for index, result in enumerate(workers):
        _assert_matches(
            _weights(result, "steps_per_execution_3"), _weights(result, "mean"),
            {"initial weights": initial_params()},
            f"steps_per_execution=3, worker {index}",
        )


def test_sharded_state_across_workers_equals_unsharded_in_one_process(cluster):
    """Workers whose Adam shards its state (a reduce-scatter and an
    all-gather across processes; these variables' sizes do not all divide
    by 3) end where unsharded Adam in one process ends, and their parts of
    the moments, joined, are its moments, as each worker saves them."""
    num_workers, workers = cluster
    strategy = tf_agn.strategies.mirrored(devices=DEVICES[:num_workers], transport="local")
    x, y = data(ROWS_STEPS)
    with strategy.scope():
        model = build_mlp(initial_params())
        model.compile(tf_agn.optimizers.Adam(LEARNING_RATE), "mse")
    model.fit(x, y, batch_size=BATCH[num_workers], epochs=1, shuffle=False, verbose=0)
    for result in workers:
        weights = [result[f"sharded/{i}"] for i in range(len(initial_params()))]
        for got, want in zip(weights, model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for i, variable in enumerate(model.optimizer.variables):
        want = variable.numpy()
        parts = [result[f"sharded/state/{i}"] for result in workers]
        got = parts[0] if parts[0].shape == want.shape else (
            np.concatenate(parts)[: want.size].reshape(want.shape)
        )
        if parts[0].shape != want.shape:
            assert parts[0].size == -(-want.size // num_workers), variable.path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=variable.path)
        # Saved whole, on every worker, as the unsharded optimizer saves it.
        for result in workers:
            saved = result[f"sharded/saved/{i}"]
            assert saved.shape == want.shape, variable.path
            np.testing.assert_allclose(saved, want, rtol=1e-5, atol=1e-7, err_msg=variable.path)
    # Int8 rows quantized alike in both: the workers end where one process
    # of as many replicas ends.
    with strategy.scope():
        model = build_mlp(initial_params())
        model.compile(
            tf_agn.optimizers.Adam(LEARNING_RATE, shard_optimizer_state=True, compression="int8"),
            "mse",
        )
    model.fit(x, y, batch_size=BATCH[num_workers], epochs=1, shuffle=False, verbose=0)
    for result in workers:
        weights = [result[f"sharded_int8/{i}"] for i in range(len(initial_params()))]
        for got, want in zip(weights, model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "powersgd"])
def test_compressed_fit_across_workers_equals_one_process(cluster, name):
    """Workers training with int8 or PowerSGD (TensorFlow's all-to-all,
    all-gather and all-reduce across processes) end where one process with
    as many replicas ends (the same arithmetic, copied within a process),
    with the same residual (and Q) on each worker as on its replica."""
    num_workers, workers = cluster
    strategy = tf_agn.strategies.mirrored(devices=DEVICES[:num_workers], transport="local")
    x, y = data(ROWS_STEPS)
    with strategy.scope():
        model = build_mlp(initial_params())
        model.compile(
            tf_agn.optimizers.SGD(LEARNING_RATE, compression=stateful_compressors()[name]),
            "mse",
        )
    model.fit(x, y, batch_size=BATCH[num_workers], epochs=1, shuffle=False, verbose=0)
    state = [v for v in model.optimizer.variables if v.path.endswith(COMPRESSION_STATE)]
    assert state
    plain = sgd_trajectory(initial_params(), x, y, "mean", num_workers, BATCH[num_workers], LEARNING_RATE)
    for index, result in enumerate(workers):
        weights = [result[f"compressed/{name}/{i}"] for i in range(len(initial_params()))]
        for got, want in zip(weights, model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # Compression changed the path: not the uncompressed one.
        assert not _close(weights, plain[index])
        for i, variable in enumerate(state):
            copy = strategy.experimental_local_results(variable.value)[index].numpy()
            np.testing.assert_allclose(
                result[f"compressed/{name}/state/{i}"], copy, rtol=1e-5, atol=1e-6
            )
