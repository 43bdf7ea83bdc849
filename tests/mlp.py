"""The small MLP, its data and its settings, shared by the optimizer tests."""

import keras
import numpy as np

BATCH = 16
LEARNING_RATE = 0.1
METHODS = ["sum", "mean", "only_first_replica", "none"]


def data(steps=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(BATCH * steps, 3).astype("float32")
    y = np.stack([np.sin(x.sum(1)), x[:, 0] * x[:, 1]], 1).astype("float32")
    return x, y


def initial_params(seed=1):
    rng = np.random.RandomState(seed)
    return [
        rng.randn(3, 4).astype("float32") * 0.5,
        rng.randn(4).astype("float32") * 0.1,
        rng.randn(4, 2).astype("float32") * 0.5,
        rng.randn(2).astype("float32") * 0.1,
    ]


def build_mlp(params):
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    model.set_weights(params)
    return model
