"""`tf_agn.compression`: it touches what `aggregate` sends (gradients and
commits), and nothing else.

With `compression="fp16"` or `"bf16"`, TensorFlow's entry points of
`AggregatingAllReduce` (`extended.reduce_to`, `batch_reduce_to`, the ops'
own `reduce` and `batch_reduce`, `replica_context.all_reduce`, the
replica-context `_all_reduce`) and Keras's loss and metric logs must stay
exact on both transports, with values float16 cannot hold (past 65504),
integer counts float16 cannot hold (past 2048) and ones bfloat16 cannot
(1001). References are computed in numpy, in float64. The cross-worker
checks are in tests/test_multi_worker.py.

In one process `strategy.reduce` to the host, and so Keras's logs, never
reach the ops (`MirroredStrategy` sends them to `ReductionToOneDevice`):
the Keras test guards them; `reduce_to`, `batch_reduce_to` and the ops'
own methods used to compress there too (fp16 gave inf for 700016).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import NUM_REPLICAS
from multi_worker_data import large_values
import replica_aggregate
from tf_agn import compression
from tf_agn.collectives import agreement

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN
TRANSPORTS = ["local", "collective"]
COMPRESSIONS = ["fp16", "bf16"]


def per_replica(strategy, make):
    """A `PerReplica` value holding `make(r)` on replica r's device."""

    def value_fn(context):
        replica = context.replica_id_in_sync_group
        with tf.device(DEVICES[replica]):
            return tf.identity(tf.constant(make(replica)))

    return strategy.experimental_distribute_values_from_function(value_fn)


def exact(reduce_op):
    total = np.sum([large_values(r).astype(np.float64) for r in range(NUM_REPLICAS)], 0)
    return total / NUM_REPLICAS if reduce_op == MEAN else total


def assert_exact(value, reduce_op):
    for tensor in value.values:
        np.testing.assert_array_equal(tensor.numpy(), exact(reduce_op).astype(np.float32))


# The compressor interface.


def test_get_maps_names_and_passes_compressors_through():
    assert compression.get(None) is None
    assert compression.get("fp16") is compression.FP16
    assert compression.get("bf16") is compression.BF16
    assert compression.get("FP16") is compression.FP16  # any case, as methods
    custom = Float16Scaled()
    assert compression.get(custom) is custom
    assert tf_agn.AggregatingAllReduce(compression="fp16").default_compressor is compression.FP16


@pytest.mark.parametrize("bad", ["fp8", "int2", 16, tf.float16])
def test_get_names_the_bad_value_and_the_allowed_ones(bad):
    with pytest.raises(ValueError, match="Unknown compression") as error:
        compression.get(bad)
    message = str(error.value)
    assert repr(bad) in message
    for allowed in ("None", "'fp16'", "'bf16'", "'int8'", "'int4'", "PowerSGD", "Compressor"):
        assert allowed in message


def test_casts_act_on_float32_and_float64_only():
    for dtype in (tf.float16, tf.bfloat16, tf.int32, tf.int64):
        assert compression.FP16.wire_dtype(dtype) == dtype
    assert compression.FP16.wire_dtype(tf.float64) == tf.float16
    assert compression.BF16.wire_dtype(tf.float32) == tf.bfloat16


class Float16Scaled(compression.Cast):
    """The module docstring's example: float32 scaled by 2**-8 into float16,
    so that values up to 2**8 * 65504 survive."""

    def __init__(self):
        super().__init__("fp16_scaled", tf.float16)

    def compress(self, tensor):
        return tf.cast(tensor * 2.0**-8, tf.float16)

    def decompress(self, tensor, dtype):
        return tf.cast(tensor, dtype) * 2.0**8


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("flatten_packs", [True, False])
def test_a_subclass_compresses_aggregate(transport, flatten_packs):
    ops = tf_agn.AggregatingAllReduce(
        transport=transport, compression=Float16Scaled(), flatten_packs=flatten_packs
    )
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    value = per_replica(strategy, large_values)
    ones = per_replica(strategy, lambda r: np.full([3], r + 1, np.int64))
    (summed, counts) = replica_aggregate.aggregate(strategy, "sum", [value, ones], compressor=ops.default_compressor)
    want = exact(SUM)
    for tensor in summed.values:
        assert tensor.dtype == tf.float32
        got = tensor.numpy()
        # Each scaled value is rounded to float16 once (and, on the
        # collective transport, every partial sum): within 2**-9 relative.
        np.testing.assert_allclose(got, want, rtol=NUM_REPLICAS * 2.0**-10)
        assert np.any(got != want)  # it did travel compressed
    for tensor in counts.values:  # int64: left alone
        np.testing.assert_array_equal(tensor.numpy(), [10, 10, 10])


