"""Every private TensorFlow and Keras API tf_agn relies on, and the
versions it is tested with.

Only this module reaches them, so a release that changes one breaks one
place, and `tests/test_compat.py` checks each name below on every tested
corner. Importing tf_agn under a TensorFlow or Keras outside the range
`TESTED_VERSIONS` spans warns once (`check_versions`); a test that skips
on some release asks this module why (`unreadable_keras_file`). The
private methods tf_agn's classes override are in
`OVERRIDDEN_PRIVATE_METHODS`.

From TensorFlow:

- `resource_variable_ops.ResourceVariable`: a variable outside any
  strategy's variable creator (`plain_variable`), for the per-replica
  counters and ordering tokens of tf_agn's collectives; `tf.Variable` in a
  `MirroredStrategy` scope would be mirrored.
- `cross_device_ops.check_destinations`, `get_devices_from` (with the ops'
  `_canonicalize_devices`: `devices_of`) and `_make_tensor_into_per_replica`:
  how TensorFlow's cross-device ops read their `destinations` and values.
- `distribute_utils.regroup` and `values.Mirrored`: the per-replica results
  a `CrossDeviceOps` returns.
- `CollectiveAllReduceExtended._cross_device_ops`: a
  `MultiWorkerMirroredStrategy`'s all-reduce, which no public API replaces
  (`replace_cross_device_ops`) or reads (`cross_device_ops`).
- `ps_values.PerWorkerVariable`, its call-time handle capture,
  `ops.get_default_graph().capture_call_time_value` and `_unique_id`:
  worker-local variables that keep their program order
  (`ordered_per_worker`).
- `context.context().set_config_key_value` and `get_config_key_value`:
  the coordination service's key-value store, which every
  `MultiWorkerMirroredStrategy` worker reaches and no public API exposes;
  preemption notices agree on their step through it (`set_key_value`,
  `get_key_value`).
- `context.context().abort_collective_ops`: fails this process's pending
  and future collectives at once, as TensorFlow's own health check does
  once a peer stops beating; a worker whose peer was lost stops waiting
  for it (`abort_collectives`).
- `tsl.profiler.protobuf.xplane_pb2.XSpace`: the file the profiler writes
  (`*.xplane.pb`), which no public API reads; `benchmarks/step_profile.py`
  reads when kernels and collectives ran (`read_xspace`).

From Keras:

- `BaseOptimizer._backend_update_step`, `_apply_weight_decay` and
  `_clip_gradients`, backend-agnostic: they update in the calling context,
  where Keras' TensorFlow optimizer all-reduces and updates through
  `merge_call`; so NONE steps stay local and `steps_per_execution > 1`
  works (`InPlaceUpdates`, which tf_agn's optimizer classes place after
  the Keras class, so that a class's own override, Nadam's, still runs;
  `update_step`, `update_step_in_place`, `apply_weight_decay`,
  `clip_gradients_in_place`).
- `BaseOptimizer.add_variable_from_reference`, plain: Keras' TensorFlow
  optimizer colocates slots through the strategy, which
  `ParameterServerStrategy` refuses for worker-local weights
  (`slots_created_plainly`).
- Gradient accumulation's state: the accumulators `build` names
  (`KERAS_ACCUMULATOR_NAME`) and keeps in `_accumulated_gradients`
  (`accumulator_of`), `_get_variable_index` (`variable_index`), the
  micro-step count `_iterations` (`micro_step`), the name of a variable
  made from a reference (`reference_variable_name`) and `_track_variable`
  (`track_variable`): tf_agn makes replica-local accumulators, which
  `add_variable` has no argument for.
- `LossScaleOptimizer.check_finite`, where Keras' TensorFlow `apply`
  decides to skip a step, from each replica's own gradients (the step
  follows replica 0's), and its `save_own_variables`/`load_own_variables`,
  which save the inner optimizer's variables as they are (a replica's part
  of sharded state). `compile` creates the stock class, so it is patched
  (`replace_loss_scale_methods`) to ask the inner optimizer
  (`all_replicas_finite`) and to save sharded state whole, else the stock
  methods (`stock_loss_scale_method`); see `tf_agn.optimizers.loss_scaling`
  and `tf_agn.optimizers.saving`.
- `Trainer._initial_epoch`: the epoch `fit` starts from, which Keras' own
  `BackupAndRestore` sets; no public way for a callback
  (`set_initial_epoch`, for `tf_agn.callbacks.BackupAndRestore`).
- `LossFunctionWrapper` and `CompileMetrics`: what `compile` builds from
  the user's loss and metrics, for `DecoupledModel`, which compiles like a
  Keras model but is not one.
- `Trainer._compile_loss` and `_compile_metrics` (`compiled_loss`,
  `compiled_metrics`): the parameter-server trainer's own steps need the
  compiled loss without the model's own regularization losses (a
  `stateless_call` returns the worker's), and `update_state(y, y_pred)` of
  the compiled metrics alone.
- `Function._nodes_by_depth` (`nodes_by_depth`): a functional graph's
  nodes, which `split_model` cuts in topological order; Keras has no
  public traversal.
- `TFOptimizer._distribution_strategy` (`creation_strategy`): the strategy
  an optimizer was created under and updates through: its default
  aggregation, the replicas a windowed optimizer commits on, and a clear
  error under another strategy.
- `BaseOptimizer._trainable_variables` (`built_variables`): the variables
  an optimizer was built for, whose centers a windowed optimizer keeps.
- `BaseOptimizer._learning_rate` (`learning_rate_source`): the rate as
  given (variable, `LearningRateSchedule` or callable); the public
  `learning_rate` evaluates the latter two.
- `BaseOptimizer._exclude_from_weight_decay`, `_exclude_from_weight_decay_pattern`
  and `_exclude_from_weight_decay_cache`: what `exclude_from_weight_decay`
  was told, which `get_config` leaves out, so an optimizer rebuilt from its
  config would decay what the user excluded
  (`copy_weight_decay_exclusions`, for the wrapped optimizers;
  `excluded_weight_decay_names`, which a saved config keeps).
- `BaseOptimizer._backend_apply_gradients`, which
  `tf_agn.optimizers.Aggregating` overrides to run its own step (it
  decays, clips and updates after the all-reduce: `apply_weight_decay`,
  `clip_gradients_in_place`, `update_step`), then Keras's moving average
  of the weights (`update_moving_average`, with
  `_update_model_variables_moving_average` and
  `_overwrite_model_variables_with_average_value`).
"""

