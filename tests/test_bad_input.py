"""Bad arguments end in an error that names the bad value and what is
allowed, before anything trains or connects."""

import re

from absl import flags
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from test_any_strategy import SimulatedReplicas
from tf_agn.collectives.routing import combine_replicas
from tf_agn.decoupled import DecoupledModel
from tf_agn.decoupled import split_model
from tf_agn.optimizers import DistributedOptimizer
from tf_agn.strategies import simulate

TWO_WORKERS = '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '


def raises(error, *parts):
    """`pytest.raises(error)` whose message holds every one of `parts`."""
    return pytest.raises(error, match=".*".join(map(re.escape, parts)))


# Optimizers ------------------------------------------------------------------


def test_wrapper_and_wrapped_optimizer_with_different_methods_are_refused():
    inner = tf_agn.optimizers.Adam(aggregation_method="sum", name="inner")
    with raises(
        ValueError,
        "must be None or that of the optimizer it wraps, 'inner': 'sum'; received 'mean'",
    ):
        DistributedOptimizer(inner, aggregation_method="mean")


def test_wrapper_takes_the_wrapped_optimizers_method_unless_it_has_none():
    sum_inner = tf_agn.optimizers.Adam(aggregation_method="sum")
    assert DistributedOptimizer(sum_inner).aggregation is tf_agn.AggregationMethod.SUM
    same = DistributedOptimizer(tf_agn.optimizers.Adam(aggregation_method="sum"), "SUM")
    assert same.aggregation is tf_agn.AggregationMethod.SUM
    own = DistributedOptimizer(tf_agn.optimizers.Adam(), aggregation_method="none")
    assert own.aggregation is tf_agn.AggregationMethod.NONE
    # Without either, the strategy's default (MEAN without a tf_agn one).
    plain = DistributedOptimizer(keras.optimizers.Adam())
    assert plain.aggregation is tf_agn.AggregationMethod.MEAN


def test_windowed_optimizer_refuses_an_inner_optimizer_that_aggregates():
    inner = tf_agn.optimizers.Adam(aggregation_method="sum", name="inner")
    with raises(
        ValueError,
        "AGN's inner optimizer steps locally: its aggregation_method must be None "
        "or 'none'; received 'sum' on 'inner'",
        "aggregation_method='sum' to AGN",
    ):
        tf_agn.optimizers.AGN(inner)
    local = tf_agn.optimizers.AGN(tf_agn.optimizers.Adam(aggregation_method="none"))
    assert local.aggregation is tf_agn.AggregationMethod.MEAN


def test_a_compressor_is_refused_a_pattern_it_does_not_carry():
    values = [[tf.ones([2, 6])] for _ in range(2)]
    with raises(ValueError, "compression='powersgd' carries no reduce_scatter; it carries all_reduce"):
        combine_replicas(
            SimulatedReplicas(2), tf_agn.AggregationMethod.SUM, values,
            compressor=tf_agn.compression.PowerSGD(rank=1), pattern="reduce_scatter",
        )


def test_aggregation_is_not_a_name_of_aggregation_method():
    # Keras' own refusal of an unknown argument, and Python's.
    with raises(ValueError, "Argument(s) not recognized: {'aggregation': 'sum'}"):
        DistributedOptimizer(keras.optimizers.SGD(), aggregation="sum")
    for windowed in (tf_agn.optimizers.AGN, tf_agn.optimizers.DOWNPOUR):
        with raises(TypeError, "unexpected keyword argument 'aggregation'"):
            windowed(aggregation="sum")


def test_learning_rate_is_refused_where_the_wrapped_optimizer_has_it():
    with raises(
        TypeError,
        "AEASGD takes no learning_rate: η of the elastic force is elastic_learning_rate",
        "received learning_rate=0.1.",
    ):
        tf_agn.optimizers.AEASGD(rho=2.0, learning_rate=0.1)
    with raises(
        TypeError, "DistributedOptimizer takes no learning_rate", "received learning_rate=0.1."
    ):
        DistributedOptimizer(keras.optimizers.SGD(), learning_rate=0.1)


# Strategies ------------------------------------------------------------------


@pytest.mark.parametrize("device", ["/gpu:0", "/cpu:7", "TPU:0"])
def test_mirrored_refuses_devices_this_process_lacks(device):
    with raises(
        ValueError,
        "devices must name devices this process has (",
        "CPU:3",
        f"received {device!r}.",
    ):
        tf_agn.strategies.mirrored(devices=["/cpu:0", device])


