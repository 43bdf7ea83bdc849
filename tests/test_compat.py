"""Every private TensorFlow and Keras name tf_agn reaches through
`tf_agn._compat` still exists and behaves as we rely on. A failure here
means a release changed an internal: update `_compat`, nowhere else."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import DEVICES
from tf_agn import _compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plain_variable_is_one_variable_even_under_a_strategy():
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with strategy.scope():
        variable = _compat.plain_variable(3, tf.int32, DEVICES[1])
    assert not isinstance(variable, tf.distribute.DistributedValues)
    assert variable.device.endswith("CPU:1")
    assert int(variable.assign_add(1)) == 4


def test_per_replica_helpers():
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(1.0)
    )
    assert _compat.check_destinations(value)
    assert len(_compat.get_devices_from(value, True)) == len(DEVICES)
    single = _compat.make_tensor_into_per_replica(tf.constant(2.0))
    assert len(single.values) == 1
    mirrored = _compat.regroup(tuple(value.values), wrap_class=_compat.Mirrored)
    assert isinstance(mirrored, _compat.Mirrored)


def test_cross_device_ops_reads_and_replaces_a_strategys_ops():
    ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    assert _compat.cross_device_ops(strategy.extended) is ops
    other = tf.distribute.ReductionToOneDevice()
    _compat.replace_cross_device_ops(strategy.extended, other)
    assert _compat.cross_device_ops(strategy.extended) is other
    one_device = tf.distribute.OneDeviceStrategy(DEVICES[0])
    with pytest.raises(RuntimeError, match="keeps no CrossDeviceOps"):
        _compat.cross_device_ops(one_device.extended)
    assert _compat.cross_device_ops(one_device.extended, required=False) is None


# Keras ------------------------------------------------------------------------


def test_update_step_in_place_updates_each_replicas_own_copy():
    """What NONE and local steps rely on: in replica context the update
    touches only that replica's copy, with no all-reduce."""
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with strategy.scope():
        variable = keras.Variable(np.ones(2, np.float32))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([variable])

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            grad = tf.fill([2], tf.cast(context.replica_id_in_sync_group + 1, tf.float32))
            _compat.update_step_in_place(optimizer, [grad], [variable], 0.1)

        strategy.run(replica_fn)

    step()
    copies = [v.numpy() for v in strategy.experimental_local_results(variable.value)]
    want = [np.full(2, 1 - 0.1 * (r + 1), np.float32) for r in range(len(DEVICES))]
    np.testing.assert_allclose(copies, want, rtol=1e-6)


def test_weight_decay_and_clipping_follow_keras_formulas():
    variable = keras.Variable(np.full(2, 2.0, np.float32))
    optimizer = keras.optimizers.AdamW(0.5, weight_decay=0.1, clipnorm=1.0)
    optimizer.build([variable])
    _compat.apply_weight_decay_in_place(optimizer, [variable])
    np.testing.assert_allclose(variable.numpy(), 2.0 * (1 - 0.5 * 0.1), rtol=1e-6)
    (clipped,) = _compat.clip_gradients_in_place(optimizer, [tf.constant([3.0, 4.0])])
    np.testing.assert_allclose(clipped.numpy(), [0.6, 0.8], rtol=1e-6)


def test_slots_created_plainly_is_scoped():
    optimizer = keras.optimizers.Adam()
    variable = keras.Variable(np.zeros(3, np.float32))
    with _compat.slots_created_plainly(optimizer):
        assert "add_variable_from_reference" in vars(optimizer)
        optimizer.build([variable])
    assert "add_variable_from_reference" not in vars(optimizer)
    assert [v.shape for v in optimizer.variables[2:]] == [(3,), (3,)]  # m and v


def test_ordered_per_worker_needs_a_per_worker_variable():
    for name in ("handle_call_time_value", "_maybe_create_per_worker_vars"):
        assert hasattr(_compat._tf_ps_values.PerWorkerVariable, name), name
    with pytest.raises(RuntimeError, match="PerWorkerVariable, got ResourceVariable"):
        _compat.ordered_per_worker(tf.Variable(1.0))


def test_loss_and_metric_wrappers_compile_like_keras():
    loss = _compat.LossFunctionWrapper(keras.losses.mean_squared_error)
    value = loss(tf.constant([[1.0, 3.0]]), tf.constant([[0.0, 0.0]]))
    assert float(value) == pytest.approx(5.0)
    metrics = _compat.CompileMetrics(["accuracy"], None)
    y_true, y_pred = tf.constant([[1.0], [0.0]]), tf.constant([[0.9], [0.9]])
    metrics.build(y_true, y_pred)
    metrics.update_state(y_true, y_pred)
    assert float(metrics.result()["accuracy"]) == pytest.approx(0.5)


