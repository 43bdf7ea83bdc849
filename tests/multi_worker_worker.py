"""One worker of the multi-process `MultiWorkerMirroredStrategy` tests.

tests/test_multi_worker.py starts two or three of these, each with its own
`TF_CONFIG` (task index i), on `tf_agn.strategies.multi_worker_mirrored()`. It is not a test module: it must not import
conftest, which splits the CPU into 4 logical devices; each worker keeps
its single CPU, so it runs exactly one replica.

Usage: python multi_worker_worker.py INPUTS.npz MODEL.keras OUT_DIR

INPUTS.npz holds the global data `x`, `y`, the global `batch_size`, the
`learning_rate` and the `methods` to train with; MODEL.keras is the test MLP
with its initial weights. For every method the worker loads the model in
the strategy's scope, compiles it with `tf_agn.optimizers.SGD`, fits one
epoch and records its own copy of the final weights. It writes
OUT_DIR/worker<i>.npz with:

    task_index, num_replicas_in_sync, num_local_replicas, replica_id:
        what the strategy says this worker is;
    uses_tf_agn_ops: whether the strategy has tf_agn's cross-device ops;
    rows: (steps, per_replica_batch) indices into `x` of the rows this
        worker's replica received, step by step, read through `strategy.run`
        from the same distributed dataset `fit` consumes;
    <method>/<i>: the i-th final weight array after training with <method>;
    accumulated/<i>, accumulated_calls: the same for MEAN with
        `gradient_accumulation_steps=ACCUMULATION_STEPS`, and its count of
        aggregations;
    aggregate/<compression>/<dtype>/<method>/<i>: this worker's replica's
        result of `AggregatingAllReduce.aggregate` on the arrays of
        `replica_arrays`, with every method, dtype and compression;
    sparse/<method>/values, sparse/<method>/indices: the same for the
        `tf.IndexedSlices` of `replica_slices`;
    exact/<fp16|bf16>/<eager|traced>/<reduce_sum|batch_reduce_mean>: the
        public `CrossDeviceOps.reduce` (what `strategy.reduce` calls across
        workers) and `batch_reduce` of ops that compress, on the values of
        `large_values`; they must stay exact;
    keras_fix/stock, keras_fix/ours: the error the stock strategy's
        `reduce` raises on the two calls Keras's `fit` makes, and ours
        ("" for none);
    steps_per_execution_3/<i>: MEAN's weights with three steps per call;
    contract/<eager|traced>/<name>/<copy>, many_packs/<eager|traced>/...:
        tests/contract.py's results on this worker;
    own_all_reduce/<sum|mean>/<dense|sparse>: `_all_reduce` of an ops
        object used on its own, outside the strategy's scope, on the
        arrays of `replica_arrays` (float32) and the slices of
        `replica_slices`, as TensorFlow's `CollectiveOpsTest` calls it;
    predict, evaluate: the untrained model's `predict` on 40 rows and its
        `evaluate` (loss, mae).

Worker 0 builds two more `AggregatingAllReduce` objects than the others
before its strategy, as a chief-only evaluation strategy would: collective
keys must not depend on that.

Sharding is explicit: through `distribute_datasets_from_function`, input
pipeline p yields, for every global batch, its p-th consecutive slice of
`batch_size / num_replicas_in_sync` rows, so replica p sees what
tests/reference.py's `sgd_trajectory` gives replica p.

Each worker logs its progress to stdout and, once every worker's results
are on disk, exits without TensorFlow's slow cluster shutdown.
"""

import json
import os
import sys
import time

START = time.monotonic()


def log(message):
    """Progress lines for the log the test shows when a worker fails."""
    print(f"[{time.monotonic() - START:6.1f} s] {message}", flush=True)


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn import _compat  # noqa: E402
from tf_agn.collectives.cross_device_ops import tf_agn_ops  # noqa: E402
from tf_agn.optimizers import saving  # noqa: E402
from multi_worker_data import COMPRESSION_STATE  # noqa: E402
from multi_worker_data import DTYPES  # noqa: E402
from multi_worker_data import SHAPES  # noqa: E402
from multi_worker_data import large_values  # noqa: E402
from multi_worker_data import distributed_dataset  # noqa: E402
from multi_worker_data import replica_arrays  # noqa: E402
from multi_worker_data import replica_slices  # noqa: E402
from multi_worker_data import stateful_compressors  # noqa: E402

from contract import aggregate_results  # noqa: E402
from contract import contract_results  # noqa: E402
import replica_aggregate  # noqa: E402
from worker_cluster import wait_for_files  # noqa: E402
from worker_cluster import write_results  # noqa: E402

