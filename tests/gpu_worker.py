"""Checks and times AggregatingAllReduce on this machine's GPUs.

Not a test module: tests/test_gpu.py runs it in a fresh process, since
GPUs can only be split into logical devices before TensorFlow starts (and
conftest starts it on split CPUs). It prints one JSON object on its last
line: {"gpus": n, "rows": [...]} with a row per check and per timing.

With one physical GPU it splits it into two logical GPUs: that checks the
XLA-compiled packing and compression on GPU, placement and the local
transport; NCCL refuses two ranks on one device, so "collective" is only
checked with two or more physical GPUs.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from contract import aggregate_results  # noqa: E402
from contract import contract_results  # noqa: E402
from contract import reference_methods  # noqa: E402
from error_feedback_reference import one_step_errors  # noqa: E402
import placed_values  # noqa: E402
import replica_aggregate  # noqa: E402
from compression_model import build  # noqa: E402
from compression_model import data  # noqa: E402
from tf_agn import _compat  # noqa: E402

SHAPES = [(1024, 512)] * 24 + [(512,)] * 24  # about 12.6 M floats
REPEATS = 20


def devices():
    physical = tf.config.list_physical_devices("GPU")
    if len(physical) == 1:
        tf.config.set_logical_device_configuration(
            physical[0], [tf.config.LogicalDeviceConfiguration(memory_limit=8192)] * 2
        )
    return [d.name for d in tf.config.list_logical_devices("GPU")], len(physical)


def per_replica(strategy, names, arrays):
    """One `PerReplica` value per position in each replica's `arrays`."""
    return [
        placed_values.per_replica(strategy, names, [a[i] for a in arrays])
        for i in range(len(arrays[0]))
    ]


def check(names, transport, compression):
    ops = tf_agn.AggregatingAllReduce(transport=transport, compression=compression)
    strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)
    rng = np.random.default_rng(0)
    arrays = [
        [rng.uniform(0.5, 1.5, size=s).astype(np.float32) * (r + 1) for s in SHAPES[::8]]
        for r in range(len(names))
    ]
    values = per_replica(strategy, names, arrays)
    rows = []
    for method in ("sum", "mean", "only_first_replica", "none"):
        results = replica_aggregate.aggregate(strategy, method, values, compressor=ops.default_compressor)
        error, placed = 0.0, True
        for i, value in enumerate(results):
            column = [a[i].astype(np.float64) for a in arrays]
            for r, tensor in enumerate(value.values):
                want = {
                    "sum": sum(column), "mean": sum(column) / len(names),
                    "only_first_replica": column[0], "none": column[r],
                }[method]
                got = tensor.numpy().astype(np.float64)
                error = max(error, float(np.max(np.abs(got - want) / np.abs(want))))
                placed &= tensor.device.endswith(names[r].split("/device:")[-1])
        rows.append({
            "kind": "check", "transport": transport, "compression": str(compression),
            "method": method, "max_rel_error": error, "placed": bool(placed),
        })
    return rows


def error_feedback_check(names, transport):
    """int8 and PowerSGD, compiled for the GPUs, against the numpy
    references (tests/error_feedback_reference.py)."""
    ops = tf_agn.AggregatingAllReduce(transport=transport)
    strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)
    errors = one_step_errors(ops, strategy, names)
    return {"kind": "error_feedback", "transport": transport, **errors}


def max_rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-6)))


