"""AGN learns real data: the offline MNIST subset, 4 replicas."""

import keras
import pytest

import tf_agn
from conftest import DEVICES

EPOCHS = 10
BATCH = 512
LOCAL_STEPS = 8


def train(make_optimizer):
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = tf_agn.datasets.load("mnist5k")
    with tf_agn.strategies.mirrored(DEVICES).scope():
        model = keras.Sequential(
            [
                keras.Input(x_train.shape[1:]),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            make_optimizer(), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    return model.evaluate(x_test, y_test, batch_size=200, verbose=0)[1]


@pytest.mark.slow
def test_agn_adam_matches_synchronous_adam():
    synchronous = train(lambda: tf_agn.optimizers.Adam(4e-3))
    # Normalized commits averaged with MEAN move the center by the mean
    # exploration / λ; an outer learning rate of λ makes that the full mean
    # (model averaging), which keeps pace with synchronous training.
    agn = train(
        lambda: tf_agn.optimizers.AGN(
            keras.optimizers.Adam(4e-3),
            local_steps=LOCAL_STEPS,
            outer_optimizer=keras.optimizers.SGD(float(LOCAL_STEPS)),
        )
    )
    print(f"synchronous Adam {synchronous:.4f}, AGN(λ={LOCAL_STEPS}) {agn:.4f}")
    assert synchronous >= 0.90
    assert agn >= 0.90
    assert agn >= synchronous - 0.02
