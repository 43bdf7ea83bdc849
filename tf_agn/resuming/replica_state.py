"""Replicas' own copies of variables as named numpy arrays, and back."""

import keras
import numpy as np


def local_copies(strategy, variables, prefix):
    """This process's replicas' copies of `variables`, named
    "<prefix>/<variable index>/<local replica>"; a copy equal to replica
    0's is left out."""
    arrays = {}
    for index, variable in enumerate(variables):
        # Keras saves only replica 0's copy; local steps make copies differ.
        copies = strategy.experimental_local_results(tf_variable(variable))
        first = copies[0].numpy()
        arrays[f"{prefix}/{index}/0"] = first
        for replica, copy in enumerate(copies[1:], start=1):
            value = copy.numpy()
            if not np.array_equal(value, first):
                arrays[f"{prefix}/{index}/{replica}"] = value
    return arrays


def assign_local_copies(strategy, variables, arrays, prefix):
    """Puts `local_copies`'s `arrays` back on every replica's copy; raises
    ValueError where their number or shapes differ from `variables`'."""
    saved = sum(1 for key in arrays if key.startswith(prefix + "/") and key.endswith("/0"))
    if saved != len(variables):
        raise ValueError(
            f"The backup holds {saved} {prefix} variables; this model has "
            f"{len(variables)}. Was it taken from another model or optimizer?"
        )
    for index, variable in enumerate(variables):
        first = arrays[f"{prefix}/{index}/0"]
        copies = strategy.experimental_local_results(tf_variable(variable))
        if tuple(first.shape) != tuple(copies[0].shape):
            raise ValueError(
                f"The backup's {prefix} variable {index} has shape "
                f"{first.shape}; this model's ({variable.name}) has "
                f"{tuple(copies[0].shape)}. Was it taken from another model?"
            )
        for replica, copy in enumerate(copies):
            copy.assign(arrays.get(f"{prefix}/{index}/{replica}", first))


def assign_every_copy(strategy, variables, values):
    """Puts `values[i]` on every local copy of `variables[i]`."""
    for variable, value in zip(variables, values, strict=True):
        for copy in strategy.experimental_local_results(tf_variable(variable)):
            copy.assign(value)


def tf_variable(variable):
    """The TensorFlow variable under a Keras one (a distributed one under a
    strategy)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
