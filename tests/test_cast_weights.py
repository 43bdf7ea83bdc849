"""Casts travel weighted: on every path (the local and the collective
transport, sharded state or not) each replica's gradient is multiplied by
its weight w (the method's, the window's and the gradient scale) in
float32, and only then cast to float16 or bfloat16. The wire values are
summed in the wire dtype (the collective transport, and every
reduce-scatter of sharded state), or in float32 (the local transport's
all-reduce).

Each test applies one window of `K` micro-steps, MEAN over `N` replicas,
with SGD at learning rate 1 from zero weights, so the weights become minus
the combined gradient. Two replicas: a sum of two values is rounded once,
in whatever order a transport adds them.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES

N = 2
K = 3
SHAPE = (40, 25)
CASTS = {"fp16": tf.float16, "bf16": tf.bfloat16}
PATHS = [
    pytest.param(transport, sharded, id=f"{transport}-{'sharded' if sharded else 'plain'}")
    for transport in ("local", "collective")
    for sharded in (False, True)
]


def weights_after_one_window(transport, sharded, cast, gradients):
    """The weights after `K` micro-steps in which replica r's gradient is
    `gradients[r]` each time."""
    strategy = tf_agn.strategies.mirrored(DEVICES[:N], transport=transport)
    with strategy.scope():
        variable = keras.Variable(np.zeros(SHAPE, np.float32), name="kernel")
        optimizer = tf_agn.optimizers.SGD(
            1.0, aggregation_method="mean", compression=cast,
            gradient_accumulation_steps=K, shard_optimizer_state=sharded,
        )
        optimizer.build([variable])

    def replica_step():
        rank = tf.distribute.get_replica_context().replica_id_in_sync_group
        optimizer.apply([tf.gather(tf.constant(gradients), rank)], [variable])

    step = tf.function(lambda: strategy.run(replica_step))
    for _ in range(K):
        step()
    return variable.numpy()


def combined_reference(gradients, cast, summed_in_wire_dtype):
    """Σ_r cast(window_r · w), as numpy computes it."""
    window = [g + (g + g) for g in gradients]  # the float32 accumulator's sums
    weight = np.float32(N * (1 / K) / N)  # gradient scale n, window 1/k, MEAN 1/n
    wire_dtype = CASTS[cast].as_numpy_dtype
    sent = [(w * weight).astype(wire_dtype) for w in window]
    if summed_in_wire_dtype:
        return (sent[0] + sent[1]).astype(np.float32)
    return sent[0].astype(np.float32) + sent[1].astype(np.float32)


@pytest.mark.parametrize("cast", sorted(CASTS))
@pytest.mark.parametrize("transport, sharded", PATHS)
def test_a_window_is_weighted_in_float32_before_its_cast(transport, sharded, cast):
    gradients = np.random.default_rng(5).normal(size=(N, *SHAPE)).astype(np.float32)
    got = weights_after_one_window(transport, sharded, cast, gradients)
    in_wire_dtype = transport == "collective" or sharded
    want = -combined_reference(gradients, cast, in_wire_dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("transport, sharded", PATHS)
def test_a_window_whose_sum_overflows_float16_but_whose_mean_does_not_travels(
    transport, sharded
):
    # The window's sum, 90000, is above float16's largest value, 65504; its
    # weighted value 30000 on each replica, and their sum 60000, are not.
    gradients = np.full((N, *SHAPE), 30000.0, np.float32)
    got = weights_after_one_window(transport, sharded, "fp16", gradients)
    np.testing.assert_array_equal(got, np.full(SHAPE, -60000.0, np.float32))
