"""Every private TensorFlow and Keras API tf_agn relies on, and the
versions it is tested with.

Private modules change without notice between releases. Reaching them from
one module means the next release breaks one place, and `tests/test_compat.py`
checks each name below, so that the break is a clear test failure rather
than a wrong number in training. Importing tf_agn under a TensorFlow or
Keras outside `TESTED_VERSIONS` warns once (`check_versions`).

What we need from TensorFlow, and why:

- `resource_variable_ops.ResourceVariable`: a variable made outside any
  strategy's variable creator (`plain_variable`), for the per-replica
  instance-key counters and ordering tokens of tf_agn's collectives, as
  TensorFlow's own collective launcher makes its tokens. `tf.Variable`
  under a `MirroredStrategy` scope would make a mirrored variable.
- `cross_device_ops.check_destinations`, `get_devices_from` (with the
  ops' private `_canonicalize_devices` flag: `devices_of`) and
  `_make_tensor_into_per_replica`: how TensorFlow's own cross-device ops
  read the `destinations` and values they are given.
- `distribute_utils.regroup` and `values.Mirrored`: building the
  per-replica results a `CrossDeviceOps` must return.
- `CollectiveAllReduceExtended._cross_device_ops`: where a
  `MultiWorkerMirroredStrategy` keeps its all-reduce; there is no public
  argument to give it another (`replace_cross_device_ops`), nor to read it
  (`cross_device_ops`, for benchmarks that compare against it).
- `ps_values.PerWorkerVariable`, its call-time handle capture, and
  `ops.get_default_graph().capture_call_time_value`: worker-local variables
  whose reads and writes keep their program order (`ordered_per_worker`).

What we need from Keras, and why:

- `BaseOptimizer._backend_update_step`, `_apply_weight_decay` and
  `_clip_gradients`, the backend-agnostic versions: they update each
  variable in the context they are called in. Keras' TensorFlow optimizer
  overrides them to all-reduce and then update every replica through
  `merge_call`; tf_agn communicates by itself and updates each replica's
  copy in replica context, which is what lets NONE steps stay local and
  `steps_per_execution > 1` work (`update_step_in_place`,
  `apply_weight_decay_in_place`, `clip_gradients_in_place`).
- `BaseOptimizer.add_variable_from_reference`: Keras' TensorFlow
  optimizer colocates its slots with their weights through the strategy,
  which `ParameterServerStrategy` refuses for worker-local weights
  (`slots_created_plainly`).
- Gradient accumulation's state: the accumulators Keras' `build` asks
  for by name (`KERAS_ACCUMULATOR_NAME`, `accumulator_of`), the micro-step
  count `_iterations` (`iterations` counts applied steps), the name Keras
  gives a variable made from a reference (`reference_variable_name`), and
  `_track_variable`, which makes a variable one of the optimizer's
  (`track_variable`): tf_agn makes the accumulators replica-local, which
  `add_variable` has no argument for.
- `LossScaleOptimizer.check_finite` as the decision point of Keras'
  TensorFlow `apply`: under a strategy it is called on each replica's own
  gradients before any all-reduce, and the step follows replica 0's answer,
  so an overflow on another replica reaches every replica's weights.
  `keras.Model.compile` creates the stock class by itself under
  `mixed_float16`, so a subclass would never be used: tf_agn replaces the
  method on the class (`replace_loss_scale_check_finite`) with one that asks
  the inner optimizer, when it has `all_replicas_finite`, and otherwise
  calls the stock method (`stock_loss_scale_check_finite`); see
  `tf_agn.optimizers.loss_scaling`.
- `Trainer._initial_epoch`: the epoch Keras's TensorFlow `fit` starts
  from when set, which its own `BackupAndRestore` sets; a callback has no
  public way to move `fit`'s start (`set_initial_epoch`, for
  `tf_agn.callbacks.BackupAndRestore`).
- `LossFunctionWrapper` and `CompileMetrics`: the loss and metrics objects
  `keras.Model.compile` builds from what users pass, for `DecoupledModel`,
  which compiles like a Keras model but is not one.
- `Trainer._compile_loss` and `_compile_metrics`: the loss and metrics
  objects a compiled model keeps (`compiled_loss`, `compiled_metrics`).
  The parameter-server trainer runs its own steps and evaluation rather
  than `fit`'s, so it calls them directly: the public `compute_loss` adds
  the losses of the model's own state, not those a `stateless_call` with a
  worker's weights returns, and `model.metrics` has no
  `update_state(y, y_pred)` for the compiled metrics alone.
- `Function._nodes_by_depth`: the nodes of a functional model's graph by
  their depth from the output (`nodes_by_depth`), which `split_model` cuts
  in topological order; Keras has no public traversal of a graph's nodes.
- `TFOptimizer._distribution_strategy`: the strategy in scope when a
  Keras optimizer was created, which it updates through from then on
  (`creation_strategy`): its default aggregation, the replicas a windowed
  optimizer's commits run on, and a clear error when an optimizer is used
  under another strategy.
- `BaseOptimizer._trainable_variables`: the variables an optimizer was
  built for (`built_variables`), whose centers a windowed optimizer keeps
  and swaps; `build` takes them but no public attribute gives them back.
- `BaseOptimizer._learning_rate`: the learning rate as it was given, a
  variable, a `LearningRateSchedule` or a callable (`learning_rate_source`);
  the public `learning_rate` evaluates the latter two, hiding which
  variable of `optimizer.variables` is the rate and whether a schedule is
  checkable before training.
- `BaseOptimizer._backend_apply_gradients`, `_clip_gradients`,
  `_apply_weight_decay` and `_backend_update_step` as hooks:
  `tf_agn.optimizers.Aggregating` overrides them, calling Keras' own
  through `super()` or the functions above, to clip after the all-reduce,
  route accumulated steps through tf_agn and communicate by itself.
"""

