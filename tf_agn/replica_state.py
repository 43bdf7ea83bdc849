"""This process's replicas' own copies of variables, as named numpy arrays,
and back: what a `tf_agn.callbacks.BackupAndRestore` backup holds."""

import keras
import numpy as np


def local_copies(strategy, variables, prefix):
    """This process's replicas' copies of `variables`, as numpy arrays.

    Args:
        strategy: the strategy the variables were created under.
        variables: Keras or TensorFlow variables, in a fixed order.
        prefix: the first part of the arrays' names.

    Returns:
        A dict of arrays named "<prefix>/<variable index>/<local replica>".
        A replica's copy is left out where it equals local replica 0's.
    """
    arrays = {}
    for index, variable in enumerate(variables):
        # Every copy, not only replica 0's, which is all that Keras saves of a
        # `MirroredVariable`: with tf_agn's local steps (AGN and the other
        # windowed optimizers mid-window, aggregation NONE) the replicas'
        # weights and inner optimizer state (AGN's inner Adam moments) differ.
        copies = strategy.experimental_local_results(_tf_variable(variable))
        first = copies[0].numpy()
        arrays[f"{prefix}/{index}/0"] = first
        for replica, copy in enumerate(copies[1:], start=1):
            value = copy.numpy()
            if not np.array_equal(value, first):
                arrays[f"{prefix}/{index}/{replica}"] = value
    return arrays


def assign_local_copies(strategy, variables, arrays, prefix):
    """Puts `local_copies`'s arrays back on each replica's copy of each
    variable (replica 0's where the replica's own was left out).

    Args:
        strategy: the strategy the variables were created under.
        variables: the variables, in the order they were saved in.
        arrays: what `local_copies` returned, among other arrays.
        prefix: the prefix `local_copies` was given.

    Raises:
        ValueError: if `arrays` hold another number of variables, or one of
            another shape.
    """
    saved = sum(1 for key in arrays if key.startswith(prefix + "/") and key.endswith("/0"))
    if saved != len(variables):
        raise ValueError(
            f"The backup holds {saved} {prefix} variables; this model has "
            f"{len(variables)}. Was it taken from another model or optimizer?"
        )
    for index, variable in enumerate(variables):
        first = arrays[f"{prefix}/{index}/0"]
        copies = strategy.experimental_local_results(_tf_variable(variable))
        if tuple(first.shape) != tuple(copies[0].shape):
            raise ValueError(
                f"The backup's {prefix} variable {index} has shape "
                f"{first.shape}; this model's ({variable.name}) has "
                f"{tuple(copies[0].shape)}. Was it taken from another model?"
            )
        for replica, copy in enumerate(copies):
            copy.assign(arrays.get(f"{prefix}/{index}/{replica}", first))


def assign_every_copy(strategy, variables, values):
    """Puts `values[i]` on each of this process's replicas' copies of
    `variables[i]`."""
    for variable, value in zip(variables, values, strict=True):
        for copy in strategy.experimental_local_results(_tf_variable(variable)):
            copy.assign(value)


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras one (a distributed variable
    under a strategy)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