def test_set_initial_epoch_moves_fits_start_from_on_train_begin():
    class StartAtEpoch2(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.set_initial_epoch(self.model, 2)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 1), np.float32)
    epochs = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs.append(e))
    model.fit(x, x, epochs=4, verbose=0, callbacks=[StartAtEpoch2(), record])
    assert epochs == [2, 3]
    _compat.set_initial_epoch(model, None)
    epochs.clear()
    model.fit(x, x, epochs=2, verbose=0, callbacks=[record])
    assert epochs == [0, 1]


# Versions ---------------------------------------------------------------------


def test_installed_versions_are_the_tested_ones():
    assert _compat.untested_versions() == []


def test_setup_declares_the_tested_range():
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    for name, (low, high) in _compat.TESTED_VERSIONS.items():
        assert f'"{name}>={low},<{high}"' in setup, name


def test_an_untested_version_warns_naming_the_tested_range():
    versions = {"tensorflow": "2.22.0", "keras": "3.15.1"}
    assert _compat.untested_versions(versions) == ["tensorflow 2.22.0"]
    assert _compat.untested_versions({"tensorflow": "2.21.0rc1", "keras": "3.15.0"}) == []
    with pytest.warns(RuntimeWarning, match=r"tensorflow >=2.21,<2.22.*has tensorflow 2.22.0"):
        _compat.check_versions(versions)


def test_private_modules_are_imported_only_here():
    pattern = re.compile(r"^\s*(from|import)\s+(keras\.src|tensorflow\.python)\b", re.M)
    offenders = []
    for folder in ("tf_agn", "strategies", "examples", "benchmarks"):
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                path = os.path.join(directory, name)
                if not name.endswith(".py") or name == "_compat.py":
                    continue
                if pattern.search(open(path, encoding="utf-8").read()):
                    offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, f"private Keras/TensorFlow imports outside tf_agn/_compat.py: {offenders}"


def test_keras_gradient_accumulation_internals():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    names = []
    plain = optimizer.add_variable_from_reference
    optimizer.add_variable_from_reference = lambda ref, name=None, **kw: (
        names.append(name) or plain(ref, name=name, **kw)
    )
    optimizer.build(model.trainable_variables)
    assert names == [_compat.KERAS_ACCUMULATOR_NAME] * 2
    kernel = model.trainable_variables[0]
    accumulator = _compat.accumulator_of(optimizer, kernel)
    assert accumulator.path.endswith(
        _compat.reference_variable_name(kernel, _compat.KERAS_ACCUMULATOR_NAME)
    )
    optimizer.apply([tf.ones((3, 2)), tf.ones((2,))])
    assert int(_compat.micro_step(optimizer).numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(accumulator.numpy(), np.ones((3, 2)))
    extra = keras.Variable(0.0, trainable=False, name="extra")
    _compat.track_variable(optimizer, extra)
    assert optimizer.variables[-1] is extra


def test_loss_scale_optimizer_decides_by_check_finite():
    """What tf_agn.optimizers.loss_scaling relies on: Keras'
    LossScaleOptimizer skips a step and halves its scale when
    `check_finite` says so, and tf_agn's replacement (installed when
    tf_agn is imported) asks an inner optimizer that has
    `all_replicas_finite`; stock ones get the stock answer. Under a
    strategy: tests/test_non_finite.py."""

    class SaysNotFinite(keras.optimizers.SGD):
        def all_replicas_finite(self, grads):
            return tf.constant(False)

    finite_grads = [np.ones(2, np.float32)]
    for inner, applied in ((keras.optimizers.SGD(1.0), True), (SaysNotFinite(1.0), False)):
        variable = keras.Variable(np.zeros(2, np.float32))
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
        optimizer.apply(finite_grads, [variable])
        assert bool(_compat.stock_loss_scale_check_finite(optimizer, finite_grads))
        want = -finite_grads[0] / optimizer.initial_scale if applied else np.zeros(2)
        np.testing.assert_array_equal(variable.numpy(), want)
        scale = optimizer.initial_scale if applied else optimizer.initial_scale / 2
        assert float(optimizer.dynamic_scale.numpy()) == scale
        assert int(optimizer.step_counter.numpy()) == int(applied)
