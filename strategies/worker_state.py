"""Worker-local variables that keep their program order inside a function.

`ParameterServerStrategy` gives every worker its own copy of a variable
created with `per_worker_variable=True`. In TensorFlow 2.21 a traced
function may reorder a read of such a variable before an earlier write
(see `tf_agn._compat.ordered_per_worker`): a local optimizer step could
read weights its previous step had not yet written. Variables created
here are made to keep their order.
"""

import contextlib

import tensorflow as tf

from tf_agn import _compat


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
        return _compat.ordered_per_worker(next_creator(**kwargs))

    with tf.variable_creator_scope(creator):
        yield