TASK_INDEX = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if TASK_INDEX == 0:
    # Ops objects only worker 0 builds (as a chief-only evaluation strategy
    # would) must not shift the collective keys the workers share.
    EXTRA_OPS = [tf_agn.AggregatingAllReduce(), tf_agn.AggregatingAllReduce(transport="collective")]
# The strategy must exist before any other TensorFlow op runs.
log("TensorFlow imported")
STRATEGY = tf_agn.strategies.multi_worker_mirrored()
log("cluster up")

COMPRESSIONS = ["none", "fp16"]
ACCUMULATION_STEPS = 2


def rows_seen(strategy, dataset, x):
    """The replica id and the indices into `x` of the rows this worker's
    replica receives from `dataset`, step by step, through `strategy.run`
    as Keras' train step receives them."""

    def probe(inputs, _):
        context = tf.distribute.get_replica_context()
        return tf.convert_to_tensor(context.replica_id_in_sync_group), inputs

    replica_ids, steps = set(), []
    for batch in dataset:
        ids, inputs = strategy.run(probe, args=batch)
        ids = strategy.experimental_local_results(ids)
        inputs = strategy.experimental_local_results(inputs)
        if len(ids) != 1:
            raise RuntimeError(f"{len(ids)} local replicas; expected 1.")
        replica_ids.add(int(ids[0].numpy()))
        indices = []
        for row in inputs[0].numpy():
            (match,) = np.nonzero((x == row).all(axis=1))
            if len(match) != 1:
                raise RuntimeError(f"row {row} is not one row of x")
            indices.append(int(match[0]))
        steps.append(indices)
    if len(replica_ids) != 1:
        raise RuntimeError(f"replica ids changed between steps: {replica_ids}")
    return replica_ids.pop(), np.array(steps)


def main(inputs_path, model_path, out_dir):
    strategy = STRATEGY
    task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    inputs = np.load(inputs_path)
    x, y = inputs["x"], inputs["y"]
    batch_size = int(inputs["batch_size"])
    learning_rate = float(inputs["learning_rate"])
    methods = [str(m) for m in inputs["methods"]]

    dataset = distributed_dataset(strategy, x, y, batch_size)
    replica_id, rows = rows_seen(strategy, dataset, x)
    log(f"replica {replica_id} of {strategy.num_replicas_in_sync}, rows {rows.tolist()}")
    result = {
        "task_index": task_index,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "num_local_replicas": len(strategy.extended.worker_devices),
        "replica_id": replica_id,
        "rows": rows,
        "uses_tf_agn_ops": tf_agn_ops(strategy) is not None,
    }
    result.update(aggregate_method_results(strategy))
    result.update(exact_reduce_results(strategy))
    result.update(keras_fix_results(strategy, dataset))
    result.update(contract_checks(strategy))
    result.update(own_all_reduce_results(strategy))
    result.update(predict_and_evaluate(strategy, model_path, x, y, batch_size))
    def train(make_optimizer, key, steps_per_execution=1):
        """Fits the test MLP with `make_optimizer()`; records its weights."""
        with strategy.scope():
            model = keras.models.load_model(model_path, compile=False)
            model.compile(
                optimizer=make_optimizer(), loss="mse",
                steps_per_execution=steps_per_execution,
            )
        model.fit(dataset, epochs=1, verbose=0)
        log(f"trained: {key}")
        (weights,) = tf_agn.replica_weights(model)  # this worker's one copy
        for i, array in enumerate(weights):
            result[f"{key}/{i}"] = array
        return model

    for method in methods:
        train(lambda: tf_agn.optimizers.SGD(learning_rate, aggregation_method=method), method)
    # Several steps per call: collectives inside tf.while_loop and tf.cond.
    train(
        lambda: tf_agn.optimizers.SGD(learning_rate),
        "steps_per_execution_3",
        steps_per_execution=3,
    )
    # Gradient accumulation: each worker's replica sums 2 micro-steps and
    # the workers combine once per window.
    model = train(
        lambda: tf_agn.optimizers.SGD(
            learning_rate, gradient_accumulation_steps=ACCUMULATION_STEPS
        ),
        "accumulated",
    )
    result["accumulated_calls"] = model.optimizer.communication_stats()["all_reduce_calls"]
    # Keras's own optimizer all-reduces through the strategy's ops, in
    # replica context (`replica_context.all_reduce`).
    train(lambda: keras.optimizers.SGD(learning_rate), "keras_sgd")
    # Error feedback across workers: all-to-all, all-gather, all-reduce.
    for name in stateful_compressors():
        model = train(
            lambda: tf_agn.optimizers.SGD(learning_rate, compression=stateful_compressors()[name]),
            f"compressed/{name}",
        )
        state = [v for v in model.optimizer.variables if v.path.endswith(COMPRESSION_STATE)]
        for i, variable in enumerate(state):
            # This replica's own copy: a read across replicas is their sum or mean.
            (local,) = strategy.experimental_local_results(variable.value)
            result[f"compressed/{name}/state/{i}"] = local.numpy()

    # Sharded optimizer state: each worker's replica keeps its part of
    # Adam's moments.
    model = train(
        lambda: tf_agn.optimizers.Adam(learning_rate, shard_optimizer_state=True), "sharded"
    )
    for i, variable in enumerate(model.optimizer.variables):
        (local,) = strategy.experimental_local_results(variable.value)
        result[f"sharded/state/{i}"] = local.numpy()
    # What `model.save` writes, gathered from every worker's part.
    for i, value in enumerate(saving.saved_values(model.optimizer)):
        result[f"sharded/saved/{i}"] = value
    # Int8 on the sharded reduce-scatter: quantized rows, all-to-all.
    train(
        lambda: tf_agn.optimizers.Adam(
            learning_rate, shard_optimizer_state=True, compression="int8"
        ),
        "sharded_int8",
    )

    write_results(out_dir, task_index, result)
    log("wrote the results")
    num_workers = strategy.num_replicas_in_sync  # one replica each
    wait_for_files([os.path.join(out_dir, f"worker{i}.npz") for i in range(num_workers)])


