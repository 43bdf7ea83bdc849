"""`per_worker_variables`: worker-local variables that keep their program
order inside a traced function."""

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
        # `ParameterServerStrategy` gives every worker its own copy.
        kwargs["per_worker_variable"] = True
        # In TensorFlow 2.21 a traced function may move a read of such a
        # variable before an earlier write: a local optimizer step could
        # read weights its previous step had not yet written.
        return _compat.ordered_per_worker(next_creator(**kwargs))

    with tf.variable_creator_scope(creator):
        yield
