"""Every private TensorFlow and Keras name tf_agn reaches through
`tf_agn._compat` still exists and behaves as we rely on. A failure here
means a release changed an internal: update `_compat`, nowhere else.

The static tests at the end keep it the only place: no other module of the
package imports Keras' or TensorFlow's private modules or touches a private
attribute that is not tf_agn's own."""

import ast
import json
import os
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from scripts import run_python
from tf_agn import _compat
from tf_agn.strategies.ports import free_ports

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
    ops = tf.distribute.ReductionToOneDevice()
    assert len(_compat.devices_of(value, ops)) == len(DEVICES)
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
    in_place = type("AdamW", (keras.optimizers.AdamW, _compat.InPlaceUpdates), {})
    optimizer = in_place(0.5, weight_decay=0.1, clipnorm=1.0)
    optimizer.build([variable])
    _compat.apply_weight_decay(optimizer, [variable])
    np.testing.assert_allclose(variable.numpy(), 2.0 * (1 - 0.5 * 0.1), rtol=1e-6)
    (clipped,) = _compat.clip_gradients_in_place(optimizer, [tf.constant([3.0, 4.0])])
    np.testing.assert_allclose(clipped.numpy(), [0.6, 0.8], rtol=1e-6)


def test_in_place_updates_run_a_keras_classs_own_update_step():
    """Nadam keeps the product of its momentum factors in its own
    `_backend_update_step`: through `InPlaceUpdates` it still runs, so
    tf_agn's Nadam equals Keras's (it was NaN when it was skipped)."""
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    y = x.sum(1, keepdims=True)
    weights = []
    for optimizer in (
        keras.optimizers.Nadam(0.01),
        tf_agn.optimizers.DistributedOptimizer(keras.optimizers.Nadam(0.01)),
    ):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for got, want in zip(weights[1], weights[0]):
        np.testing.assert_array_equal(got, want)


def test_update_step_in_place_refuses_what_it_would_skip():
    variable = keras.Variable(np.ones(2, np.float32))
    optimizer = keras.optimizers.Nadam()
    optimizer.build([variable])
    with pytest.raises(ValueError, match="Nadam updates state of its own once per step"):
        _compat.update_step_in_place(optimizer, [tf.ones(2)], [variable], 0.1)
    with pytest.raises(ValueError, match="Nadam updates state of its own once per step"):
        tf_agn.optimizers.AGN(outer_optimizer=keras.optimizers.Nadam())


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


def test_compiled_loss_and_metrics_are_what_compile_built():
    """What the parameter-server trainer relies on: the compiled loss leaves
    out the regularization losses (workers add those `stateless_call`
    returns), and the compiled metrics update from `(y, y_pred)` alone."""
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, kernel_regularizer="l2")]
    )
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    y_true, y_pred = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])
    assert float(_compat.compiled_loss(model)(y_true, y_pred)) == pytest.approx(5.0)
    weights = tf.constant([1.0, 0.0])
    assert float(_compat.compiled_loss(model)(y_true, y_pred, weights)) == pytest.approx(0.5)
    metrics = _compat.compiled_metrics(model)
    metrics.update_state(y_true, y_pred)
    assert float(metrics.result()["mae"]) == pytest.approx(2.0)
    plain = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    assert _compat.compiled_metrics(plain) is None


def test_nodes_by_depth_descending_is_a_topological_order():
    inputs = keras.Input((2,))
    first = keras.layers.Dense(3, name="first")
    second = keras.layers.Dense(1, name="second")
    model = keras.Model(inputs, second(first(inputs)))
    by_depth = _compat.nodes_by_depth(model)
    order = [
        node.operation for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]
    ]
    assert isinstance(order[0], keras.layers.InputLayer)
    assert order[1:] == [first, second]


def test_creation_strategy_is_the_one_in_scope_at_creation():
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with strategy.scope():
        optimizer = keras.optimizers.SGD()
    assert _compat.creation_strategy(optimizer) is strategy
    assert _compat.creation_strategy(keras.optimizers.SGD()) is tf.distribute.get_strategy()