import contextlib
import warnings

import keras
from keras.src.losses.losses import LossFunctionWrapper  # noqa: F401
from keras.src.optimizers import base_optimizer as _keras_base_optimizer
from keras.src.trainers.compile_utils import CompileMetrics  # noqa: F401
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops
from tensorflow.python.distribute import distribute_utils as _tf_distribute_utils
from tensorflow.python.distribute import ps_values as _tf_ps_values
from tensorflow.python.distribute import values as _tf_values
from tensorflow.python.framework import ops as _tf_framework_ops
from tensorflow.python.ops import resource_variable_ops as _tf_resource_variable_ops

# (TensorFlow, Keras) releases CI runs: `setup.py` declares the same range.
TESTED_VERSIONS = {"tensorflow": ("2.21", "2.22"), "keras": ("3.15", "3.16")}

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
    """A `PerWorkerVariable` whose handle is captured once per function.

    TensorFlow 2.21 captures a per-worker variable's handle anew at every
    use in a traced function, so automatic control dependencies see
    unrelated resources and may reorder a read before an earlier write
    (TensorFlow's own docstring lists this, b/286052052). One capture per
    variable restores the ordering every other variable has.
    """

    @property
    def handle(self):
        if tf.executing_eagerly():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        return _tf_framework_ops.get_default_graph().capture_call_time_value(
            closure, spec, key=("tf_agn_per_worker", id(self))
        )


def ordered_per_worker(variable):
    """Makes a `PerWorkerVariable` keep its program order in functions.

    The strategy builds the variable; only how a function captures its
    handle changes, so the class is swapped in place rather than the
    variable rebuilt.

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
    variable.__class__ = _OrderedPerWorkerVariable
    # TensorFlow leaves it None for per-worker variables; Keras optimizers
    # key their state by it.
    variable._unique_id = f"per_worker_{id(variable)}"
    return variable


def update_step_in_place(optimizer, grads, variables, learning_rate):
    """Runs `optimizer`'s update rule on `variables` in the current context,
    without the all-reduce and `merge_call` of Keras' TensorFlow optimizer."""
    _keras_base_optimizer.BaseOptimizer._backend_update_step(
        optimizer, grads, variables, learning_rate
    )


