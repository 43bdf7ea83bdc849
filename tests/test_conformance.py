"""Behaviours TensorFlow's own `tf.distribute` tests check of cross-device
ops, on `AggregatingAllReduce`, on 4 logical CPUs.

Each was a TensorFlow 2.21 test that passed with TensorFlow's ops and
failed with tf_agn's: a sync-on-read variable given to
`replica_context.all_reduce` (`strategy_common_test`), a strategy's deep
copy (`testDeepCopy`), and the ops used on their own, with values made
outside any strategy (`cross_device_ops_test`'s `CollectiveOpsTest`).
Every result is compared with numpy or with
`tf.distribute.ReductionToOneDevice`. The ops' `_all_reduce` on their own
across two workers is checked in tests/test_multi_worker.py.
"""

import copy

import numpy as np
import pytest
import tensorflow as tf

from conftest import DEVICES
from conftest import NUM_REPLICAS
from tf_agn import AggregatingAllReduce
from tf_agn import _compat
from tf_agn.strategies import mirrored

TRANSPORTS = ["local", "collective"]
SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


def replica_array(replica):
    """Replica r's dense value, different on every replica."""
    return np.array([1.0, -2.0, 0.5], np.float32) * (replica + 1) + replica


def replica_slices(replica):
    """Replica r's `tf.IndexedSlices` of a 5 x 2 table, rows repeated."""
    rows = np.full((2, 2), replica + 1.0, np.float32)
    return tf.IndexedSlices(
        tf.constant(rows), tf.constant([replica % 5, 4]), tf.constant([5, 2])
    )


def per_replica(make):
    """A `PerReplica` of `make(r)` on `DEVICES[r]`, made without a
    strategy, as TensorFlow's tests make theirs."""
    components = []
    for replica, device in enumerate(DEVICES):
        with tf.device(device):
            components.append(
                tf.nest.map_structure(tf.identity, make(replica), expand_composites=True)
            )
    return _compat.regroup(tuple(components))


def short(device):
    """`device` without its job, replica and task."""
    return device[device.index("/device:") :]