def test_built_variables_and_learning_rate_source():
    kernel, bias = keras.Variable(np.zeros((2, 1))), keras.Variable(np.zeros(1))
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([kernel, bias])
    built = _compat.built_variables(optimizer)
    assert len(built) == 2 and built[0] is kernel and built[1] is bias
    rate = _compat.learning_rate_source(optimizer)
    assert any(rate is v for v in optimizer.variables)  # a counter, not state
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _compat.learning_rate_source(keras.optimizers.SGD(schedule)) is schedule


def test_read_xspace_reads_the_kernels_a_profile_recorded(tmp_path):
    @tf.function
    def product(a):
        return tf.matmul(a, a, name="profiled_product")

    tf.profiler.experimental.start(str(tmp_path))
    product(tf.ones((64, 64))).numpy()
    tf.profiler.experimental.stop()
    (path,) = tmp_path.glob("**/*.xplane.pb")
    (host,) = [p for p in _compat.read_xspace(str(path)).planes if p.name == "/host:CPU"]
    names = [host.event_metadata[e.metadata_id].name for line in host.lines for e in line.events]
    # "op name:op type"; with oneDNN the type is _MklMatMul.
    assert any(
        name.split(":")[0].endswith("profiled_product") and name.endswith("MatMul")
        for name in names
    ), names


# A one-worker cluster: its coordination service is the key-value store.
KEY_VALUE_SCRIPT = """
import tensorflow as tf
import tf_agn
from tf_agn import _compat

tf_agn.strategies.multi_worker_mirrored()
_compat.set_key_value("tf_agn/k", "7")
assert _compat.get_key_value("tf_agn/k", 1000) == "7"
try:
    _compat.set_key_value("tf_agn/k", "8")
except tf.errors.AlreadyExistsError:
    pass
else:
    raise AssertionError("a second set succeeded")
try:
    _compat.get_key_value("tf_agn/absent", 100)
except tf.errors.DeadlineExceededError:
    print("key-value store ok", flush=True)
"""


def test_the_coordination_services_key_value_store_sets_once_and_waits(tmp_path):
    port = free_ports(1)[0]
    config = {"cluster": {"worker": [f"localhost:{port}"]}, "task": {"type": "worker", "index": 0}}
    result = run_python("-c", KEY_VALUE_SCRIPT, timeout=120,
                        TF_CONFIG=json.dumps(config), CUDA_VISIBLE_DEVICES="")
    assert "key-value store ok" in result.stdout, result.stdout + result.stderr


def test_aggregating_overrides_keras_optimizer_hooks():
    """`tf_agn.optimizers.Aggregating` overrides these Keras hooks; `apply`
    must still go through each of them."""
    called = []

    def recording(name):
        def hook(self, *args):
            called.append(name)
            return getattr(keras.optimizers.SGD, name)(self, *args)

        return hook

    hooks = ("_backend_apply_gradients", "_clip_gradients", "_apply_weight_decay")
    hooks += ("_backend_update_step",)
    Recording = type("Recording", (keras.optimizers.SGD,), {h: recording(h) for h in hooks})
    variable = keras.Variable(np.ones(2, np.float32))
    Recording(0.1, weight_decay=0.1, clipnorm=1.0).apply([tf.ones(2)], [variable])
    assert sorted(set(called)) == sorted(hooks)