import contextlib
import json
import os
import warnings
import zipfile

import keras
from keras.src.losses.losses import LossFunctionWrapper  # noqa: F401
from keras.src.optimizers import base_optimizer as _keras_base_optimizer
from keras.src.trainers.compile_utils import CompileMetrics  # noqa: F401
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops
from tensorflow.python.distribute import distribute_utils as _tf_distribute_utils
from tensorflow.python.distribute import ps_values as _tf_ps_values
from tensorflow.python.distribute import values as _tf_values
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.framework import ops as _tf_framework_ops
from tensorflow.python.ops import resource_variable_ops as _tf_resource_variable_ops

# The corners CI tests, each a constraints file in .ci/constraints/ (the
# README's environment, TensorFlow 2.21 with Keras 3.15 on Python 3.11, lies
# between them). `setup.py` requires the oldest; between the oldest and the
# newest, importing tf_agn is silent.
TESTED_VERSIONS = {
    "oldest": {"python": "3.11", "tensorflow": "2.20", "keras": "3.10"},
    "newest": {"python": "3.12", "tensorflow": "2.21", "keras": "3.15"},
}

Mirrored = _tf_values.Mirrored
check_destinations = _tf_cross_device_ops.check_destinations


def devices_of(value, ops):
    """The device names of `value` (a distributed value, a variable or a
    device string), canonicalized as the `CrossDeviceOps` `ops` was told
    to (its constructor's `canonicalize_devices`)."""
    return _tf_cross_device_ops.get_devices_from(value, ops._canonicalize_devices)

make_tensor_into_per_replica = _tf_cross_device_ops._make_tensor_into_per_replica
regroup = _tf_distribute_utils.regroup


def plain_variable(initial_value, dtype, device):
    """A resource variable on `device`, made eagerly and outside any
    strategy's variable creator, whatever context the caller is in."""
    with tf.init_scope(), tf.device(device):
        return _tf_resource_variable_ops.ResourceVariable(
            initial_value, dtype=dtype, trainable=False
        )


