"""The small model and data the compressed-training tests share
(tests/test_compressed_training.py, tests/test_communication.py)."""

import keras
import numpy as np


def data(rows=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 20)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(20, 3))).astype("float32")
    return x, y


def build(strategy, optimizer_fn, **compile_kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((20,)),
                keras.layers.Dense(64, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(optimizer_fn(), "mse", **compile_kwargs)
    return model