def test_cross_device_ops_private_hooks_are_called():
    """What `tf_agn.AggregatingAllReduce` relies on in overriding
    `_num_between_graph_workers` and `_gather_implementation`: with one
    worker, `reduce` and `_gather` of one value already on its destination
    return it without reducing; with more, they reduce, and `_gather` runs
    `_gather_implementation`."""
    calls = []

    def recording(workers):
        class Recording(tf.distribute.ReductionToOneDevice):
            _num_between_graph_workers = workers

            def reduce_implementation(self, *args, **kwargs):
                calls.append("reduce")
                return super().reduce_implementation(*args, **kwargs)

            def _gather_implementation(self, *args, **kwargs):
                calls.append("gather")
                return super()._gather_implementation(*args, **kwargs)

        return Recording()

    value = _compat.make_tensor_into_per_replica(tf.constant([[1.0, 2.0]]))
    for workers, want in ((1, []), (2, ["reduce", "gather"])):
        calls.clear()
        ops = recording(workers)
        ops.reduce(tf.distribute.ReduceOp.SUM, value, destinations=value)
        ops._gather(value, destinations=value, axis=0)
        assert calls == want, workers


def _tensorflow_or_keras(cls):
    return cls.__module__.split(".")[0] in ("keras", "tensorflow")


def _unlisted_and_stale_overrides():
    """The private methods of Keras' and TensorFlow's classes that tf_agn's
    classes define again but `_compat.OVERRIDDEN_PRIVATE_METHODS` does not
    list (with the classes), and the entries there no tf_agn class
    overrides any more."""
    import importlib
    import inspect
    import pkgutil

    import tf_agn.strategies

    overridden = {}
    for package in (tf_agn, tf_agn.strategies):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__") or info.name == "tf_agn._compat":
                continue
            for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
                if not cls.__module__.startswith("tf_agn.") or cls.__module__ == "tf_agn._compat":
                    continue
                ours = [c for c in cls.__mro__ if c.__module__.startswith("tf_agn.")]
                theirs = [c for c in cls.__mro__ if _tensorflow_or_keras(c)]
                for own in ours:
                    for name in own.__dict__:
                        if _is_private(name) and any(name in base.__dict__ for base in theirs):
                            overridden.setdefault(name, set()).add(own.__qualname__)
    unlisted = {n: sorted(c) for n, c in overridden.items() if n not in _compat.OVERRIDDEN_PRIVATE_METHODS}
    stale = sorted(set(_compat.OVERRIDDEN_PRIVATE_METHODS) - set(overridden))
    return unlisted, stale


def test_overrides_of_private_methods_are_listed_in_compat():
    """Every private method of a Keras or TensorFlow class that a tf_agn
    class (or mixin) defines again is in `_compat.OVERRIDDEN_PRIVATE_METHODS`,
    which names what calls it and the test that checks it, and every entry
    there is still overridden. `_compat`'s own classes are its business."""
    unlisted, stale = _unlisted_and_stale_overrides()
    assert not unlisted, f"list these overrides in _compat.OVERRIDDEN_PRIVATE_METHODS: {unlisted}"
    assert not stale, f"no tf_agn class overrides these any more: {stale}"


def test_a_release_that_renames_an_overridden_method_fails_naming_it(monkeypatch):
    """What a Keras that renamed `_backend_apply_gradients` would do: the
    check above names that entry, and only it."""
    for cls in keras.optimizers.Optimizer.__mro__:
        if "_backend_apply_gradients" in vars(cls):
            monkeypatch.delattr(cls, "_backend_apply_gradients")
    assert _unlisted_and_stale_overrides() == ({}, ["_backend_apply_gradients"])


# Versions ---------------------------------------------------------------------


