"""Reading each replica's copy of the weights."""

import keras


def replica_weights(model_or_variables):
    """Returns every replica's copy of the weights, as numpy arrays.

    The copies differ only after local steps (NONE, a windowed optimizer).

    Args:
        model_or_variables: a Keras model or a list of Keras or TF variables.

    Returns:
        One list of numpy arrays per replica, in the variables' order.

    Example:

    ```python
    copies = tf_agn.replica_weights(model)  # copies[r][i]: replica r's weight i
    ```
    """
    variables = getattr(model_or_variables, "weights", model_or_variables)
    per_variable = []
    for variable in variables:
        if isinstance(variable, keras.Variable):
            variable = variable.value
        copies = getattr(variable, "values", None) or (variable,)
        per_variable.append([copy.numpy() for copy in copies])
    return [list(arrays) for arrays in zip(*per_variable)]