def apply_weight_decay_in_place(optimizer, variables):
    """Applies `optimizer`'s weight decay to `variables` in the current
    context (each replica's own copy, in replica context)."""
    _keras_base_optimizer.BaseOptimizer._apply_weight_decay(optimizer, variables)


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
    # clips, all-reduces and applies, which tf_agn does its own way.
    "_backend_apply_gradients": "`apply` calls it with the gradients "
    "(test_compat::test_aggregating_overrides_keras_optimizer_hooks).",
    "_backend_update_step": "`_backend_apply_gradients` calls it to all-reduce "
    "and update (test_aggregating_overrides_keras_optimizer_hooks).",
    "_clip_gradients": "`_backend_apply_gradients` clips with it before the "
    "all-reduce (test_aggregating_overrides_keras_optimizer_hooks).",
    "_apply_weight_decay": "`apply` decays with it through `merge_call` "
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


# Keras' own `LossScaleOptimizer.check_finite`, kept before it is replaced.
_STOCK_LOSS_SCALE_CHECK_FINITE = keras.optimizers.LossScaleOptimizer.check_finite


def stock_loss_scale_check_finite(loss_scale_optimizer, grads):
    """Keras' `LossScaleOptimizer.check_finite`: whether this replica's own
    `grads` are all finite."""
    return _STOCK_LOSS_SCALE_CHECK_FINITE(loss_scale_optimizer, grads)


def replace_loss_scale_check_finite(check_finite):
    """Makes every `keras.optimizers.LossScaleOptimizer` decide whether to
    apply a step (or skip it and halve its scale) with
    `check_finite(loss_scale_optimizer, grads)`.

    Raises:
        RuntimeError: if this Keras' class has no `check_finite` to replace.
    """
    if not callable(getattr(keras.optimizers.LossScaleOptimizer, "check_finite", None)):
        raise RuntimeError(
            "This Keras' LossScaleOptimizer has no check_finite; tf_agn cannot "
            "make replicas agree on skipping non-finite steps. Use a tested "
            "Keras version."
        )
    keras.optimizers.LossScaleOptimizer.check_finite = check_finite


def _minor(version):
    return tuple(int(part) for part in version.split(".")[:2])


def untested_versions(versions=None):
    """The installed packages outside `TESTED_VERSIONS`.

    Args:
        versions: `{"tensorflow": "2.21.0", "keras": "3.15.1"}`; by default
            the installed ones.

    Returns:
        A list of `"name version"` strings, empty when all are tested.
    """
    if versions is None:
        versions = {"tensorflow": tf.__version__, "keras": keras.__version__}
    untested = []
    for name, (low, high) in TESTED_VERSIONS.items():
        try:
            minor = _minor(versions[name])
        except ValueError:
            minor = None
        if minor is None or not _minor(low) <= minor < _minor(high):
            untested.append(f"{name} {versions[name]}")
    return untested


def check_versions(versions=None):
    """Warns once if TensorFlow or Keras is outside `TESTED_VERSIONS`.

    Args:
        versions: as for `untested_versions`.
    """
    untested = untested_versions(versions)
    if untested:
        tested = ", ".join(
            f"{name} >={low},<{high}" for name, (low, high) in TESTED_VERSIONS.items()
        )
        warnings.warn(
            f"tf_agn is tested with {tested}; this process has "
            f"{', '.join(untested)}. tf_agn uses private TensorFlow and Keras "
            "API (tf_agn/_compat.py), which may have changed.",
            RuntimeWarning,
            stacklevel=2,
        )