def test_mirrored_refuses_a_reduce_to_device_this_process_lacks():
    with raises(
        ValueError,
        "reduce_to_device must name devices this process has (",
        "CPU:0",
        "received '/gpu:3'.",
    ):
        tf_agn.strategies.mirrored(reduce_to_device="/gpu:3")


def test_mirrored_accepts_short_and_full_device_names(devices):
    strategy = tf_agn.strategies.mirrored(
        devices=["/cpu:0", "CPU:1", devices[2]], reduce_to_device="/device:CPU:0"
    )
    assert strategy.num_replicas_in_sync == 3


@pytest.mark.parametrize("timeout", [-1, 0, True, "30"])
def test_parameter_server_refuses_a_bad_connect_timeout(timeout):
    cluster = {"worker": ["localhost:1"], "ps": ["localhost:2"]}
    message = f"connect_timeout must be a number of seconds > 0; received {timeout!r}."
    with raises(ValueError, message):
        tf_agn.strategies.parameter_server(cluster, connect_timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        ((512, 100, 0), "num_replicas must be an int >= 1; received 0."),
        ((0, 100, 4), "batch_size must be an int >= 1; received 0."),
        ((512, 100.0, 4), "num_samples must be an int >= 1; received 100.0."),
    ],
)
def test_even_batch_size_refuses_bad_sizes(args, message):
    with raises(ValueError, message):
        tf_agn.strategies.even_batch_size(*args)
    assert tf_agn.strategies.even_batch_size(np.int64(512), np.int64(1797), 3) == 510


# TF_CONFIG: every case below raises before anything connects (a started
# TensorFlow server would hang this process), so they run in-process.

BAD_TF_CONFIGS = [
    (
        '{"cluster": ',
        [
            "TF_CONFIG must be valid JSON, but is not (Expecting value",
            "received '{\"cluster\": '.",
        ],
    ),
    ("[1, 2]", ["TF_CONFIG must be a JSON object", "received '[1, 2]'."]),
    (
        TWO_WORKERS + '"task": {"type": "worker", "index": 5}}',
        [
            "TF_CONFIG's task index must be in range(2), for the cluster's 2 "
            "'worker' task(s); received 5."
        ],
    ),
    (
        TWO_WORKERS + '"task": {"type": "worker", "index": -1}}',
        ["TF_CONFIG's task index must be in range(2)", "received -1."],
    ),
    (
        TWO_WORKERS + '"task": {"type": "ps", "index": 0}}',
        ["TF_CONFIG's task type must be one of ['worker']", "received 'ps'."],
    ),
]


@pytest.mark.parametrize("text, parts", BAD_TF_CONFIGS)
def test_multi_worker_mirrored_refuses_a_bad_tf_config(monkeypatch, text, parts):
    monkeypatch.setenv("TF_CONFIG", text)
    with raises(ValueError, *parts):
        tf_agn.strategies.multi_worker_mirrored()


@pytest.mark.parametrize("text, parts", BAD_TF_CONFIGS[:3])
def test_strategy_from_flags_refuses_a_bad_tf_config(monkeypatch, text, parts):
    flag_values = flags.FlagValues()
    tf_agn.strategies.define_flags(flag_values)
    flag_values(["example"])
    monkeypatch.setenv("TF_CONFIG", text)
    with raises(ValueError, *parts):
        tf_agn.strategies.strategy_from_flags(flag_values)


@pytest.mark.parametrize(
    "min_workers, variable, parts",
    [
        (0, None, ["min_workers must be an integer between 1 and the cluster's 2 workers; received 0."]),
        (3, None, ["min_workers must be an integer between 1", "received 3."]),
        (1.5, None, ["min_workers must be an integer between 1", "received 1.5."]),
        (None, "two", ["TF_AGN_MIN_WORKERS must be an integer between 1", "received 'two'."]),
        (None, "5", ["TF_AGN_MIN_WORKERS must be an integer between 1", "received 5."]),
    ],
)
def test_multi_worker_mirrored_refuses_a_bad_min_workers(monkeypatch, min_workers, variable, parts):
    monkeypatch.setenv("TF_CONFIG", TWO_WORKERS + '"task": {"type": "worker", "index": 0}}')
    if variable is not None:
        monkeypatch.setenv("TF_AGN_MIN_WORKERS", variable)
    with raises(ValueError, *parts):
        tf_agn.strategies.multi_worker_mirrored(min_workers=min_workers)