def test_keras_own_optimizers_under_loss_scaling_behave_as_stock():
    """Importing tf_agn replaces `LossScaleOptimizer.check_finite` for the
    whole process (`compile` creates the stock class itself, and an inner
    optimizer never sees its wrapper). Keras's own optimizers must not
    notice: the same mixed-precision run under a stock MirroredStrategy,
    two finite steps then an overflow on replica 1 only, gives bitwise the
    same weights, loss scales and step counts with tf_agn imported as
    without, in fresh processes (tests/stock_loss_scaling_worker.py)."""
    runs = {}
    for flags in ((), ("--import_tf_agn",)):
        output = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tests", "stock_loss_scaling_worker.py"), *flags],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout
        runs[flags] = json.loads(output.strip().splitlines()[-1])
    stock, with_tf_agn = runs[()], runs[("--import_tf_agn",)]
    assert stock["check_finite"].startswith("keras.")
    assert with_tf_agn["check_finite"] == "tf_agn.optimizers.loss_scaling._check_finite"
    assert [s["step_counter"] for s in stock["steps"]] == [1, 2, 3]  # every step applied
    for step, (want, got) in enumerate(zip(stock["steps"], with_tf_agn["steps"])):
        assert got["loss_scale"] == want["loss_scale"] and got["step_counter"] == want["step_counter"]
        for w, g in zip(want["weights"], got["weights"]):
            np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=f"step {step}")
    # Stock Keras lets replica 1's overflow into every weight (what tf_agn's
    # own optimizers fix; tests/test_non_finite.py).
    assert np.isfinite(np.array(stock["steps"][1]["weights"][0])).all()
    assert np.isnan(np.array(stock["steps"][2]["weights"][0])).all()


def test_installed_versions_are_the_tested_ones():
    assert _compat.untested_versions() == []


def test_setup_requires_the_oldest_corner_and_caps_nothing():
    """TensorFlow only through the `tensorflow` extra, so that another
    distribution of it (tensorflow-cpu, tf-nightly) is never doubled."""
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    oldest = _compat.TESTED_VERSIONS["oldest"]
    keras_bound, tensorflow_bound = (f">={oldest[name]}" for name in ("keras", "tensorflow"))
    assert f'install_requires=[\n        "keras{keras_bound}",' in setup
    assert f'"tensorflow": ["tensorflow{tensorflow_bound}"]' in setup
    assert setup.count("tensorflow>=") == 1 and ",<" not in setup


def test_tested_corners_are_the_ci_constraints():
    for corner, versions in _compat.TESTED_VERSIONS.items():
        path = os.path.join(ROOT, ".ci", "constraints", f"{corner}.txt")
        lines = open(path, encoding="utf-8").read().splitlines()
        assert lines[0] == f"# python {versions['python']}", corner
        pins = dict(line.split("==") for line in lines if not line.startswith("#"))
        assert {name: pins[name].rsplit(".", 1)[0] for name in ("tensorflow", "keras")} == {
            "tensorflow": versions["tensorflow"], "keras": versions["keras"]}, corner


