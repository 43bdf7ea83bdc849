"""Small models the examples, tests and benchmarks share."""

import keras


def mlp(input_shape, num_classes, hidden_units=(256, 128)):
    """A `keras.Sequential` ReLU MLP with a softmax over `num_classes`.

    The AGN paper's MNIST model is `mlp((784,), 10, (1000, 2000, 1000))`.

    Args:
        input_shape: the shape of one example, e.g. `(784,)`.
        num_classes: the number of output classes.
        hidden_units: the width of each hidden layer, in order.
    """
    return keras.Sequential(
        [keras.Input(shape=input_shape)]
        + [keras.layers.Dense(units, activation="relu") for units in hidden_units]
        + [keras.layers.Dense(num_classes, activation="softmax")]
    )


def cnn(input_shape, num_classes, filters=(16, 32), dense_units=128):
    """A small `keras.Sequential` CNN with a softmax over `num_classes`,
    which `tf_agn.decoupled.split_model` can cut after any layer.

    Args:
        input_shape: the shape of one image, e.g. `(28, 28, 1)`.
        num_classes: the number of output classes.
        filters: the channels of each 3x3 convolution (each followed by a
            2x2 max pooling), in order.
        dense_units: the width of the hidden dense layer.
    """
    layers = [keras.Input(shape=input_shape)]
    for channels in filters:
        layers += [
            keras.layers.Conv2D(channels, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
        ]
    return keras.Sequential(
        layers
        + [
            keras.layers.Flatten(),
            keras.layers.Dense(dense_units, activation="relu"),
            keras.layers.Dense(num_classes, activation="softmax"),
        ]
    )