def local_value(strategy, make):
    """A per-replica value holding `make(global_replica_id)`."""
    return strategy.experimental_distribute_values_from_function(
        lambda context: make(context.replica_id_in_sync_group)
    )


def contract_checks(strategy):
    """tests/contract.py's calls, eager and traced, and `aggregate` with
    many packs (through ops every worker builds alike, installed in the
    strategy for it)."""
    out = {}
    default = tf_agn_ops(strategy)
    many_packs = tf_agn.AggregatingAllReduce(
        transport="collective", bytes_per_pack=64,
        num_workers=default.num_workers, worker_index=default.worker_index,
    )
    for traced in (False, True):
        mode = "traced" if traced else "eager"
        results = {"contract": contract_results(strategy, traced)}
        _compat.replace_cross_device_ops(strategy.extended, many_packs)
        try:
            results["many_packs"] = aggregate_results(strategy, traced)
        finally:
            _compat.replace_cross_device_ops(strategy.extended, default)
        for prefix, named in results.items():
            for name, arrays in named.items():
                for copy, array in enumerate(arrays):
                    out[f"{prefix}/{mode}/{name}/{copy}"] = array
    log("contract checks done")
    return out


def own_all_reduce_results(strategy):
    """`_all_reduce` of ops used on their own: outside the strategy's
    scope, each worker reduces its one replica's values, on its CPU."""
    default = tf_agn_ops(strategy)
    ops = tf_agn.AggregatingAllReduce(
        transport="collective",
        num_workers=default.num_workers,
        worker_index=default.worker_index,
    )
    replica = default.worker_index  # one replica per worker
    array = replica_arrays(replica, "float32")[0]
    rows, indices = replica_slices(replica)

    @tf.function
    def all_reduce(reduce_op):
        with tf.device(strategy.extended.worker_devices[0]):
            dense = tf.constant(array)
            sparse = tf.IndexedSlices(
                tf.constant(rows), tf.constant(indices), tf.constant([6, 4])
            )
            return ops._all_reduce(reduce_op, (dense, sparse), 0, None)

    out = {}
    for reduce_op in ("sum", "mean"):
        dense, sparse = all_reduce(reduce_op)
        out[f"own_all_reduce/{reduce_op}/dense"] = dense.numpy()
        out[f"own_all_reduce/{reduce_op}/sparse"] = tf.convert_to_tensor(sparse).numpy()
    log("all-reduce checks of ops on their own done")
    return out


def predict_and_evaluate(strategy, model_path, x, y, batch_size):
    """The untrained model's `predict` and `evaluate` on the first 40 rows:
    a last batch smaller than the others, split unevenly for 3 workers."""
    with strategy.scope():
        model = keras.models.load_model(model_path, compile=False)
        model.compile(loss="mse", metrics=["mae"])
    rows = 40
    predictions = model.predict(x[:rows], batch_size=batch_size, verbose=0)
    loss, mae = model.evaluate(x[:rows], y[:rows], batch_size=batch_size, verbose=0)
    log("predict and evaluate done")
    return {"predict": predictions, "evaluate": np.array([loss, mae])}


