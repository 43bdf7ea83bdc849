"""The whole `CrossDeviceOps` contract, for every transport, eager and
traced, against TensorFlow's `ReductionToOneDevice` on the same 4 logical
CPU replicas (tests/contract.py lists what is called), tf_agn's
`aggregate` with many packs against numpy, and `steps_per_execution > 1`
against one step per call."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from contract import aggregate_results
from contract import contract_results
from contract import reference_methods

# float16 sums round once per addition, in another order than
# ReductionToOneDevice's.
RTOL = {"reduce_half_mean": 2e-3, "batch_1_host": 2e-3}


@pytest.fixture(scope="module")
def reference():
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    return {traced: contract_results(strategy, traced) for traced in (False, True)}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("transport", ["local", "collective"])
def test_contract_matches_reduction_to_one_device(reference, transport, traced):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    got = contract_results(strategy, traced)
    want = reference[traced]
    assert sorted(got) == sorted(want)
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for replica, (g, w) in enumerate(zip(got[name], want[name])):
            np.testing.assert_allclose(
                g, w, rtol=RTOL.get(name, 1e-6), err_msg=f"{name}, replica {replica}"
            )
    # Integers past float16's and float32's exact range stay exact.
    np.testing.assert_array_equal(got["reduce_integers"][0], [10, 280000])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("transport", ["local", "collective"])
def test_aggregate_many_packs_dense_and_sparse(transport, traced):
    # 64-byte packs: many packs.
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport, bytes_per_pack=64)
    got = aggregate_results(strategy, traced)
    wants = [reference_methods(len(DEVICES), r) for r in range(len(DEVICES))]
    for name in wants[0]:
        assert len(got[name]) == len(DEVICES), name
        for replica, array in enumerate(got[name]):
            np.testing.assert_allclose(
                array, wants[replica][name], rtol=1e-6, err_msg=f"{name}, replica {replica}"
            )


@pytest.mark.parametrize("transport", ["local", "collective"])
def test_steps_per_execution_3_matches_one_step_per_call(transport):
    """Three steps per call put the collectives inside Keras's
    tf.while_loop and tf.cond; the weights equal one step per call's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((96, 5)).astype(np.float32)
    y = np.sin(x.sum(1, keepdims=True))
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    weights = {}
    for steps in (1, 3):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
            )
            model.compile(
                optimizer=tf_agn.optimizers.Adam(0.01), loss="mse", steps_per_execution=steps
            )
        initial = model.get_weights()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights[steps] = model.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(weights[1], initial)) > 0.01
    for a, b in zip(weights[3], weights[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