def cross_device_ops(extended, required=True):
    """The `CrossDeviceOps` a strategy's `extended` reduces with.

    Args:
        extended: a strategy's `extended`.
        required: whether to raise, rather than return None, for a strategy
            without cross-device ops (`OneDeviceStrategy`, the default one).

    Raises:
        RuntimeError: if `required` and this TensorFlow keeps them elsewhere.
    """
    ops = getattr(extended, "_cross_device_ops", None)
    if not isinstance(ops, _tf_cross_device_ops.CrossDeviceOps):
        if not required:
            return None
        raise RuntimeError(
            f"This TensorFlow's {type(extended).__name__} keeps no "
            "CrossDeviceOps in `_cross_device_ops`; tf_agn cannot read or "
            "install its all-reduce. Use a tested TensorFlow version."
        )
    return ops


def replace_cross_device_ops(extended, ops):
    """Makes `extended` (a `MultiWorkerMirroredStrategy`'s) reduce over its
    compute devices with the `CrossDeviceOps` `ops` instead of the ones it has
    (TensorFlow's `CollectiveAllReduce`, unless replaced before).
    Host-tensor reductions keep TensorFlow's ops."""
    cross_device_ops(extended)  # raises if TensorFlow moved them
    extended._cross_device_ops = ops


class _OrderedPerWorkerVariable(_tf_ps_values.PerWorkerVariable):
    """A `PerWorkerVariable` whose handle is captured once per function."""

    @property
    def handle(self):
        if tf.executing_eagerly():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        # TensorFlow 2.21 captures the handle anew at every use in a traced
        # function, so automatic control dependencies see unrelated
        # resources and may move a read before an earlier write (b/286052052,
        # in TensorFlow's own docstring). One capture per variable, by key,
        # restores the ordering every other variable has.
        closure, spec = self.handle_call_time_value()
        return _tf_framework_ops.get_default_graph().capture_call_time_value(
            closure, spec, key=("tf_agn_per_worker", id(self))
        )


def ordered_per_worker(variable):
    """Makes a `PerWorkerVariable` keep its program order in functions.

    Args:
        variable: a variable `ParameterServerStrategy` created with
            `per_worker_variable=True`.

    Returns:
        `variable`, ordered.

    Raises:
        RuntimeError: if this TensorFlow made it something else.
    """
    if not isinstance(variable, _tf_ps_values.PerWorkerVariable):
        raise RuntimeError(
            f"Expected TensorFlow's PerWorkerVariable, got {type(variable).__name__}: "
            "this TensorFlow changed per-worker variables. Use a tested version."
        )
    # Only how a function captures the handle changes: swap the class in
    # place rather than rebuild what the strategy built.
    variable.__class__ = _OrderedPerWorkerVariable
    # TensorFlow leaves it None for per-worker variables; Keras optimizers
    # key their state by it.
    variable._unique_id = f"per_worker_{id(variable)}"
    return variable


class InPlaceUpdates(keras.optimizers.Optimizer):
    """The base tf_agn's optimizer classes place after the Keras class they
    extend: its updates and weight decay run in the context they are
    called in (each replica on its own copy, in replica context), without
    the all-reduce and `merge_call` of Keras' TensorFlow optimizer.

    A Keras class's own `_backend_update_step` still runs first: Nadam's
    updates its product of momentum factors there, and its `super()` call
    lands here.
    """

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        _keras_base_optimizer.BaseOptimizer._backend_update_step(
            self, grads, trainable_variables, learning_rate
        )

    def _apply_weight_decay(self, variables):
        _keras_base_optimizer.BaseOptimizer._apply_weight_decay(self, variables)


def apply_weight_decay(optimizer, variables):
    """Applies `optimizer`'s weight decay to `variables`, through its class's
    own `_apply_weight_decay` (in the current context for tf_agn's classes,
    `InPlaceUpdates`)."""
    optimizer._apply_weight_decay(variables)


def copy_weight_decay_exclusions(source, target):
    """Gives `target` the variables and names `source` was told to exclude
    from weight decay (`exclude_from_weight_decay`); before `target` is
    built."""
    # Keras keeps the excluded variables by `_var_key` (their id) and the
    # names as one compiled pattern; neither is in `get_config`.
    target._exclude_from_weight_decay = set(getattr(source, "_exclude_from_weight_decay", ()))
    target._exclude_from_weight_decay_pattern = getattr(
        source, "_exclude_from_weight_decay_pattern", None
    )
    target._exclude_from_weight_decay_cache = {}