def test_min_workers_needs_tf_configs_cluster_of_workers(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"]}, '
        '"task": {"type": "worker", "index": 0}}',
    )
    with raises(ValueError, "min_workers=1 needs TF_CONFIG's cluster, a list of \"worker\" tasks only",
                "received the TF_CONFIG's jobs"):
        tf_agn.strategies.multi_worker_mirrored(min_workers=1)


def test_a_long_tf_config_is_quoted_cut(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{" + "x" * 1000)
    with pytest.raises(ValueError, match=r"received '\{x{199}' \(cut from 1001 characters\)\.$"):
        tf_agn.strategies.multi_worker_mirrored()


# simulate --------------------------------------------------------------------


def linear_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = tf_agn.optimizers.AGN(keras.optimizers.SGD(0.1), local_steps=2)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def examples(input_context):
    del input_context
    x = np.ones((8, 3), np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1]))


def test_simulate_refuses_a_dataset_of_single_examples():
    with raises(
        ValueError,
        "dataset_fn's dataset must hold batches: the model takes x of shape (None, 3); "
        "received elements of shape (3,)",
        ".batch(batch_size)",
    ):
        simulate(linear_model(), examples, num_workers=2, num_windows=4)


def test_simulate_refuses_a_dataset_too_short_for_its_windows():
    # Worker 0 commits windows 0, 2 and 4: 3 windows of 2 batches.
    def two_batches(input_context):
        return examples(input_context).batch(4)

    with raises(
        ValueError,
        "dataset_fn must give worker 0 at least 6 batches, for its 3 windows of "
        "local_steps=2; received a dataset that ran out",
        ".repeat()",
    ):
        simulate(linear_model(), two_batches, num_workers=2, num_windows=5)


@pytest.mark.parametrize("returned", [None, np.ones((4, 3))], ids=["None", "array"])
def test_simulate_refuses_a_dataset_fn_returning_no_dataset(returned):
    with raises(
        TypeError,
        "dataset_fn must return a tf.data.Dataset of (x, y) batches; received",
        repr(returned)[:12],
    ):
        simulate(
            linear_model(), lambda input_context: returned, num_workers=2, num_windows=4
        )


def test_simulate_refuses_elements_without_labels():
    def x_only(input_context):
        del input_context
        return tf.data.Dataset.from_tensor_slices(np.ones((8, 4, 3), np.float32))

    with raises(
        ValueError,
        "dataset_fn's dataset must hold (x, y) or (x, y, sample_weight) tuples; "
        "received elements TensorSpec(shape=(4, 3)",
    ):
        simulate(linear_model(), x_only, num_workers=2, num_windows=4)


@pytest.mark.parametrize("argument", ["num_windows", "num_workers"])
@pytest.mark.parametrize("value", [-1, 0, 2.0, True])
def test_simulate_refuses_bad_counts(argument, value):
    kwargs = {"num_workers": 2, "num_windows": 4, argument: value}
    with raises(ValueError, f"{argument} must be an int >= 1; received {value!r}."):
        simulate(linear_model(), examples, **kwargs)


def test_simulate_passes_an_input_context_not_an_index():
    with raises(TypeError, "InputContext"):
        simulate(
            linear_model(),
            lambda worker: examples(int(worker)),
            num_workers=2,
            num_windows=4,
        )


# Decoupled -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["model", None, [keras.layers.Dense(2)]])
def test_split_model_refuses_what_is_no_model(model):
    with raises(
        ValueError,
        "model must be a built keras.Sequential or functional keras.Model; "
        f"received {model!r}.",
    ):
        split_model(model, 2)


def test_decoupled_model_refuses_one_model_for_its_list_of_stages():
    model = tf_agn.models.mlp((3,), 2, hidden_units=(4,))
    with raises(
        ValueError,
        "stages must be a list of the K stages; received <Sequential",
        "tf_agn.decoupled.split_model(model, K)",
    ):
        DecoupledModel(model)
    with raises(ValueError, "stages must be a list of the K stages; received 'ab'."):
        DecoupledModel("ab")


@pytest.mark.parametrize("schedule", ["ADL", "Ddg", " bp "])
def test_schedule_names_take_any_case(devices, schedule):
    stages = [keras.layers.Dense(2), keras.layers.Dense(1)]
    model = DecoupledModel(stages, devices[:2], schedule=schedule)
    assert model.schedule.name == schedule.strip().lower()


def test_unknown_schedule_names_what_is_allowed(devices):
    stages = [keras.layers.Dense(2), keras.layers.Dense(1)]
    with raises(
        ValueError, "Unknown schedule 'GPipe'. Allowed: adl, ddg, bp (case-insensitive)."
    ):
        DecoupledModel(stages, devices[:2], schedule="GPipe")
