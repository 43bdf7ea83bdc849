"""What `communication_stats` counts is what travels: float32 before a
stateful compressor's `start_step`, and int8's padded packs.

Every expected count is worked out here by hand from the shapes; the
compressors' buffers are measured by a communicator that records what
each replica hands each collective.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from compression_model import build as build_model
from conftest import DEVICES
from conftest import NUM_REPLICAS
from overflow import mixed_float16
from tf_agn import compression
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.communication import payload_bytes
from tf_agn.collectives.routing import combine_replicas
from tf_agn.transports import LocalTransport

BATCH = 64
# The model's 20x64 and 64x3 kernels and their biases.
FLOAT32_BYTES = 4 * (20 * 64 + 64 + 64 * 3 + 3)


def build(strategy, compressor, **kwargs):
    return build_model(
        strategy, lambda: tf_agn.optimizers.SGD(0.1, compression=compressor, **kwargs)
    )


def fit_steps(model, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 20)).astype("float32")
    y = rng.normal(size=(steps * BATCH, 3)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)


@pytest.mark.parametrize(
    "compressor, compressed_bytes",
    [
        # One pack of the 1539 values, padded so that each of the 4
        # replicas' parts is one whole chunk of 512: 2048 codes, 4 scales.
        (compression.Int8(start_step=3), 2048 + 4 * 4),
        # Rank 2: the 20x64 kernel as (20 + 64) * 2 floats; the 64x3 one
        # (64 * 3 < 2 * (64 + 3) * 2) and the biases whole.
        (compression.PowerSGD(rank=2, start_step=3), 4 * ((20 + 64) * 2 + 64 + 64 * 3 + 3)),
    ],
    ids=["int8", "powersgd"],
)
def test_float32_is_counted_before_start_step_then_what_compression_sends(
    compressor, compressed_bytes
):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(strategy, compressor)
    plain = build(strategy, None)
    fit_steps(model, 2)
    fit_steps(plain, 2)
    # Steps 0 and 1 travelled as float32: the same weights as uncompressed.
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert model.optimizer.communication_stats() == {
        "all_reduce_calls": 2,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": 2 * FLOAT32_BYTES,
        "bytes_received": 2 * FLOAT32_BYTES,
    }
    fit_steps(model, 3)  # steps 2, 3 and 4: the last two compressed
    assert model.optimizer.communication_stats() == {
        "all_reduce_calls": 5,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": 3 * FLOAT32_BYTES + 2 * compressed_bytes,
        "bytes_received": 3 * FLOAT32_BYTES + 2 * compressed_bytes,
    }


def test_start_step_counts_applied_steps_under_accumulation():
    """With 2 micro-steps per step, 4 micro-steps are 2 aggregations: the
    first before `start_step=1`, as float32; the second as int8."""
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(strategy, compression.Int8(start_step=1), gradient_accumulation_steps=2)
    fit_steps(model, 4)
    assert model.optimizer.communication_stats() == {
        "all_reduce_calls": 2,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": FLOAT32_BYTES + 2048 + 4 * 4,
        "bytes_received": FLOAT32_BYTES + 2048 + 4 * 4,
    }


# Sharded state pads each variable to a multiple of the replicas: the
# 3-element bias to 4. A reduce-scatter and an all-gather each count half
# of an all-reduce's payload. Int8's one pack of rows: 4 rows of the 385
# elements of each part, each padded to one chunk of 512, and 4 scales.
SHARDED_HALF = 4 * (20 * 64 + 64 + 64 * 3 + 4) // 2
INT8_ROWS_HALF = (4 * 512 + 4 * 4) // 2
STEPS = 3


def per_step(steps, bytes_sent, all_reduce=0, reduce_scatter=0, all_gather=0, all_to_all=0):
    """The stats of `steps` steps that each run these collectives."""
    return {
        "all_reduce_calls": steps * all_reduce,
        "reduce_scatter_calls": steps * reduce_scatter,
        "all_gather_calls": steps * all_gather,
        "all_to_all_calls": steps * all_to_all,
        "bytes_sent": steps * bytes_sent,
        "bytes_received": steps * bytes_sent,
    }


@pytest.mark.parametrize(
    "settings, counts",
    [
        ({}, {"all_reduce": 1, "bytes_sent": FLOAT32_BYTES}),
        (
            {"shard_optimizer_state": True},
            {"reduce_scatter": 1, "all_gather": 1, "bytes_sent": 2 * SHARDED_HALF},
        ),
        (
            {"shard_optimizer_state": True, "compression": "int8"},
            {"all_to_all": 1, "all_gather": 1, "bytes_sent": INT8_ROWS_HALF + SHARDED_HALF},
        ),
        # The norms of the 4 variables: one all-reduce of 4 float32.
        (
            {"shard_optimizer_state": True, "clipnorm": 1.0},
            {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1,
             "bytes_sent": 2 * SHARDED_HALF + 4 * 4},
        ),
    ],
    ids=["plain", "sharded", "int8_sharded", "clipnorm_sharded"],
)
def test_every_collective_is_counted_under_its_pattern(settings, counts):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build_model(strategy, lambda: tf_agn.optimizers.SGD(0.1, **settings))
    fit_steps(model, STEPS)
    assert model.optimizer.communication_stats() == per_step(STEPS, **counts)


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_mixed_precisions_finite_agreements_are_all_reduces_of_a_float(sharded):
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    with mixed_float16():
        model = build_model(
            strategy, lambda: tf_agn.optimizers.SGD(0.1, shard_optimizer_state=sharded)
        )
    fit_steps(model, STEPS)
    gradients = (
        {"reduce_scatter": 1, "all_gather": 1, "bytes_sent": 2 * SHARDED_HALF}
        if sharded else {"all_reduce": 1, "bytes_sent": FLOAT32_BYTES}
    )
    # The replicas' gradients before they travel; sharded, also the summed
    # parts, each replica holding others (`Step.checks_finite`).
    agreements = 2 if sharded else 1
    gradients["all_reduce"] = gradients.get("all_reduce", 0) + agreements
    gradients["bytes_sent"] += 4 * agreements
    assert model.optimizer.inner_optimizer.communication_stats() == per_step(STEPS, **gradients)


class RecordingTransport(LocalTransport):
    """A local transport that adds up, per pattern, the bytes replica 0
    hands it (every replica hands as many)."""

    def __init__(self, devices):
        super().__init__(devices, None, False, False, BYTES_PER_PACK)
        self.sent = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}

    def _record(self, name, tensors):
        self.sent[name] += sum(t.shape.num_elements() * t.dtype.size for t in tensors)

    def all_reduce(self, tensors, weights=None, cast=None):
        self._record("all_reduce", tensors[0])
        return super().all_reduce(tensors, weights, cast)

    def reduce_scatter(self, tensors, weights=None, sum_parts=None):
        self._record("reduce_scatter", tensors[:1])
        return super().reduce_scatter(tensors, weights, sum_parts)

    def all_gather(self, tensors):
        self._record("all_gather", tensors[:1])
        return super().all_gather(tensors)


def initial_states(compressor, shapes):
    """Every replica's state for values of `shapes`, as it starts."""
    states = []
    for device in DEVICES:
        with tf.device(device):
            replica = []
            for shape in shapes:
                state = {}
                for name, spec in compressor.state_spec(tf.TensorShape(shape)).items():
                    initial = spec.initializer if callable(spec.initializer) else tf.zeros
                    state[name] = initial(spec.shape, tf.float32)
                replica.append(state)
        states.append(replica)
    return states


