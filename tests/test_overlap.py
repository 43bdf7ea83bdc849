"""A `fit` step's gradient exchange starts while the backward pass runs.

Packs launch in backward order: the first collective of a step carries the
last layers' gradients, which the backward pass computes first, so it waits
for none of the first layer's. Read from the graph of Keras's train step.
"""

import re

import keras
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from test_streaming_diloco import ancestors


def _train_step_graph(transport, optimizer, bytes_per_pack):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport, bytes_per_pack=bytes_per_pack)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu", name="first"),
            keras.layers.Dense(64, activation="relu", name="middle"),
            keras.layers.Dense(4, name="last"),
        ])
        model.compile(optimizer(), loss="mse")
        model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        strategy.run(model.train_step, args=((x, y),))

    spec = (tf.TensorSpec([8, 32]), tf.TensorSpec([8, 4]))
    return step.get_concrete_function(*spec).graph


def _first_layer_gradient(op):
    # Keras names a traced layer's scope "first", "first_1", ...
    return re.search(r"^gradient_tape/.*/first(_\d+)?/", op.name) is not None


def _carries_a_pack(op, transport):
    """Whether `op` moves a pack between replicas: a collective, or on the
    local transport the compiled sum of a pack's copies."""
    if transport == "collective":
        return op.type in ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2")
    return op.type in ("PartitionedCall", "StatefulPartitionedCall") and (
        "__inference__combine_" in op.get_attr("f").name
    )


@pytest.mark.parametrize("transport, compression, sharded", [
    ("collective", None, False), ("collective", "fp16", False), ("collective", "int8", False),
    ("local", None, False), ("local", "fp16", False),
    ("collective", None, True), ("collective", "fp16", True), ("collective", "int8", True),
])
def test_the_first_exchange_does_not_wait_for_the_first_layers_gradient(
    transport, compression, sharded
):
    # Packs of at most 1 KiB: each of the six variables travels alone.
    graph = _train_step_graph(
        transport,
        lambda: tf_agn.optimizers.SGD(0.1, compression=compression, shard_optimizer_state=sharded),
        1024,
    )
    exchanges = [op for op in graph.get_operations() if _carries_a_pack(op, transport)]
    assert exchanges
    assert not any(_first_layer_gradient(op) for op in ancestors(exchanges[0]))
    # The control: the step's last exchange carries the first layer's.
    assert any(_first_layer_gradient(op) for op in ancestors(exchanges[-1]))
