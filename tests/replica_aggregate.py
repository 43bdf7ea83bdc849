"""`aggregate`: `tf_agn.aggregate` on every replica of a strategy, called
from cross-replica context (eagerly or inside a `tf.function`), for the
tests of transports and compressors."""

import tensorflow as tf

import tf_agn

# {ids of a call's `states`: (those states, the variables made for them)}.
_VARIABLES = {}


def aggregate(strategy, method, values, value_scale=1, compressor=None, states=None, step=None):
    """Every replica's `tf_agn.aggregate` of its component of `values`.

    Args:
        strategy: the strategy whose replicas aggregate.
        method, value_scale, compressor, step: as `tf_agn.aggregate` takes
            them.
        values: distributed values (`PerReplica`), one per value.
        states: for a stateful compressor: one dict per value from a state's
            name to a `PerReplica` value of every replica's state. Each
            replica's state goes into a replica-local variable that
            `tf_agn.aggregate` reads and assigns, as an optimizer's does.

    Returns:
        The combined values, one distributed value each; with `states`,
        `(combined, new_states)`, `new_states` laid out like `states`.
    """
    variables = None
    if states is not None:
        # Once per `states`: a `tf.function` traces the first call twice,
        # and makes variables in the first trace only.
        key = tuple(id(s) for s in tf.nest.flatten(states))
        if key not in _VARIABLES:
            with tf.init_scope(), strategy.scope():
                made = tf.nest.map_structure(_replica_local_variable, states)
            # Holding `states` keeps its ids from being reused.
            _VARIABLES[key] = (states, made)
        _, variables = _VARIABLES[key]

    def replica_step(values, states):
        if states is not None:
            for variable, value in zip(tf.nest.flatten(variables), tf.nest.flatten(states)):
                variable.assign(value)
        combined = tf_agn.aggregate(
            list(values), method, value_scale=value_scale, compressor=compressor,
            state=variables, step=step,
        )
        if states is None:
            return combined, None
        return combined, tf.nest.map_structure(lambda v: v.read_value(), variables)

    combined, new_states = strategy.run(replica_step, args=(list(values), states))
    return combined if states is None else (combined, new_states)


def _replica_local_variable(value):
    like = value.values[0] if hasattr(value, "values") else value
    return tf.Variable(
        tf.zeros(like.shape, like.dtype),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.MEAN,
    )