# Packs of at most 1200 bytes: the first value alone, then the other two.
BYTES_PER_PACK = 1200


@pytest.mark.parametrize(
    "compressor, shapes, compressed_bytes",
    [
        # Chunks of 64 among 4 replicas: packs padded to multiples of 256,
        # 300 values to 512 (8 chunks), 7 * 11 + 5 = 82 to 256 (4 chunks).
        (
            compression.Int8(chunk_size=64, start_step=1),
            [(300,), (7, 11), (5,)],
            (512 + 8 * 4) + (256 + 4 * 4),
        ),
        # int4: two codes a byte.
        (
            compression.Int4(chunk_size=64, start_step=1),
            [(300,), (7, 11), (5,)],
            (512 // 2 + 8 * 4) + (256 // 2 + 4 * 4),
        ),
        # Rank 2: P (64 x 2) and Q (2 x 32) for the 64x32 matrix; the
        # vector and the 8x4 matrix (32 < 2 * 12 * 2) whole.
        (
            compression.PowerSGD(rank=2, start_step=1),
            [(64, 32), (32,), (8, 4)],
            4 * (64 * 2 + 2 * 32 + 32 + 8 * 4),
        ),
    ],
    ids=["int8", "int4", "powersgd"],
)
@pytest.mark.parametrize("step", [0, 1], ids=["before_start_step", "from_start_step"])
def test_the_count_is_the_bytes_of_the_buffers_sent(compressor, shapes, compressed_bytes, step):
    assert NUM_REPLICAS == 4
    rng = np.random.default_rng(0)
    values = []
    for device in DEVICES:
        with tf.device(device):
            values.append([tf.constant(rng.normal(size=s), tf.float32) for s in shapes])
    transport = RecordingTransport(DEVICES)
    combine_replicas(
        transport,
        AggregationMethod.SUM,
        values,
        compressor=compressor,
        states=initial_states(compressor, shapes),
        step=tf.constant(step, tf.int64),
    )
    float32_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
    want = float32_bytes if step < compressor.start_step else compressed_bytes
    # The payload: the all-reduces, and int8's reduce-scatter; int8's
    # all-gather sends each replica's part of it on.
    sent = transport.sent["all_reduce"] + transport.sent["reduce_scatter"]
    assert sent == want
    assert transport.sent["all_gather"] * NUM_REPLICAS == transport.sent["reduce_scatter"]
    counted = payload_bytes(
        values[0], compressor, tf.constant(step, tf.int64), NUM_REPLICAS, BYTES_PER_PACK
    )
    assert int(counted) == want
    assert compressor.wire_bytes(
        [tf.TensorSpec(s, tf.float32) for s in shapes], NUM_REPLICAS, BYTES_PER_PACK
    ) == compressed_bytes


def test_int8_pads_every_pack_for_the_replicas():
    int8 = compression.Int8(chunk_size=512)
    value = tf.TensorSpec([1000], tf.float32)
    # To one receiver the codes are not padded.
    assert int8.wire_bytes([value]) == 1000 + 2 * 4
    # 2 replicas: 1024 codes; 4: 2048; one replica's part is whole chunks.
    assert int8.wire_bytes([value], 2, 2**22) == 1024 + 2 * 4
    assert int8.wire_bytes([value], 4, 2**22) == 2048 + 4 * 4
    # Two values that share a pack share its padding; apart, each pads.
    pair = [tf.TensorSpec([600], tf.float32), tf.TensorSpec([400], tf.float32)]
    assert int8.wire_bytes(pair, 2, 2**22) == 1024 + 2 * 4
    assert int8.wire_bytes(pair, 2, 600 * 4) == 2 * (1024 + 2 * 4)
    assert int8.wire_bytes(pair, 2) == 2 * (1024 + 2 * 4)
