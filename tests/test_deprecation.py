"""Renamed public arguments keep their former names for one release: each
still works, and says what to use instead."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from tf_agn.strategies import simulate
from tf_agn.strategies.training import dataset_from

CONTEXT = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: tf_agn.optimizers.DistributedOptimizer(keras.optimizers.SGD(), **kw),
        lambda **kw: tf_agn.optimizers.AGN(local_steps=2, **kw),
        lambda **kw: tf_agn.optimizers.DOWNPOUR(**kw),
        lambda **kw: tf_agn.optimizers.AEASGD(**kw),
    ],
    ids=["DistributedOptimizer", "AGN", "DOWNPOUR", "AEASGD"],
)
def test_aggregation_is_the_former_name_of_aggregation_method(make):
    with pytest.warns(DeprecationWarning, match=r"\(aggregation=\.\.\.\) is deprecated.*aggregation_method="):
        old = make(aggregation="only_first_replica")
    new = make(aggregation_method="only_first_replica")
    assert old.aggregation is new.aggregation is tf_agn.AggregationMethod.ONLY_FIRST_REPLICA
    assert old.get_config()["aggregation_method"] == "only_first_replica"
    assert "aggregation" not in old.get_config()


def test_a_config_saved_under_the_former_name_loads():
    config = tf_agn.optimizers.AGN(local_steps=3, aggregation_method="sum").get_config()
    config["aggregation"] = config.pop("aggregation_method")
    with pytest.warns(DeprecationWarning):
        loaded = tf_agn.optimizers.AGN.from_config(config)
    assert loaded.aggregation is tf_agn.AggregationMethod.SUM
    assert loaded.local_steps == 3


def test_aeasgd_learning_rate_is_the_former_name_of_elastic_learning_rate():
    with pytest.warns(DeprecationWarning, match=r"AEASGD\(learning_rate=\.\.\.\).*elastic_learning_rate="):
        old = tf_agn.optimizers.AEASGD(rho=2.0, learning_rate=0.1)
    assert old.elastic_learning_rate == 0.1
    assert old.moving_rate == pytest.approx(0.2)
    # `.learning_rate` is the inner optimizer's, as on every wrapper.
    inner = tf_agn.optimizers.AEASGD(keras.optimizers.SGD(0.5), elastic_learning_rate=0.1)
    assert float(inner.learning_rate) == pytest.approx(0.5)
    assert inner.get_config()["elastic_learning_rate"] == 0.1


def test_dataset_fn_takes_an_input_context_and_a_bare_one_is_deprecated():
    assert dataset_from(lambda input_context: input_context, CONTEXT) is CONTEXT
    with pytest.warns(DeprecationWarning, match="dataset_fn without argument"):
        assert dataset_from(lambda: "dataset", CONTEXT) == "dataset"


def _linear_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(
        optimizer=tf_agn.optimizers.AGN(keras.optimizers.SGD(0.1), local_steps=2), loss="mse"
    )
    return model


def _batches(worker):
    rng = np.random.default_rng(worker)
    x = rng.normal(size=(8, 4, 3)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x[..., :1]))


def test_simulate_passes_each_worker_its_pipeline_and_still_works_as_an_index():
    contexts = []

    def dataset_fn(input_context):
        contexts.append(input_context)
        return _batches(input_context.input_pipeline_id)

    new = _linear_model()
    simulate(new, dataset_fn, num_workers=2, num_windows=4)
    assert [(c.input_pipeline_id, c.num_input_pipelines) for c in contexts] == [(0, 2), (1, 2)]

    old = _linear_model()
    with pytest.warns(DeprecationWarning, match="input_pipeline_id"):
        simulate(old, lambda worker: _batches(int(worker)), num_workers=2, num_windows=4)
    for got, want in zip(old.get_weights(), new.get_weights()):
        np.testing.assert_array_equal(got, want)