def ordered_checks(names, transport):
    """Ordered collectives: the whole CrossDeviceOps contract against
    ReductionToOneDevice, and one `aggregate` of many packs with dense and
    sparse values for every method, eager and traced; then `fit` with
    three steps per call against one step per call."""
    ours = tf_agn.strategies.mirrored(names, transport=transport)
    stock = tf.distribute.MirroredStrategy(
        names, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    many_packs = tf_agn.strategies.mirrored(names, transport=transport, bytes_per_pack=64)
    rows = []
    for traced in (False, True):
        mode = "traced" if traced else "eager"
        got, want = contract_results(ours, traced), contract_results(stock, traced)
        error = max(
            max_rel_error(g, w) for name in want for g, w in zip(got[name], want[name])
        )
        # float16 values are summed in another order than by
        # ReductionToOneDevice: one rounding per addition.
        rows.append({"kind": "check", "transport": transport, "compression": "None",
                     "method": f"contract/{mode}", "max_rel_error": error, "placed": True,
                     "rtol": 2e-3})
        got = aggregate_results(many_packs, traced)
        error = max(
            max_rel_error(array, reference_methods(len(names), replica)[name])
            for name in got for replica, array in enumerate(got[name])
        )
        rows.append({"kind": "check", "transport": transport, "compression": "None",
                     "method": f"many_packs/{mode}", "max_rel_error": error, "placed": True})
    rng = np.random.default_rng(2)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    weights = {}
    for steps in (1, 3):
        keras.utils.set_random_seed(0)
        with ours.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
            model.compile(optimizer=tf_agn.optimizers.SGD(0.05), loss="mse",
                          steps_per_execution=steps)
        model.fit(x, y, batch_size=16 * len(names), epochs=2, shuffle=False, verbose=0)
        weights[steps] = model.get_weights()
    error = max(max_rel_error(a, b) for a, b in zip(weights[3], weights[1]))
    rows.append({"kind": "check", "transport": transport, "compression": "None",
                 "method": "steps_per_execution_3", "max_rel_error": error, "placed": True})
    return rows


def any_strategy_checks(names):
    """Training under the stock MirroredStrategy (NCCL on GPUs), where
    tf_agn's optimizers compress through the replica context's all-reduce
    and all-gather, against tf_agn's local transport: the relative
    difference of w_T - w_0 after 10 steps, per compression."""
    stock = tf.distribute.MirroredStrategy(names)
    ours = tf_agn.strategies.mirrored(names, transport="local")
    x, y = data(rows=10 * 16 * len(names))
    rows = []
    for name in ("fp16", "bf16", "int8", "powersgd"):
        compression = tf_agn.compression.PowerSGD(rank=2) if name == "powersgd" else name
        changes = []
        for strategy in (stock, ours):
            model = build(strategy, lambda: tf_agn.optimizers.SGD(0.1, compression=compression))
            before = model.get_weights()
            model.fit(x, y, batch_size=16 * len(names), epochs=1, verbose=0, shuffle=False)
            changes.append(np.concatenate(
                [(a - b).ravel() for a, b in zip(model.get_weights(), before)]
            ))
        error = float(np.linalg.norm(changes[0] - changes[1]) / np.linalg.norm(changes[1]))
        rows.append({"kind": "any_strategy", "compression": name, "relative_difference": error})
    return rows


def sharding_checks(names, transport):
    """Sharded Adam (reduce-scatter and all-gather, NCCL's on GPUs with the
    collective transport) against unsharded Adam: the relative difference
    of w_T - w_0 after 10 steps, uncompressed and with int8."""
    strategy = tf_agn.strategies.mirrored(names, transport=transport)
    x, y = data(rows=10 * 16 * len(names))
    rows = []
    for compression in (None, "int8"):
        changes = []
        for shard in (True, False):
            model = build(strategy, lambda: tf_agn.optimizers.Adam(
                1e-2, compression=compression if shard else None, shard_optimizer_state=shard,
            ))
            before = model.get_weights()
            model.fit(x, y, batch_size=16 * len(names), epochs=1, verbose=0, shuffle=False)
            changes.append(np.concatenate(
                [(a - b).ravel() for a, b in zip(model.get_weights(), before)]
            ))
        error = float(np.linalg.norm(changes[0] - changes[1]) / np.linalg.norm(changes[1]))
        rows.append({"kind": "sharding", "transport": transport,
                     "compression": str(compression), "relative_difference": error})
    return rows


def reduce_scatter_check(names):
    """The collective transport's reduce-scatter (NCCL's own op on GPUs):
    every replica's part of the sum, against numpy."""
    strategy = tf_agn.strategies.mirrored(names, transport="collective")
    ops = _compat.cross_device_ops(strategy.extended)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((len(names), 1000)).astype(np.float32) for _ in names]
    (value,) = per_replica(strategy, names, [[a] for a in arrays])
    transport = ops.transport_for(value)
    parts = transport.eager(("reduce_scatter",), transport.reduce_scatter)(list(value.values))
    want = sum(arrays)
    error = max(max_rel_error(part.numpy(), want[r]) for r, part in enumerate(parts))
    return {"kind": "reduce_scatter", "max_rel_error": error}


def timed(names, name, cross_device_ops):
    strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=cross_device_ops)
    rng = np.random.default_rng(1)
    arrays = [[rng.standard_normal(s, dtype=np.float32) for s in SHAPES] for _ in names]
    values = per_replica(strategy, names, arrays)

    @tf.function
    def step():
        def replica_fn(*xs):
            reduced = tf.distribute.get_replica_context().all_reduce(
                "sum", [x * 1.0 for x in xs]
            )
            return tf.add_n([tf.reshape(r, [-1])[0] for r in reduced])

        out = strategy.run(replica_fn, args=tuple(values))
        return tf.add_n(strategy.experimental_local_results(out))

    step().numpy()
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        step().numpy()
        seconds.append(time.perf_counter() - start)
    return {"kind": "time", "candidate": name, "median_ms": 1e3 * float(np.median(seconds))}


def main():
    names, num_physical = devices()
    if not names:
        print(json.dumps({"gpus": 0, "rows": []}))
        return
    transports = ["local"] + (["collective"] if num_physical >= 2 else [])
    rows = []
    for transport in transports:
        for compression in (None, "fp16"):
            rows += check(names, transport, compression)
        rows.append(error_feedback_check(names, transport))
        rows += ordered_checks(names, transport)
        rows += sharding_checks(names, transport)
    rows += any_strategy_checks(names)
    if num_physical >= 2:
        rows.append(reduce_scatter_check(names))
    candidates = {"stock_default": None, "ours_auto": tf_agn.AggregatingAllReduce()}
    candidates["ours_local"] = tf_agn.AggregatingAllReduce(transport="local")
    if num_physical >= 2:
        candidates["nccl_all_reduce"] = tf.distribute.NcclAllReduce()
        candidates["ours_collective"] = tf_agn.AggregatingAllReduce(transport="collective")
    for name, ops in candidates.items():
        rows.append(timed(names, name, ops))
    print(json.dumps({"gpus": num_physical, "devices": names, "rows": rows}))


if __name__ == "__main__":
    main()