def aggregate_method_results(strategy):
    """Every method, dtype and compression through the strategy's ops, and
    a second ops object with fp16 compression (built in the same order on
    every worker, so its collective keys agree)."""
    default = tf_agn_ops(strategy)
    ops = {
        "none": default,
        "fp16": tf_agn.AggregatingAllReduce(
            transport="collective",
            compression="fp16",
            num_workers=default.num_workers,
            worker_index=default.worker_index,
        ),
    }
    out = {}
    for compression in COMPRESSIONS:
        for dtype_name in DTYPES:
            if compression != "none" and dtype_name != "float32":
                continue
            values = [
                local_value(
                    strategy, lambda r, i=i: tf.constant(replica_arrays(r, dtype_name)[i])
                )
                for i in range(len(SHAPES))
            ]
            for method in tf_agn.AggregationMethod.names():
                results = replica_aggregate.aggregate(
                    strategy, method, values, value_scale=0.5,
                    compressor=ops[compression].default_compressor,
                )
                for i, value in enumerate(results):
                    (local,) = strategy.experimental_local_results(value)
                    key = f"aggregate/{compression}/{dtype_name}/{method}/{i}"
                    out[key] = tf.cast(local, tf.float64).numpy()
    for method in ("sum", "mean", "only_first_replica"):

        def make(replica):
            rows, indices = replica_slices(replica)
            return tf.IndexedSlices(
                tf.constant(rows), tf.constant(indices), tf.constant([6, 4])
            )

        (value,) = replica_aggregate.aggregate(strategy, method, [local_value(strategy, make)])
        (local,) = strategy.experimental_local_results(value)
        out[f"sparse/{method}/values"] = local.values.numpy()
        out[f"sparse/{method}/indices"] = local.indices.numpy()
    log("aggregate checks done")
    return out


def exact_reduce_results(strategy):
    """TensorFlow's entry points of ops that compress with "fp16" and
    "bf16" (built alike on every worker), eager and traced, on values
    neither dtype holds: compression is for `aggregate` alone."""
    default = tf_agn_ops(strategy)
    value = local_value(strategy, lambda r: tf.constant(large_values(r)))
    out = {}
    for name in ("fp16", "bf16"):
        ops = tf_agn.AggregatingAllReduce(
            transport="collective",
            compression=name,
            num_workers=default.num_workers,
            worker_index=default.worker_index,
        )

        def run(ops=ops):
            sum_op, mean_op = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
            return {
                "reduce_sum": ops.reduce(sum_op, value, value),
                "batch_reduce_mean": ops.batch_reduce(mean_op, [(value, value)])[0],
            }

        for traced in (False, True):
            mode = "traced" if traced else "eager"
            results = tf.function(run, autograph=False)() if traced else run()
            for call, result in results.items():
                (local,) = strategy.experimental_local_results(result)
                out[f"exact/{name}/{mode}/{call}"] = local.numpy()
    log("exact reduce checks done")
    return out


def keras_fix_results(strategy, dataset):
    """The two reductions Keras's `fit` makes, through the stock
    `MultiWorkerMirroredStrategy.reduce` and through ours."""
    batch = next(iter(dataset))
    loss = strategy.run(lambda x, y: tf.reduce_mean(x), args=batch)
    # Integer labels, as the batch of the first call holds in the example:
    # replica r holds r + 1, so their MEAN is (n + 1) / 2, not an integer.
    labels = strategy.run(
        lambda: tf.distribute.get_replica_context().replica_id_in_sync_group + 1
    )
    calls = [
        lambda reduce: reduce("MEAN", batch, axis=None),
        lambda reduce: reduce("MEAN", loss, axis=0),
        lambda reduce: reduce("MEAN", labels, axis=None),
    ]
    stock = lambda *a, **k: tf.distribute.MultiWorkerMirroredStrategy.reduce(  # noqa: E731
        strategy, *a, **k
    )
    out = {}
    for name, reduce in (("stock", stock), ("ours", strategy.reduce)):
        errors = []
        for call in calls:
            try:
                result = call(reduce)
                errors.append("")
            except Exception as error:  # noqa: BLE001 - recorded for the test
                errors.append(f"{type(error).__name__}: {error}"[:300])
        out[f"keras_fix/{name}"] = np.array(errors)
    out["keras_fix/integer_mean"] = np.asarray(result)  # ours, the last call
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
    # Results are on disk and every peer is done with this one. Shutting the
    # gRPC server and collective executor down at exit takes seconds: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
