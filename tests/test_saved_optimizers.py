"""`.keras` files saved before the windowed optimizers became compositions
still load, with every optimizer variable restored to its saved value
(tests/saved_optimizers.py made them).

Keras skips an optimizer's saved variables with a warning when their number
differs, so the values are compared, not only the absence of an error.
"""

import warnings

import keras
import numpy as np
import pytest

import saved_optimizers
import tf_agn
from tf_agn import _compat

NAMES = sorted(saved_optimizers.configurations())

# What each file's optimizer was made with, read back from the loaded one.
SETTINGS = {
    "agn_adam_int8": ("AGN", "mean", "int8", 4),
    "downpour_sgd": ("DOWNPOUR", "sum", None, 4),
    "dynsgd_default": ("DynSGD", "sum", None, 4),
    "aeasgd_default": ("AEASGD", "sum", None, 4),
    "eamsgd_powersgd": ("EAMSGD", "sum", "powersgd", 4),
}


def load(name, strategy=None):
    path = saved_optimizers.DIRECTORY / f"{name}.keras"
    # The files were written by the Keras of their day (tests/saved_optimizers.py):
    # a Keras older than that (the oldest tested corner) skips, with the reason.
    unreadable = _compat.unreadable_keras_file(path)
    if unreadable:
        pytest.skip(unreadable)
    with warnings.catch_warnings():
        # Keras warns, and skips them, when the saved variables do not match.
        warnings.simplefilter("error", UserWarning)
        if strategy is None:
            return keras.saving.load_model(path)
        with strategy.scope():
            return keras.saving.load_model(path)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("under_strategy", [False, True])
def test_saved_optimizer_variables_are_restored(name, under_strategy):
    strategy = tf_agn.strategies.mirrored() if under_strategy else None
    model = load(name, strategy)
    expected = saved_optimizers.load_expected(name)
    variables = model.optimizer.variables
    assert len(variables) == len(expected)
    for (index, path, array), variable in zip(expected, variables):
        got = keras.ops.convert_to_numpy(variable)
        assert got.shape == array.shape, (index, path)
        np.testing.assert_array_equal(got, array, err_msg=f"{index} {path}")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_saved_windowed_settings_are_restored(name):
    class_name, method, compression, local_steps = SETTINGS[name]
    optimizer = load(name).optimizer
    assert type(optimizer).__name__ == class_name
    assert optimizer.aggregation_method.value == method
    assert tf_agn.compression.name_of(optimizer.compression) == compression
    assert optimizer.local_steps == local_steps
    # The settings that had no meaning for a windowed optimizer are gone.
    assert "accumulation_reduction" not in optimizer.get_config()


def test_a_loaded_windowed_optimizer_trains_on():
    strategy = tf_agn.strategies.mirrored()
    model = load("agn_adam_int8", strategy)
    before = [w.copy() for w in model.get_weights()]
    x, y = saved_optimizers.data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after = model.get_weights()
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))
