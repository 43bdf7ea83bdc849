"""`tf_agn.decoupled.split_model`: cuts at single-tensor boundaries only,
balanced, and the stages compose to the model."""

import keras
import numpy as np
import pytest

from tf_agn.decoupled import split_model


def sequential():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(32, activation="relu", name="wide"),
            keras.layers.Dense(4, activation="relu", name="narrow"),
            keras.layers.Dense(4, activation="relu", name="small"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="sequential",
    )


def residual():
    """A conv net with one residual block (`branch` .. `add`)."""
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", name="stem")(inputs)
    branch = keras.layers.Conv2D(4, 3, padding="same", name="branch_a")(x)
    branch = keras.layers.Conv2D(4, 3, padding="same", name="branch_b")(branch)
    x = keras.layers.Add(name="add")([x, branch])
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    return keras.Model(inputs, outputs, name="residual")


def compose(stages, x):
    for stage in stages:
        x = stage(x)
    return keras.ops.convert_to_numpy(x)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_sequential_round_trip(num_stages):
    model = sequential()
    stages = split_model(model, num_stages)
    assert len(stages) == num_stages
    x = np.random.default_rng(1).normal(size=(5, 6)).astype("float32")
    np.testing.assert_array_equal(compose(stages, x), model(x))
    # The stages share the model's weights.
    assert sum(len(s.weights) for s in stages) == len(model.weights)
    model.layers[0].kernel.assign(np.zeros((6, 32)))
    np.testing.assert_array_equal(compose(stages, x), model(x))


def test_balances_parameters():
    # Parameters per layer: 224, 132, 20, 15. The largest stage is as small
    # as it can be: {wide} | {narrow, small, logits}.
    stages = split_model(sequential(), 2)
    assert [[l.name for l in s.layers[1:]] for s in stages] == [
        ["wide"],
        ["narrow", "small", "logits"],
    ]


def test_balances_flops():
    # The convolution has 80 parameters but, applied at 256 positions,
    # 43,008 FLOPs (2 x 80 x 256, plus one per output element); the dense
    # layer has 131,136 parameters and 262,336 FLOPs. By parameters the
    # dense layer alone outweighs everything, so it joins the first stage;
    # by FLOPs it is the second stage's bulk.
    model = keras.Sequential(
        [
            keras.Input((16, 16, 1)),
            keras.layers.Conv2D(8, 3, padding="same", name="conv"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(64, name="dense"),
            keras.layers.Dense(10, name="logits"),
        ]
    )
    by_params = split_model(model, 2)
    by_flops = split_model(model, 2, balance="flops")
    assert [l.name for l in by_params[0].layers[1:]] == ["conv", "flatten", "dense"]
    assert [l.name for l in by_flops[0].layers[1:]] == ["conv", "flatten"]
    x = np.random.default_rng(2).normal(size=(3, 16, 16, 1)).astype("float32")
    np.testing.assert_array_equal(compose(by_flops, x), model(x))


def test_residual_round_trip_and_boundaries():
    model = residual()
    stages = split_model(model, cut_after=["stem", "relu"])
    assert [[l.name for l in s.layers[1:]] for s in stages] == [
        ["stem"],
        ["branch_a", "branch_b", "add", "relu"],
        ["pool", "logits"],
    ]
    x = np.random.default_rng(3).normal(size=(3, 8, 8, 1)).astype("float32")
    np.testing.assert_array_equal(compose(stages, x), model(x))
    # The boundaries: after stem, add, relu and pool; 5 stages at most.
    assert len(split_model(model, 5)) == 5
    with pytest.raises(ValueError, match="cannot be cut into 6 stages"):
        split_model(model, 6)


def test_refuses_a_cut_inside_a_residual_block():
    with pytest.raises(
        ValueError,
        match=r"Cannot cut after layer 'branch_a'.*residual block.*"
        r"Allowed: \['stem', 'add', 'relu', 'pool'\]",
    ):
        split_model(residual(), cut_after=["branch_a"])


def test_bad_arguments():
    model = sequential()
    with pytest.raises(ValueError, match=r"from 1 to .* 4; received 5"):
        split_model(model, 5)
    with pytest.raises(ValueError, match="received 0"):
        split_model(model, 0)
    with pytest.raises(ValueError, match="Unknown balance 'time'"):
        split_model(model, 2, balance="time")
    with pytest.raises(ValueError, match="names no layer .* 'nope'"):
        split_model(model, cut_after=["nope"])
    with pytest.raises(ValueError, match="must follow the model's order"):
        split_model(model, cut_after=["narrow", "wide"])
    with pytest.raises(ValueError, match="num_stages=3 disagrees"):
        split_model(model, 3, cut_after=["wide"])


def test_refuses_models_without_a_graph():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="cannot be cut: .* subclassed"):
        split_model(model, 2)
