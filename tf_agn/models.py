"""Small models the examples, tests and benchmarks share."""

import keras


def mlp(input_shape, num_classes, hidden_units=(256, 128)):
    """A ReLU multilayer perceptron with a softmax over `num_classes`.

    The AGN paper's MNIST model is `mlp((784,), 10, (1000, 2000, 1000))`.

    Args:
        input_shape: the shape of one example, e.g. `(784,)`.
        num_classes: the number of output classes.
        hidden_units: the width of each hidden layer, in order.

    Returns:
        A `keras.Sequential` model.
    """
    return keras.Sequential(
        [keras.Input(shape=input_shape)]
        + [keras.layers.Dense(units, activation="relu") for units in hidden_units]
        + [keras.layers.Dense(num_classes, activation="softmax")]
    )