def test_versions_between_the_corners_are_silent_and_others_warn():
    assert _compat.untested_versions({"tensorflow": "2.20.0", "keras": "3.12.0"}) == []
    assert _compat.untested_versions({"tensorflow": "2.21.0rc1", "keras": "3.15.1"}) == []
    assert _compat.untested_versions({"tensorflow": "2.19.1", "keras": "3.16.0"}) == [
        "tensorflow 2.19.1", "keras 3.16.0"]
    assert _compat.untested_versions({"tensorflow": "2.22.0-dev20260101"}) == [
        "tensorflow 2.22.0-dev20260101"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_versions({"tensorflow": "2.20.2", "keras": "3.10.0"})
    with pytest.warns(RuntimeWarning, match=r"tensorflow 2.20 to 2.21, keras 3.10 to 3.15; "
                      r"this process has tensorflow 2.22.0\."):
        _compat.check_versions({"tensorflow": "2.22.0", "keras": "3.15.1"})


def _keras_file(tmp_path, keras_version, dense_config):
    """A `.keras` file of one Dense layer, as a Keras `keras_version` would
    write it, with `dense_config` added to the layer's config."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(model)))
    config["config"]["layers"][-1]["config"].update(dense_config)
    path = tmp_path / "model.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": keras_version}))
        archive.writestr("config.json", json.dumps(config))
    return path


def test_a_keras_file_is_unreadable_only_on_an_older_keras_that_fails_on_it(tmp_path):
    newer = f"{keras.__version__.split('.')[0]}.{int(keras.__version__.split('.')[1]) + 1}.0"
    unknown = {"argument_of_a_newer_keras": None}
    assert _compat.unreadable_keras_file(_keras_file(tmp_path, newer, {})) is None
    assert _compat.unreadable_keras_file(_keras_file(tmp_path, keras.__version__, unknown)) is None
    reason = _compat.unreadable_keras_file(_keras_file(tmp_path, newer, unknown))
    assert reason.startswith(
        f"model.keras was written by Keras {newer}, which Keras {keras.__version__} cannot read: ")
    assert "argument_of_a_newer_keras" in reason


# Where private API is used ----------------------------------------------------

# Private attributes modules other than `_compat` may touch, as
# `object._name` source text, each with why it is not Keras' or TensorFlow's.
ALLOWED_PRIVATE_ATTRIBUTES = {
    "os._exit": "Python's documented exit without clean-up, not Keras or TensorFlow.",
    "optimizer._communication": "tf_agn's own CommunicationCounter on its optimizers, "
    "read across modules (tf_agn/collectives/communication.py).",
}
_PRIVATE_MODULES = ("keras.src", "tensorflow.python")
_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _package_files(folders):
    for folder in folders:
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(names):
                if name.endswith(".py") and name != "_compat.py":
                    path = os.path.join(directory, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), ast.parse(f.read())


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _private_attributes(tree):
    """`(line, object source, name)` of every private attribute `tree`
    reads or writes, as `obj._name` or `getattr(obj, "_name")`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            yield node.lineno, ast.unparse(node.value), node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            yield node.lineno, ast.unparse(node.args[0]), node.args[1].value


def _own_private_names(trees):
    """The private names tf_agn itself defines: its functions, classes,
    and attributes it assigns. A name only Keras or TensorFlow defines is
    theirs, whatever object it is reached through."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Attribute):
                            names.add(part.attr)
    return {name for name in names if _is_private(name)}


def test_private_attributes_are_touched_only_in_compat():
    """`self._x`, `cls._x` and `super()._x` are tf_agn's own when tf_agn
    defines `_x`: an attribute it assigns, or a method it defines or
    overrides (the Keras and TensorFlow methods it overrides are listed in
    `_compat.OVERRIDDEN_PRIVATE_METHODS`, and
    `test_overrides_of_private_methods_are_listed_in_compat` fails on any
    that is not). Any other object's private attribute belongs to Keras or
    TensorFlow unless `ALLOWED_PRIVATE_ATTRIBUTES` says otherwise."""
    files = dict(_package_files(("tf_agn", "strategies")))
    own = _own_private_names(files.values())
    offenders = []
    for path, tree in files.items():
        for line, owner, name in _private_attributes(tree):
            if owner in ("self", "cls", "super()") and name in own:
                continue
            if f"{owner}.{name}" not in ALLOWED_PRIVATE_ATTRIBUTES:
                offenders.append(f"{path}:{line}: {owner}.{name}")
    assert not offenders, (
        "private attributes outside tf_agn/_compat.py (add a named function "
        f"there, with its reason in the docstring): {offenders}"
    )


def test_private_modules_are_imported_only_here():
    offenders = []
    for path, tree in _package_files(("tf_agn", "strategies", "examples", "benchmarks")):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from keras import src` reaches the same modules.
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for module in modules:
                if any(module == m or module.startswith(m + ".") for m in _PRIVATE_MODULES):
                    offenders.append(f"{path}:{node.lineno}: {module}")
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
        assert bool(_compat.stock_loss_scale_method("check_finite")(optimizer, finite_grads))
        want = -finite_grads[0] / optimizer.initial_scale if applied else np.zeros(2)
        np.testing.assert_array_equal(variable.numpy(), want)
        scale = optimizer.initial_scale if applied else optimizer.initial_scale / 2
        assert float(optimizer.dynamic_scale.numpy()) == scale
        assert int(optimizer.step_counter.numpy()) == int(applied)
