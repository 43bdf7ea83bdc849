"""Worker-local variables that keep their program order inside a function.

`ParameterServerStrategy` gives every worker its own copy of a variable
created with `per_worker_variable=True`. TensorFlow 2.21 captures such a
variable's handle anew at every use in a traced function, so automatic
control dependencies see unrelated resources and may reorder a read before
an earlier write (TensorFlow's own docstring lists this, b/286052052): a
local optimizer step could read weights its previous step had not yet
written. Capturing the handle once per function, keyed by the variable,
restores the ordering every other variable has.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.eager import context
from tensorflow.python.framework import ops as framework_ops


class OrderedPerWorkerVariable(ps_values.PerWorkerVariable):
    """A `PerWorkerVariable` whose handle is captured once per function."""

    @property
    def handle(self):
        if context.executing_eagerly():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        # One key per variable: every use in the graph shares a placeholder.
        return framework_ops.get_default_graph().capture_call_time_value(
            closure, spec, key=("tf_agn_per_worker", id(self))
        )


@contextlib.contextmanager
def per_worker_variables(strategy):
    """Variables created in this scope are worker-local, in program order.

    Outside `ParameterServerStrategy` (the simulator, tests) it creates
    ordinary variables.

    Args:
        strategy: the current `tf.distribute.Strategy`.

    Yields:
        Nothing; use it as `with per_worker_variables(strategy): ...`.
    """
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        yield
        return

    def creator(next_creator, **kwargs):
        kwargs["per_worker_variable"] = True
        variable = next_creator(**kwargs)
        # The strategy builds the variable; only its handle capture changes.
        variable.__class__ = OrderedPerWorkerVariable
        # TensorFlow leaves it None for per-worker variables; Keras
        # optimizers key their state by it.
        variable._unique_id = f"per_worker_{id(variable)}"
        return variable

    with tf.variable_creator_scope(creator):
        yield