def test_workers_compare_compressors_by_name():
    devices = ["/device:CPU:0"]

    def codes(compressor):
        ops = tf_agn.AggregatingAllReduce(
            transport="collective", num_workers=2, worker_index=0, compression=compressor
        )
        return agreement.strategy_settings(ops, devices)

    def values(settings):
        return [setting.code for setting in settings]

    assert values(codes(Float16Scaled())) == values(codes(Float16Scaled()))
    message = agreement.disagreement(
        codes("bf16"), [values(codes("bf16")), values(codes(Float16Scaled()))]
    )
    assert message.startswith("Workers disagree on compression: worker 0 has 'bf16', ")
    assert "worker 1 has a compressor of another name" in message


# TensorFlow's entry points stay exact.


def strategy_for(transport, compression_name):
    ops = tf_agn.AggregatingAllReduce(transport=transport, compression=compression_name)
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops), ops


@pytest.mark.parametrize("compression_name", COMPRESSIONS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cross_replica_entry_points_stay_exact(transport, compression_name):
    strategy, ops = strategy_for(transport, compression_name)
    value = per_replica(strategy, large_values)
    assert_exact(strategy.extended.reduce_to(SUM, value, value), SUM)
    for reduce_op in (SUM, MEAN):
        for result in strategy.extended.batch_reduce_to(reduce_op, [(value, value)] * 2):
            assert_exact(result, reduce_op)
        # The public `tf.distribute.CrossDeviceOps` methods, as
        # `strategy.reduce` reaches them across workers.
        assert_exact(ops.reduce(reduce_op, value, value), reduce_op)
        (result,) = ops.batch_reduce(reduce_op, [(value, value)])
        assert_exact(result, reduce_op)


@pytest.mark.parametrize("compression_name", COMPRESSIONS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replica_context_all_reduce_stays_exact(transport, compression_name):
    """Keras's own optimizers and metrics reduce this way; their values
    are not tf_agn's gradients, so they travel uncompressed."""
    strategy, ops = strategy_for(transport, compression_name)
    value = per_replica(strategy, large_values)

    @tf.function
    def step(x):
        def replica_fn(x):
            context = tf.distribute.get_replica_context()
            merged = context.all_reduce(SUM, x * 1.0)
            if transport != "collective":
                return merged, merged
            replica = int(tf.get_static_value(context.replica_id_in_sync_group))
            (direct,) = ops._all_reduce(MEAN, [x * 1.0], replica, None)
            return merged, direct

        return strategy.run(replica_fn, args=(x,))

    merged, direct = step(value)
    for tensor in strategy.experimental_local_results(merged):
        np.testing.assert_array_equal(tensor.numpy(), exact(SUM).astype(np.float32))
    if transport == "collective":
        for tensor in strategy.experimental_local_results(direct):
            np.testing.assert_array_equal(tensor.numpy(), exact(MEAN).astype(np.float32))


# Keras's logs stay exact while tf_agn's optimizer compresses gradients.

# Correct predictions past float16's 65504, and per-replica counts (19001)
# neither float16 nor bfloat16 holds.
BATCH = 19_001 * NUM_REPLICAS
ROWS = BATCH


def regression_data():
    """Targets near 1000 for a model that predicts 0: MSE ~1e6."""
    index = np.arange(ROWS)
    x = ((index % 7) / 7.0).astype(np.float32)[:, None]
    y = (1000.0 + index % 13).astype(np.float32)[:, None]
    return x, y


def zero_model(units):
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(units, kernel_initializer="zeros")]
    )
    return model


@pytest.mark.parametrize("compression_name", COMPRESSIONS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_keras_logs_stay_exact(transport, compression_name):
    strategy, _ = strategy_for(transport, compression_name)
    x, y = regression_data()
    want_mse = np.mean(y.astype(np.float64) ** 2)
    with strategy.scope():
        regression = zero_model(1)
        # A learning rate of 0 keeps the weights, so every step's loss is
        # that of the zero model, while the gradients (~1e3) still travel
        # compressed through tf_agn's optimizer.
        regression.compile(optimizer=tf_agn.optimizers.SGD(0.0), loss="mse")
        classifier = zero_model(2)
        classifier.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # Four steps of 4750 rows per replica (Keras builds the model from the
    # first batch, which must split evenly).
    fit_rows = 4 * 4750 * NUM_REPLICAS
    history = regression.fit(
        x[:fit_rows], y[:fit_rows], batch_size=fit_rows // 4, epochs=1, verbose=0,
        shuffle=False,
    )
    want_fit = np.mean(y[:fit_rows].astype(np.float64) ** 2)
    np.testing.assert_allclose(history.history["loss"][0], want_fit, rtol=1e-6)
    loss = regression.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(loss, want_mse, rtol=1e-6)

    # The classifier predicts class 1 (its bias); every 10th label is 0.
    classifier.layers[0].bias.assign([0.0, 1.0])
    labels = (np.arange(ROWS) % 10 != 0).astype(np.int64)
    _, accuracy = classifier.evaluate(x, labels, batch_size=BATCH, verbose=0)
    correct = int(labels.sum())
    assert correct > 65504
    assert accuracy == pytest.approx(correct / ROWS, rel=1e-7)