def excluded_weight_decay_names(optimizer):
    """The pattern of names `optimizer` excludes from weight decay (its
    `exclude_from_weight_decay(var_names=...)`, joined as Keras joins them),
    or None."""
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    return None if pattern is None else pattern.pattern


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable` (not excluded by name or by
    `exclude_from_weight_decay`)."""
    return optimizer._use_weight_decay(variable)


def update_step(optimizer, grads, variables, learning_rate):
    """Runs `optimizer`'s own `_backend_update_step`: for tf_agn's classes,
    the Keras class's update rule in the current context (`InPlaceUpdates`)."""
    optimizer._backend_update_step(grads, variables, learning_rate)


def update_moving_average(optimizer):
    """Keras's step of `optimizer`'s moving average of the weights
    (`use_ema`), as its `_backend_apply_gradients` ends."""
    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        should_overwrite_model_vars = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0
        keras.ops.cond(
            should_overwrite_model_vars,
            lambda: optimizer._overwrite_model_variables_with_average_value(
                optimizer._trainable_variables
            ),
            lambda: None,
        )


def update_step_in_place(optimizer, grads, variables, learning_rate):
    """Runs the update rule of `optimizer`, a Keras optimizer that is not
    tf_agn's, on `variables` in the current context, without the all-reduce
    and `merge_call` of Keras' TensorFlow optimizer.

    Raises:
        ValueError: as `check_updates_in_place`.
    """
    check_updates_in_place(optimizer)
    _keras_base_optimizer.BaseOptimizer._backend_update_step(
        optimizer, grads, variables, learning_rate
    )


def check_updates_in_place(optimizer):
    """Raises unless `update_step_in_place` runs all of `optimizer`'s update.

    Raises:
        ValueError: for an optimizer whose class keeps state in its own
            `_backend_update_step` (Keras' Nadam), which it would skip.
    """
    for cls in type(optimizer).__mro__:
        if cls is keras.optimizers.Optimizer:
            break
        if "_backend_update_step" in vars(cls):
            raise ValueError(
                f"{cls.__name__} updates state of its own once per step, which "
                "tf_agn cannot run on its own here (a windowed optimizer's "
                "outer optimizer, a parameter-server worker's inner one); use "
                "another optimizer, such as Adam, there."
            )


def clip_gradients_in_place(optimizer, grads):
    """Clips `grads` by `optimizer`'s `clipnorm`, `global_clipnorm` and
    `clipvalue`, as Keras' base optimizer does."""
    return _keras_base_optimizer.BaseOptimizer._clip_gradients(optimizer, grads)


# The name Keras' `BaseOptimizer.build` passes to
# `add_variable_from_reference` for each gradient accumulator.
KERAS_ACCUMULATOR_NAME = "gradient_accumulator"


def accumulator_of(optimizer, variable):
    """`optimizer`'s gradient accumulator for the trainable `variable`."""
    return optimizer._accumulated_gradients[variable_index(optimizer, variable)]


def accumulators(optimizer):
    """`optimizer`'s gradient accumulators, one per trainable variable."""
    return list(optimizer._accumulated_gradients)


def register_variable_alias(optimizer, alias, variable):
    """Makes `optimizer` find `variable`'s state when its `update_step` is
    given `alias` (a variable holding one replica's part of it)."""
    optimizer._trainable_variables_indices[optimizer._var_key(alias)] = variable_index(
        optimizer, variable
    )


def variable_index(optimizer, variable):
    """The position of the trainable `variable` among those `optimizer`
    was built with."""
    return optimizer._get_variable_index(variable)


def micro_step(optimizer):
    """The steps `optimizer` has taken, counting each accumulated one."""
    return optimizer._iterations


def reference_variable_name(reference_variable, name):
    """The name Keras gives an optimizer variable made from a model one."""
    return f"{reference_variable.path.replace('/', '_')}_{name}"


def track_variable(optimizer, variable):
    """Makes `variable` one of `optimizer.variables`, saved with it."""
    optimizer._track_variable(variable)


def compiled_loss(model):
    """The loss `model.compile` built, a callable
    `(y, y_pred, sample_weight=None)` that returns the compiled loss alone
    (no regularization losses); None before `compile`."""
    return model._compile_loss


def compiled_metrics(model):
    """The `CompileMetrics` `model.compile` built from its `metrics`
    argument, or None when it was given none."""
    return model._compile_metrics


def nodes_by_depth(functional):
    """`{depth: [node, ...]}` of a functional model's graph: the output's
    node is at depth 0, and a node is deeper than every node it feeds."""
    return functional._nodes_by_depth


def creation_strategy(optimizer):
    """The `tf.distribute.Strategy` that was in scope when `optimizer` was
    created, which Keras' TensorFlow optimizer updates its variables
    through."""
    return optimizer._distribution_strategy


def built_variables(optimizer):
    """The trainable variables `optimizer` was built for, in `build`'s
    order."""
    return optimizer._trainable_variables


def learning_rate_source(optimizer):
    """`optimizer`'s learning rate as it keeps it: the variable among its
    `variables`, a `LearningRateSchedule`, or a callable."""
    return optimizer._learning_rate


def set_initial_epoch(model, epoch):
    """Makes `model.fit`, called now or from `on_train_begin`, start at
    `epoch` (None: at fit's `initial_epoch` argument)."""
    model._initial_epoch = epoch


@contextlib.contextmanager
def slots_created_plainly(optimizer):
    """While active, `optimizer` creates its slots without asking its
    strategy to colocate them with their weights.

    Args:
        optimizer: a Keras optimizer, about to be built on worker-local
            weights.

    Yields:
        Nothing.
    """
    plain = _keras_base_optimizer.BaseOptimizer.add_variable_from_reference
    optimizer.add_variable_from_reference = lambda *args, **kwargs: plain(
        optimizer, *args, **kwargs
    )
    try:
        yield
    finally:
        del optimizer.add_variable_from_reference


# The private methods of Keras' and TensorFlow's classes that tf_agn's
# classes override, each with what calls it and the test that checks it
# still does. tests/test_compat.py fails on an override that is not listed
# here, and on an entry that no tf_agn class overrides.
OVERRIDDEN_PRIVATE_METHODS = {
    # tf_agn.optimizers.Aggregating: where Keras's TensorFlow optimizer
    # clips, all-reduces and applies, which tf_agn's step does its own way.
    "_backend_apply_gradients": "`apply` calls it with the gradients "
    "(test_compat::test_aggregating_overrides_keras_optimizer_hooks).",
    # tf_agn._compat.InPlaceUpdates: Keras's TensorFlow optimizer updates and
    # decays through `merge_call`; these run in the calling context, after the
    # Keras class (test_in_place_updates_run_a_keras_classs_own_update_step).
    "_backend_update_step": "`_backend_apply_gradients` calls it to update "
    "(test_aggregating_overrides_keras_optimizer_hooks).",
    "_apply_weight_decay": "`_backend_apply_gradients` decays with it "
    "(test_aggregating_overrides_keras_optimizer_hooks).",
    # tf_agn.AggregatingAllReduce: hooks of tf.distribute.CrossDeviceOps.
    "_all_reduce": "a strategy's replica-context all-reduce in a traced step "
    "(MultiWorkerMirroredStrategy; MirroredStrategy in XLA on GPUs) calls it "
    "(test_multi_worker::test_all_reduce_of_ops_on_their_own_across_workers, "
    "and every multi-worker fit).",
    "_gather_implementation": "`CrossDeviceOps._gather` calls it "
    "(test_compat::test_cross_device_ops_private_hooks_are_called).",
    "_num_between_graph_workers": "`reduce` and `_gather` skip the reduction of "
    "a value already on its one destination when it is 1, which across workers "
    "would leave each worker's own (test_cross_device_ops_private_hooks_are_called).",
}


# The methods of Keras' `LossScaleOptimizer` tf_agn replaces, kept before
# it does.
_STOCK_LOSS_SCALE_METHODS = {
    name: getattr(keras.optimizers.LossScaleOptimizer, name, None)
    for name in (
        "check_finite", "_stateful_handle_finite_grads", "save_own_variables", "load_own_variables"
    )
}


def stock_loss_scale_method(name):
    """Keras' own `LossScaleOptimizer` method `name`, as it was before
    `replace_loss_scale_methods`."""
    return _STOCK_LOSS_SCALE_METHODS[name]


def replace_loss_scale_methods(**methods):
    """Makes every `keras.optimizers.LossScaleOptimizer` use `methods`
    (by name: `check_finite`, `_stateful_handle_finite_grads`,
    `save_own_variables`, `load_own_variables`).

    Raises:
        RuntimeError: if this Keras' class lacks one of them.
    """
    for name, method in methods.items():
        if not callable(_STOCK_LOSS_SCALE_METHODS.get(name)):
            raise RuntimeError(
                f"This Keras' LossScaleOptimizer has no {name}, which tf_agn "
                "replaces (to agree across replicas on skipping non-finite "
                "steps, and to save sharded state whole). Use a tested Keras "
                "version."
            )
        setattr(keras.optimizers.LossScaleOptimizer, name, method)


def _minor(version):
    return tuple(int(part) for part in version.split(".")[:2])


def untested_versions(versions=None):
    """The installed packages outside the range `TESTED_VERSIONS` spans.

    Args:
        versions: `{"tensorflow": "2.21.0", "keras": "3.15.1"}`; by default
            the installed ones.

    Returns:
        A list of `"name version"` strings, empty when all are tested.
    """
    if versions is None:
        versions = {"tensorflow": tf.__version__, "keras": keras.__version__}
    untested = []
    for name, version in versions.items():
        try:
            minor = _minor(version)
        except ValueError:  # tf-nightly's "2.22.0-dev20260101"
            minor = None
        low, high = (_minor(TESTED_VERSIONS[end][name]) for end in ("oldest", "newest"))
        if minor is None or not low <= minor <= high:
            untested.append(f"{name} {version}")
    return untested


def check_versions(versions=None):
    """Warns once if TensorFlow or Keras is outside `TESTED_VERSIONS`.

    Args:
        versions: as for `untested_versions`.
    """
    untested = untested_versions(versions)
    if untested:
        oldest, newest = TESTED_VERSIONS["oldest"], TESTED_VERSIONS["newest"]
        tested = ", ".join(f"{name} {oldest[name]} to {newest[name]}" for name in ("tensorflow", "keras"))
        warnings.warn(
            f"tf_agn is tested with {tested}; this process has "
            f"{', '.join(untested)}. tf_agn uses private TensorFlow and Keras "
            "API (tf_agn/_compat.py), which may have changed.",
            RuntimeWarning,
            stacklevel=2,
        )


def unreadable_keras_file(path):
    """Why this Keras cannot read the `.keras` file at `path`, or None.

    A Keras reads the files older releases wrote, not always newer ones':
    a test of a committed file skips with this reason on a Keras too old.

    Args:
        path: a `.keras` file.

    Returns:
        None, or a sentence naming the file's Keras, this one, and the error.
    """
    with zipfile.ZipFile(path) as archive:
        written = json.loads(archive.read("metadata.json"))["keras_version"]
        config = json.loads(archive.read("config.json"))
    if _minor(keras.__version__) >= _minor(written):
        return None
    # Chosen by behaviour: whether this Keras builds the file's model.
    config.pop("compile_config", None)
    try:
        keras.saving.deserialize_keras_object(config)
    except (TypeError, ValueError) as error:
        # Keras nests the layer's error under the model's, the config of each.
        cause = str(error).strip().splitlines()[-1]
        return (
            f"{os.path.basename(path)} was written by Keras {written}, which "
            f"Keras {keras.__version__} cannot read: {cause}"
        )
    return None


def set_key_value(key, value):
    """Sets `key` to the string `value` in the cluster's coordination
    service; raises `tf.errors.AlreadyExistsError` if it is set."""
    _tf_context.context().set_config_key_value(key, value)


def get_key_value(key, timeout_ms):
    """`key`'s value in the cluster's coordination service, waiting up to
    `timeout_ms` for it to be set (`tf.errors.DeadlineExceededError`)."""
    return _tf_context.context().get_config_key_value(key, timeout_ms)


def abort_collectives(message):
    """Makes every pending and future collective of this process raise
    `tf.errors.UnavailableError` with `message`; safe from any thread."""
    _tf_context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


def read_xspace(path):
    """The profiler trace in `path` (a `*.xplane.pb` file that
    `tf.profiler.experimental` wrote), as an `XSpace` message."""
    # Imported on use: only the benchmarks read traces.
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as trace:
        space.ParseFromString(trace.read())
    return space
