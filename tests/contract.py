"""The `CrossDeviceOps` contract, exercised the same way in one process and
on every worker of a multi-worker cluster.

`contract_results(strategy, traced)` makes per-replica values from each
replica's global id, so that any strategy with the same number of replicas
in sync holds the same values, then calls every entry point TensorFlow's
callers use: `strategy.reduce`, `extended.reduce_to` and `batch_reduce_to`
with several values and mixed destinations, `broadcast_to`,
`strategy.gather` (rows of different lengths, two axes), a replica
context's `all_gather` and `all_reduce`, `tf.IndexedSlices`, integers and
float16. It returns this process's results as numpy arrays; comparing them
with a `ReductionToOneDevice` strategy's (in one process) or with those of
a one-process strategy of as many replicas (across workers) checks the
contract.

`aggregate_results(strategy, traced)` does the same for tf_agn's own
entry point, `tf_agn.aggregate` on every replica, one call with many packs
(give the strategy small ones), dense and sparse values together, for
every method. It is not imported by worker processes' conftest: it must
not split the CPU.
"""

import numpy as np
import tensorflow as tf

import replica_aggregate

ROWS = 3


def _per_replica(strategy, make):
    return strategy.experimental_distribute_values_from_function(
        lambda context: make(context.replica_id_in_sync_group)
    )


def _floats(replica, dtype=tf.float32, shape=(2, 3)):
    base = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    return tf.constant(base * 0.25 + replica + 1, dtype)


def _rows(replica):
    # Replica r holds r + 1 rows: gathers must cope with ragged replicas.
    return tf.constant(
        np.arange((replica + 1) * ROWS, dtype=np.float32).reshape(replica + 1, ROWS)
        + 10 * replica
    )


def _slices(replica):
    rows = tf.constant(np.full((replica + 1, ROWS), replica + 1.0, np.float32))
    indices = tf.constant(np.arange(replica + 1) % 4, tf.int64)
    return tf.IndexedSlices(rows, indices, tf.constant([4, ROWS], tf.int64))


def _local(strategy, value):
    """This process's copies of a result; dense arrays throughout."""
    results = []
    for local in strategy.experimental_local_results(value):
        if isinstance(local, tf.IndexedSlices):
            table = np.zeros(local.dense_shape.numpy(), np.float64)
            np.add.at(table, local.indices.numpy(), local.values.numpy())
            results.append(table)
        else:
            results.append(np.asarray(tf.cast(local, tf.float64)))
    return results


def contract_results(strategy, traced):
    """Every `CrossDeviceOps` entry point on `strategy`, eager or traced.

    Returns:
        `{name: [array per local replica]}`.
    """
    sum_, mean = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
    extended = strategy.extended
    host = extended.worker_devices[0]
    floats = _per_replica(strategy, _floats)
    halves = _per_replica(strategy, lambda r: _floats(r, tf.float16))
    integers = _per_replica(strategy, lambda r: tf.constant([r + 1, 70000], tf.int64))
    rows = _per_replica(strategy, _rows)
    slices = _per_replica(strategy, _slices)

    def run():
        def replica_step():
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
            gathered = context.all_gather(_rows_in_replica(replica), axis=0)
            reduced = context.all_reduce(sum_, tf.cast(replica + 1, tf.float32))
            return gathered, reduced

        gathered_in_replica, reduced_in_replica = strategy.run(replica_step)
        batch = extended.batch_reduce_to(
            sum_, [(floats, floats), (halves, host), (floats, floats), (slices, slices)]
        )
        return {
            "reduce_sum": strategy.reduce(sum_, floats, axis=None),
            "reduce_mean": strategy.reduce(mean, floats, axis=None),
            "reduce_half_mean": strategy.reduce(mean, halves, axis=None),
            "reduce_integers": strategy.reduce(sum_, integers, axis=None),
            "reduce_to_mirrored": extended.reduce_to(mean, floats, floats),
            "reduce_to_host": extended.reduce_to(sum_, floats, host),
            "batch_0": batch[0],
            "batch_1_host": batch[1],
            "batch_2": batch[2],
            "batch_3_slices": batch[3],
            "reduce_slices": extended.reduce_to(mean, slices, slices),
            "broadcast": extended.broadcast_to(tf.constant([7.0, 8.0]), floats),
            "gather_rows": strategy.gather(rows, axis=0),
            "gather_columns": strategy.gather(
                _per_replica(strategy, lambda r: tf.transpose(_floats(r))), axis=1
            ),
            "all_gather_in_replica": gathered_in_replica,
            "all_reduce_in_replica": reduced_in_replica,
        }

    results = tf.function(run, autograph=False)() if traced else run()
    return {name: _local(strategy, value) for name, value in results.items()}


def _rows_in_replica(replica):
    # `_rows` from inside a replica, where the id is a tensor.
    count = replica + 1
    values = tf.reshape(tf.range(count * ROWS, dtype=tf.float32), [count, ROWS])
    return values + 10 * tf.cast(replica, tf.float32)


def reference_methods(num_replicas, replica):
    """numpy results of `aggregate_results` for global replica `replica`."""
    dense = [[np.asarray(_floats(r, shape=shape)) for r in range(num_replicas)]
             for shape in _AGGREGATE_SHAPES]
    sparse = []
    for r in range(num_replicas):
        table = np.zeros((4, ROWS))
        values = _slices(r)
        np.add.at(table, values.indices.numpy(), values.values.numpy())
        sparse.append(table)
    out = {}
    for method in ("sum", "mean", "only_first_replica", "none"):
        for index, column in enumerate(dense + [sparse]):
            out[f"{method}/{index}"] = {
                "sum": sum(column),
                "mean": sum(column) / num_replicas,
                "only_first_replica": column[0],
                "none": column[replica],
            }[method]
    return out


# Enough tensors of a few bytes that a 64-byte pack limit makes many packs.
_AGGREGATE_SHAPES = [(2, 3), (5,), (3, 3), (7,), (1,), (4, 2)]


def aggregate_results(strategy, traced):
    """`tf_agn.aggregate` for every method on dense and sparse values at once.

    Returns:
        `{"<method>/<index>": [array per local replica]}`.
    """
    values = [
        _per_replica(strategy, lambda r, shape=shape: _floats(r, shape=shape))
        for shape in _AGGREGATE_SHAPES
    ]
    values.append(_per_replica(strategy, _slices))

    def run():
        return {
            method: replica_aggregate.aggregate(strategy, method, values)
            for method in ("sum", "mean", "only_first_replica", "none")
        }

    results = tf.function(run, autograph=False)() if traced else run()
    return {
        f"{method}/{index}": _local(strategy, value)
        for method, combined in results.items()
        for index, value in enumerate(combined)
    }
