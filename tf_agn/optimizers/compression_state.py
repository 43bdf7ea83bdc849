"""A stateful compressor's per-replica state, kept as optimizer variables.

`tf_agn.compression.Int8` and `PowerSGD` keep, on every replica, what
compression dropped (the residual; PowerSGD keeps it as the factors M,
P^ and its own Q, `compressor.residual(state)` gives it whole) and
PowerSGD's warm-started Q. That state is optimizer state, so it lives in
the optimizer's variables: one replica-local variable
(`synchronization="on_read"`) per trainable variable and kind of state,
made when the optimizer is built, after Keras's own, and named after its
model variable (`dense_kernel_residual`; `dense_kernel_powersgd_q`,
`dense_kernel_powersgd_m`, ...).

So an optimizer with a stateful compressor has Keras's variables followed
by these; without one, its variables are exactly Keras's. `.keras` files
and `tf_agn.callbacks.BackupAndRestore` save them:

- `BackupAndRestore` keeps every replica's own copy, so a restored run
  continues exactly.
- A `.keras` file holds one value per variable, read across replicas as
  their mean, and loading gives every replica that mean. What the
  replicas' residuals add up to, which is all that a sum of their
  contributions depends on, is kept, so no update is lost. PowerSGD's
  result is linear in the residuals, whose factors' means are the mean
  residual (P^ and Q are the same on every replica), so it continues
  exactly (up to rounding); int8 rounds each replica's value on its own,
  so its next steps round differently.
"""

import keras
import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression


def add_compression_state(optimizer, variables, compressor):
    """Makes `compressor`'s per-replica state for each of `variables`.

    Args:
        optimizer: the Keras optimizer that owns the state.
        variables: the trainable variables it was built with.
        compressor: a compressor; only an `ErrorFeedbackCompressor` has
            state.

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
        if not compressor.acts_on(tf.as_dtype(variable.dtype)):
            states.append(state)  # It travels uncompressed.
            continue
        for name, spec in sorted(compressor.state_spec(variable.shape).items()):
            with keras.name_scope(optimizer.name, caller=optimizer):
                state[name] = keras.Variable(
                    initializer=spec.initializer,
                    shape=spec.shape,
                    dtype=variable.dtype,
                    trainable=False,
                    aggregation="mean",
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
