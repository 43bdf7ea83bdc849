"""A stateful compressor's per-replica state, kept as optimizer variables.

`tf_agn.compression.Int8` and `PowerSGD` keep, on every replica, the
residual compression dropped (PowerSGD as its factors M, P^ and Q;
`compressor.residual(state)` gives it whole) and PowerSGD's warm-started Q.
An optimizer with such a compressor has, after Keras's own variables, one
replica-local variable per trainable variable and kind of state, named
after its model variable (`dense_kernel_residual`,
`dense_kernel_powersgd_q`, ...). `tf_agn.callbacks.BackupAndRestore` saves
every replica's copy; a `.keras` file saves the sum of what the replicas
owe, which loading shares out equally on any number of replicas, so
training continues with no update lost.

Sparse gradients (`tf.IndexedSlices`, as an embedding read by a gather
has) travel uncompressed and need no state: name their variables in the
optimizer's `sparse_gradients`, regular expressions searched for in each
variable's `path`. A layer's name is the surest (a model's own name leads
the paths only until it is loaded). A `.keras` file keeps the names:

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

With `gradient_accumulation_steps` the window travels dense and
compressed, so the variables named keep their state then.
"""

import re
import warnings

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression


def check_sparse_gradients(patterns):
    """Validates an optimizer's `sparse_gradients`.

    Args:
        patterns: None, or a list or tuple of regular expressions.

    Returns:
        `patterns` as a list, or None.

    Raises:
        ValueError: for anything else (a lone string too: put it in a
            list), or a pattern that is not a regular expression.
    """
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
    """Whether one of `patterns` (as `check_sparse_gradients` returns them,
    or None) is found in `variable`'s path."""
    return any(re.search(pattern, variable.path) for pattern in patterns or ())


def add_compression_state(optimizer, variables, compressor, sparse_gradients=None):
    """Makes `compressor`'s per-replica state for each of `variables`.

    Args:
        optimizer: the Keras optimizer that owns the state.
        variables: the trainable variables it was built with.
        compressor: a compressor; only an `ErrorFeedbackCompressor` has
            state.
        sparse_gradients: None, or patterns naming the variables whose
            gradients travel sparse (`check_sparse_gradients`), which get
            no state.

    Returns:
        One dict per variable, from a state's name to its `keras.Variable`
        (empty for variables kept without state, and for stateless
        compressors).
    """
    if not compression.is_stateful(compressor):
        return [{} for _ in variables]
    states = []
    for variable in variables:
        state = {}
        # Sparse gradients travel uncompressed, so their state would never be
        # used (a 100,000 x 64 table would cost int8 a 25.6 MB residual per
        # replica). The user names them: Keras builds the optimizer from the
        # variables alone, before any gradient exists, and a variable does
        # not know its layer; making state lazily at the first traced step
        # would fail on `.keras` loading, which builds the optimizer before
        # any step and skips every saved optimizer variable when their
        # number differs.
        if declared_sparse(sparse_gradients, variable) or not compressor.acts_on(
            tf.as_dtype(variable.dtype)
        ):
            states.append(state)  # It travels uncompressed.
            continue
        for name, spec in sorted(compressor.state_spec(variable.shape).items()):
            # A `.keras` file holds what Keras reads in cross-replica
            # context: the replicas' sum of owed state ("sum", which
            # TensorFlow shares out equally when it is assigned back, on any
            # number of replicas) and the mean of the rest, alike on every
            # replica. So what the residuals add up to, all a sum of the
            # replicas' contributions depends on, is kept. PowerSGD's result
            # is linear in the residuals, so it continues exactly (up to
            # rounding); int8 rounds each replica's value on its own, so its
            # next steps round differently.
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


def compression_state_of(optimizer, variables, states):
    """The entries of `states` (as `add_compression_state` made them) for
    `variables`, in their order."""
    return [states[_compat.variable_index(optimizer, v)] for v in variables]


def check_gradients(gradients, variables, states, sparse_gradients):
    """Checks, while the step is traced, this replica's gradients against
    the variables' compressor state.

    Args:
        gradients: the gradients of `variables`: tensors, `tf.IndexedSlices`
            or None.
        variables: the trainable variables.
        states: their state, as `compression_state_of` gives it.
        sparse_gradients: the optimizer's `sparse_gradients`.

    Raises:
        ValueError: for a dense gradient of a variable `sparse_gradients`
            names: without state, it could not travel compressed.

    Warns:
        UserWarning: for a sparse gradient of a variable with state, which
            it travels without: `sparse_gradients` would save that memory.
    """
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
