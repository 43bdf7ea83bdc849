"""A stateful compressor's per-replica state, kept as optimizer variables.

`tf_agn.compression.Int8` and `PowerSGD` keep the residual compression
dropped (and PowerSGD its warm-started Q) in one replica-local variable per
trainable variable and kind of state (`dense_kernel_residual`, ...).

Sparse gradients (`tf.IndexedSlices`) travel uncompressed and need no
state: name their variables in `sparse_gradients`, regular expressions
searched for in each variable's `path` (a layer's name is the surest):

```python
model = keras.Sequential([
    keras.Input((10,), dtype="int32"),
    keras.layers.Embedding(100_000, 64, name="words"),
    keras.layers.GlobalAveragePooling1D(),
    keras.layers.Dense(10),
])
model.compile(
    tf_agn.optimizers.Adam(compression="int8", sparse_gradients=["words"]),
    loss="sparse_categorical_crossentropy",
)
# int8 keeps residuals for the Dense layer's kernel and bias only.
```
"""

import re
import warnings

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression


def check_sparse_gradients(patterns):
    """`patterns` (None, or a list or tuple of regular expressions) as a list."""
    if patterns is None:
        return None
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise ValueError(
            "sparse_gradients must be None or a list of regular expressions "
            f"naming variables; received {patterns!r}."
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (TypeError, re.error) as error:
            raise ValueError(
                f"sparse_gradients holds {pattern!r}, which is not a regular "
                f"expression: {error}."
            ) from None
    return list(patterns)


def declared_sparse(patterns, variable):
    """Whether one of `patterns` is found in `variable`'s path."""
    return any(re.search(pattern, variable.path) for pattern in patterns or ())


def add_compressor_state(optimizer, variables, compressor, sparse_gradients=None):
    """Makes `compressor`'s per-replica state for each of `variables`.

    Returns:
        One dict per variable, from a state's name to its `keras.Variable`
        (empty where there is no state).
    """
    states = []
    for variable in variables:
        state = {}
        # The user names sparse variables: Keras builds the optimizer before
        # any gradient exists, and lazy state would break `.keras` loading.
        if declared_sparse(sparse_gradients, variable) or not compression.compresses(
            compressor, variable
        ):
            states.append(state)  # It travels uncompressed.
            continue
        for name, spec in sorted(compressor.state_spec(variable.shape).items()):
            # Saved, owed state is the replicas' sum, which TensorFlow shares
            # out equally when assigned back on any number of replicas.
            with keras.name_scope(optimizer.name, caller=optimizer):
                state[name] = keras.Variable(
                    initializer=spec.initializer,
                    shape=spec.shape,
                    dtype=variable.dtype,
                    trainable=False,
                    aggregation="sum" if spec.owed else "mean",
                    synchronization="on_read",
                    name=_compat.reference_variable_name(variable, name),
                )
            _compat.track_variable(optimizer, state[name])
        states.append(state)
    return states


def compressor_state_of(optimizer, variables, states):
    """The entries of `states` for `variables`, in their order."""
    return [states[_compat.variable_index(optimizer, v)] for v in variables]


def check_gradients(gradients, variables, states, sparse_gradients):
    """Raises for a dense gradient `sparse_gradients` names; warns for a
    sparse gradient of a variable with (unused) compressor state."""
    for gradient, variable, state in zip(gradients, variables, states):
        sparse = isinstance(gradient, tf.IndexedSlices)
        if gradient is not None and not sparse and declared_sparse(sparse_gradients, variable):
            raise ValueError(
                f"The optimizer's sparse_gradients={sparse_gradients!r} "
                f"names {variable.path!r}, but its gradient is dense. Name only "
                "variables whose gradients are tf.IndexedSlices (embedding "
                "tables read by a gather)."
            )
        if sparse and state:
            warnings.warn(
                f"The gradient of {variable.path!r} is sparse, so it travels "
                f"uncompressed and never uses its compressor state "
                f"({', '.join(sorted(state))}). Name it in the optimizer's "
                "sparse_gradients to make no state for it.",
                stacklevel=2,
            )
