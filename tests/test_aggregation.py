"""Tests for `tf_agn.AggregationMethod`."""

import pytest
import tensorflow as tf

from tf_agn import AggregationMethod


@pytest.mark.parametrize(
    "name, member",
    [
        ("mean", AggregationMethod.MEAN),
        ("MEAN", AggregationMethod.MEAN),
        ("Mean", AggregationMethod.MEAN),
        ("only_first_replica", AggregationMethod.ONLY_FIRST_REPLICA),
        ("Only_First_Replica", AggregationMethod.ONLY_FIRST_REPLICA),
        (" Sum ", AggregationMethod.SUM),
        ("none", AggregationMethod.NONE),
        ("NONE", AggregationMethod.NONE),
    ],
)
def test_parse_names_case_insensitively(name, member):
    assert AggregationMethod.parse(name) is member


@pytest.mark.parametrize("member", list(AggregationMethod))
def test_parse_accepts_a_member(member):
    assert AggregationMethod.parse(member) is member


@pytest.mark.parametrize(
    "reduce_op, member",
    [
        (tf.distribute.ReduceOp.SUM, AggregationMethod.SUM),
        (tf.distribute.ReduceOp.MEAN, AggregationMethod.MEAN),
    ],
)
def test_parse_accepts_a_reduce_op(reduce_op, member):
    assert AggregationMethod.parse(reduce_op) is member


@pytest.mark.parametrize("bad", ["average", "", "first", "sum_", None, 1])
def test_parse_rejects_unknown_values_listing_the_allowed_names(bad):
    with pytest.raises(ValueError) as error:
        AggregationMethod.parse(bad)
    message = str(error.value)
    assert repr(bad) in message
    for name in ("none", "sum", "mean", "only_first_replica"):
        assert name in message


def test_names_are_the_lower_case_values():
    assert AggregationMethod.names() == [
        "none",
        "sum",
        "mean",
        "only_first_replica",
    ]
    assert str(AggregationMethod.ONLY_FIRST_REPLICA) == "only_first_replica"


def test_reduce_op():
    assert AggregationMethod.SUM.reduce_op is tf.distribute.ReduceOp.SUM
    assert AggregationMethod.MEAN.reduce_op is tf.distribute.ReduceOp.MEAN
    assert AggregationMethod.NONE.reduce_op is None
    assert AggregationMethod.ONLY_FIRST_REPLICA.reduce_op is None


@pytest.mark.parametrize(
    "reduce_op", [tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN]
)
def test_reduce_op_round_trips(reduce_op):
    assert AggregationMethod.parse(reduce_op).reduce_op is reduce_op
