"""Wrapping keeps every setting of the wrapped optimizer: `DistributedOptimizer`
and the windowed optimizers rebuild it from its config, and carry over what
Keras keeps outside the config (`exclude_from_weight_decay`)."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import stock_mirrored
from tf_agn import _compat

FEATURES, BATCH, STEPS = 8, 32, 4
TOLERANCE = 1e-5

WRAPPERS = {
    "DistributedOptimizer": tf_agn.optimizers.DistributedOptimizer,
    "AGN": lambda optimizer: tf_agn.optimizers.AGN(optimizer, local_steps=2),
}

# A value other than the default for each parameter of Keras's
# `Optimizer.__init__`, each set alone (the clipping ones exclude each other).
NON_DEFAULT = {
    "learning_rate": 0.125,
    "weight_decay": 0.25,
    "clipnorm": 0.5,
    "clipvalue": 0.75,
    "global_clipnorm": 1.5,
    "use_ema": True,
    "ema_momentum": 0.5,
    "ema_overwrite_frequency": 3,
    "loss_scale_factor": 64.0,
    "gradient_accumulation_steps": 3,
    "name": "wrapped_sgd",
}
# Settings a wrapper refuses, with its message.
REFUSED = {("AGN", "gradient_accumulation_steps"): "AGN takes no gradient_accumulation_steps"}


def keras_optimizer_parameters():
    """The parameters of `keras.optimizers.Optimizer.__init__`, from the
    class in its MRO that names them (the backend's class takes
    `*args, **kwargs`)."""
    for cls in keras.optimizers.Optimizer.__mro__:
        parameters = [
            p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if parameters:
            return parameters
    raise AssertionError("no class of keras.optimizers.Optimizer's MRO names its parameters")


def _value(setting):
    return setting.numpy() if isinstance(setting, keras.Variable) else setting


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_every_setting_of_kerass_optimizer_survives_wrapping(wrapper):
    for name in keras_optimizer_parameters():
        if name not in NON_DEFAULT:
            pytest.fail(
                f"keras.optimizers.Optimizer takes {name!r}, which this test does "
                "not know: give it a non-default value in NON_DEFAULT, and make "
                "wrapping keep it."
            )
        optimizer = keras.optimizers.SGD(**{name: NON_DEFAULT[name]})
        if (wrapper, name) in REFUSED:
            with pytest.raises(ValueError, match=REFUSED[wrapper, name]):
                WRAPPERS[wrapper](optimizer)
            continue
        wrapped = WRAPPERS[wrapper](optimizer)
        for inner in (wrapped.inner_optimizer, wrapped.plain_inner_optimizer()):
            assert _value(getattr(inner, name)) == NON_DEFAULT[name], (name, type(inner))


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_weight_decay_exclusions_survive_wrapping(wrapper):
    kernel, bias, other = (
        keras.Variable(np.zeros(2), name=name) for name in ("kernel", "bias", "other")
    )
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[kernel], var_names=["bias"])
    wrapped = WRAPPERS[wrapper](optimizer)
    # And told to the wrapper, after wrapping.
    late = WRAPPERS[wrapper](keras.optimizers.AdamW(weight_decay=0.1))
    late.exclude_from_weight_decay(var_list=[kernel], var_names=["bias"])
    for inner in (wrapped.inner_optimizer, wrapped.plain_inner_optimizer(), late.inner_optimizer):
        decayed = [_compat.uses_weight_decay(inner, v) for v in (kernel, bias, other)]
        assert decayed == [False, False, True], type(inner)


SAVED_ADAMW = {
    "drop-in": lambda: tf_agn.optimizers.AdamW(weight_decay=0.1),
    **{name: lambda wrap=wrap: wrap(keras.optimizers.AdamW(weight_decay=0.1))
       for name, wrap in WRAPPERS.items()},
}


@pytest.mark.parametrize("kind", sorted(SAVED_ADAMW))
def test_excluded_names_survive_a_keras_file(kind, tmp_path):
    """Keras leaves the exclusions out of the config, and a loaded (built)
    optimizer cannot be told them again: tf_agn's config keeps the names."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    optimizer = SAVED_ADAMW[kind]()
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    model.compile(optimizer, "mse")
    model.fit(*_data(), batch_size=BATCH, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    inner = getattr(loaded.optimizer, "inner_optimizer", loaded.optimizer)
    kernel, bias = loaded.layers[0].kernel, loaded.layers[0].bias
    assert [_compat.uses_weight_decay(inner, v) for v in (kernel, bias)] == [True, False]


# Training: an AdamW that spares the biases, against stock Keras --------------


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype("float32")
    return x, np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype("float32")


def _trained(strategy, optimizer):
    """(initial, final) weights of a small regression MLP, with biases far
    from 0 so that decaying them shows, after `STEPS` batches of `fit`."""
    keras.utils.set_random_seed(1)
    biases = keras.initializers.RandomNormal(stddev=1.0, seed=2)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh", bias_initializer=biases),
            keras.layers.Dense(1, bias_initializer=biases),
        ])
        model.compile(optimizer(), "mse")
    before = model.get_weights()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return before, model.get_weights()


def _adamw(**kwargs):
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.3, **kwargs)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def deviation(got, want, start):
    """‖w − w_ref‖₂ / ‖w_ref − w₀‖₂ over all weights together."""
    flat = [np.concatenate([np.ravel(a) for a in arrays]) for arrays in (got, want, start)]
    return np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1] - flat[2])


@pytest.mark.parametrize(
    "settings", [{}, {"shard_optimizer_state": True}, {"gradient_accumulation_steps": 2}],
    ids=["plain", "sharded", "accumulated"],
)
def test_a_wrapped_adamw_spares_what_it_excludes_as_stock_keras_does(settings):
    start, got = _trained(
        tf_agn.strategies.mirrored(DEVICES[:2]),
        lambda: tf_agn.optimizers.DistributedOptimizer(_adamw(), **settings),
    )
    if "gradient_accumulation_steps" in settings:
        # Keras's own accumulation fails under strategies (keras#20582): on
        # one device, with the global batch.
        _, want = _trained(
            tf.distribute.get_strategy(),
            lambda: _adamw(gradient_accumulation_steps=settings["gradient_accumulation_steps"]),
        )
    else:
        _, want = _trained(stock_mirrored(DEVICES[:2]), _adamw)
    assert deviation(got, want, start) <= TOLERANCE