# A sync-on-read variable as the input of `replica_context.all_reduce`.


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_on_read_variable_all_reduces_in_replica_context(transport, traced):
    strategy = mirrored(DEVICES, transport=transport)
    with strategy.scope():
        variable = tf.Variable(
            tf.zeros([3]),
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    base = tf.constant(replica_array(0))

    def replica_fn():
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group, tf.float32)
        variable.assign(base * (replica + 1) + replica)  # replica_array
        return context.all_reduce(SUM, variable), context.all_reduce(MEAN, variable)

    # As TensorFlow's test: the replica function itself is the tf.function.
    sums, means = strategy.run(tf.function(replica_fn) if traced else replica_fn)
    arrays = [replica_array(r) for r in range(NUM_REPLICAS)]
    for got in strategy.experimental_local_results(sums):
        np.testing.assert_allclose(got.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
    for got in strategy.experimental_local_results(means):
        np.testing.assert_allclose(got.numpy(), np.mean(arrays, axis=0), rtol=1e-6)


# A strategy's deep copy.


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deep_copy_of_a_strategy_reduces_like_the_original(transport):
    strategy = mirrored(DEVICES, transport=transport, bytes_per_pack=8, compression="fp16")
    ops = _compat.cross_device_ops(strategy.extended)
    dense, sparse = per_replica(replica_array), per_replica(replica_slices)
    pairs = [(dense, dense), (dense, dense), (sparse, sparse)]
    want = tf.distribute.ReductionToOneDevice().batch_reduce(MEAN, pairs)
    # The original has reduced, and so (eagerly, on the collective
    # transport) traced a function, before it is copied.
    strategy.extended.batch_reduce_to(MEAN, pairs)

    copied = copy.deepcopy(strategy)

    copied_ops = _compat.cross_device_ops(copied.extended)
    assert type(copied_ops) is type(ops) and copied_ops is not ops
    settings = lambda o: (  # noqa: E731
        o.default_aggregation, o.bytes_per_pack, o.default_compressor.name, o.jit_compile,
        o.transport_name, o.num_workers, o.worker_index, o.options.bytes_per_pack,
    )
    assert settings(copied_ops) == settings(ops)
    # Both reduce, in turn, and agree with TensorFlow's ops.
    for reducing in (copied, strategy, copied):
        results = reducing.extended.batch_reduce_to(MEAN, pairs)
        for got, expected in zip(results, want):
            for local, reference in zip(got.values, expected.values):
                np.testing.assert_allclose(
                    tf.convert_to_tensor(local).numpy(),
                    tf.convert_to_tensor(reference).numpy(),
                    rtol=1e-6,
                )


# The ops on their own, as TensorFlow's CollectiveOpsTest uses its ops.


def reduce_on_their_own(cross_device_ops):
    """`reduce` and `batch_reduce` of values made without a strategy, to
    the values' own devices, one device and two of them.

    Returns:
        One `[(device, dense array), ...]` per result.
    """
    dense, sparse = per_replica(replica_array), per_replica(replica_slices)
    elsewhere = per_replica(lambda r: tf.zeros([3]))
    results = [
        cross_device_ops.reduce(MEAN, dense, dense),
        cross_device_ops.reduce(SUM, dense, DEVICES[1]),
        *cross_device_ops.batch_reduce(
            SUM, [(dense, dense), (sparse, sparse), (dense, elsewhere)]
        ),
    ]
    return [
        [(local.device, tf.convert_to_tensor(local)) for local in getattr(r, "values", [r])]
        for r in results
    ]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reduce_and_batch_reduce_on_their_own(transport, traced):
    ops = AggregatingAllReduce(transport=transport)
    placements = {}

    def run(cross_device_ops):
        results = reduce_on_their_own(cross_device_ops)
        # Devices as the graph places them; eagerly, where the tensors are.
        placements[cross_device_ops] = [[short(d) for d, _ in r] for r in results]
        return [[t for _, t in r] for r in results]

    if traced:
        run = tf.function(run)
    got = run(ops)
    want = run(tf.distribute.ReductionToOneDevice())
    assert placements[ops] == list(placements.values())[1]
    assert [len(r) for r in got] == [NUM_REPLICAS, 1, NUM_REPLICAS, NUM_REPLICAS, NUM_REPLICAS]
    for ours, reference in zip(got, want):
        for local, expected in zip(ours, reference):
            np.testing.assert_allclose(local.numpy(), expected.numpy(), rtol=1e-6)


@pytest.mark.parametrize("reduce_op", [SUM, MEAN], ids=lambda op: op.name)
def test_all_reduce_on_their_own_serves_one_local_replica(reduce_op):
    """Outside a strategy `_all_reduce` reduces this process's one replica,
    on its values' device, with the other workers' (none here)."""
    ops = AggregatingAllReduce(transport="collective")
    slices = replica_slices(2)
    placed = []

    @tf.function
    def all_reduce():
        with tf.device(DEVICES[2]):
            value = (tf.constant(replica_array(2)), tf.identity(slices))
            dense, sparse = ops._all_reduce(reduce_op, value, 0, None)
        placed.extend(short(t.device) for t in (dense, sparse.values))
        return dense, tf.convert_to_tensor(sparse)

    dense, sparse = all_reduce()
    # The sum and the mean of one replica are its own value.
    np.testing.assert_allclose(dense.numpy(), replica_array(2), rtol=1e-6)
    np.testing.assert_allclose(sparse.numpy(), tf.convert_to_tensor(slices).numpy())
    assert placed == [DEVICES[2]] * 2


def test_all_reduce_on_their_own_refuses_a_second_local_replica():
    ops = AggregatingAllReduce(transport="collective")
    with tf.device(DEVICES[1]), pytest.raises(ValueError, match="replica_id 1"):
        ops._all_reduce(SUM, tf.constant(1.0), 1, None)
