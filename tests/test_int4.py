"""int4 (`tf_agn.compression.Int4`, int8's compressor with 4-bit codes)
against numpy: codes, scales and the int32 words they travel in, the
all-reduce and every replica's residual on both transports, the bytes, a
`.keras` round trip, stock strategies and XLA, and Streaming DiLoCo's
outer gradients.

Sharded state's rows are checked with int8's in tests/test_sharding.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import error_feedback_reference as reference
import tf_agn
from compression_model import build
from compression_model import data
from conftest import DEVICES
from mlp import LEARNING_RATE
from test_any_strategy import SimulatedReplicas
from test_any_strategy import local_transport_change
from test_any_strategy import reduction_to_one_device
from test_any_strategy import weight_change
from test_streaming_diloco import fit_recording
from test_streaming_diloco import initial_weights
from tf_agn import compression
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.routing import combine_replicas
from tf_agn.compression import int8
from tf_agn.optimizers import StreamingDiLoCo


def numpy_words(codes, scales):
    """One row's codes (ints within ±7), eight to an int32 word, the first
    in the lowest 4 bits, then its scales' bits."""
    nibbles = (codes.astype(np.int64) & 0xF).reshape(-1, 8)
    words = (nibbles << (4 * np.arange(8))).sum(axis=1).astype(np.uint32).view(np.int32)
    return np.concatenate([words, scales.astype(np.float32).view(np.int32)])


def test_codes_scales_and_words_are_numpys():
    rng = np.random.default_rng(0)
    chunks = rng.normal(size=(6, 16)).astype(np.float32) * rng.uniform(0, 100, (6, 1)).astype(np.float32)
    chunks[2] = 0  # an all-zero chunk stays zero
    codes, scales = int8.quantize(tf.constant(chunks), bits=4)
    want_codes, want_scales = reference.quantize(chunks, bits=4)
    assert codes.dtype == tf.int8
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    assert np.abs(want_codes).max() == 7 and (want_codes == -7).any()
    restored = int8.dequantize(codes, scales).numpy()
    assert np.all(np.abs(restored - chunks) <= want_scales[:, None] / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(restored[2], 0)
    # Two rows of three chunks each, on the wire.
    wire = int8._to_wire(codes, scales, 2, 4)
    assert wire.dtype == tf.int32 and wire.shape == (2, 48 // 8 + 3)
    for r in range(2):
        np.testing.assert_array_equal(
            wire[r].numpy(), numpy_words(want_codes[3 * r : 3 * r + 3], want_scales[3 * r : 3 * r + 3])
        )

    # Sharded state's rows: two replicas reduce-scatter two rows of three
    # chunks each, replica r's rows being r + 1 times `chunks`. Each sends
    # its rows' codes (the same codes: a scale is per chunk) and keeps
    # what they dropped; replica r receives row r of both.
    rows = chunks.reshape(2, 48)
    values = [[tf.constant(rows * (r + 1))] for r in range(2)]
    states = [[{"residual": tf.zeros([2, 48])}] for _ in range(2)]
    parts, new_states = combine_replicas(
        SimulatedReplicas(2), AggregationMethod.SUM, values, compressor=compression.Int4(chunk_size=16),
        states=states, pattern="reduce_scatter",
    )
    restored_rows = restored.reshape(2, 48)
    # A residual is a difference of values up to |2 * chunks|: a few ulps of it.
    ulps = 4 * np.spacing(2 * np.abs(chunks).max())
    for r in range(2):
        np.testing.assert_allclose(parts[r][0].numpy(), 3 * restored_rows[r], rtol=1e-6)
        np.testing.assert_allclose(
            new_states[r][0]["residual"].numpy(), (r + 1) * (rows - restored_rows), rtol=0, atol=ulps
        )


def test_wire_bytes_are_half_a_byte_per_element_and_a_scale_per_chunk():
    int4 = compression.Int4(chunk_size=512)
    value = tf.TensorSpec([1001], tf.float32)
    # To one receiver the codes are not padded: 1001 codes in 501 bytes.
    assert int4.wire_bytes([value]) == 501 + 2 * 4
    # Among 4 replicas each one's part is a whole chunk: 2048 codes.
    assert int4.wire_bytes([value], 4, 2**22) == 2048 // 2 + 4 * 4
    assert int4.wire_bytes([value], 4, 2**22) < compression.Int8().wire_bytes([value], 4, 2**22)
    rng = np.random.default_rng(0)
    for shape in ((1001,), (40, 30)):
        tensor = tf.constant(rng.normal(size=shape).astype(np.float32))
        payload, state = int4.encode(tensor, {"residual": tf.zeros(shape)})
        assert sum(t.shape.num_elements() * t.dtype.size for t in payload) == int4.wire_bytes([tensor])
        decoded = int4.decode(payload, tf.TensorShape(shape), tf.float32).numpy()
        np.testing.assert_allclose(decoded + state["residual"].numpy(), tensor.numpy(), atol=1e-6)
        assert np.abs(decoded - tensor.numpy()).max() <= np.abs(tensor.numpy()).max() / 14 * (1 + 1e-6)


def test_fit_counts_float32_before_start_step_then_int4():
    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(strategy, lambda: tf_agn.optimizers.SGD(0.1, compression=compression.Int4(start_step=2)))
    x, y = data(rows=4 * 64)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    # The 20x64 and 64x3 kernels and their biases in one pack, padded so
    # that each replica's part is a chunk of 512: 2048 codes, 4 scales.
    float32_bytes = 4 * (20 * 64 + 64 + 64 * 3 + 3)
    sent = 2 * float32_bytes + 2 * (2048 // 2 + 4 * 4)
    assert model.optimizer.communication_stats() == {
        "all_reduce_calls": 4,
        "reduce_scatter_calls": 0, "all_gather_calls": 0, "all_to_all_calls": 0,
        "bytes_sent": sent, "bytes_received": sent,
    }


def test_names_configs_and_a_keras_file(tmp_path):
    assert isinstance(compression.get("INT4"), compression.Int4)
    assert compression.serialize(compression.Int4()) == "int4"
    custom = compression.Int4(chunk_size=64, error_feedback=False, start_step=3)
    again = compression.get(compression.serialize(custom))
    assert type(again) is compression.Int4 and again.get_config() == custom.get_config()
    with pytest.raises(ValueError, match=r"chunk_size must be a positive multiple of 8 .*received 12"):
        compression.Int4(chunk_size=12)

    strategy = tf_agn.strategies.mirrored(devices=DEVICES)
    model = build(strategy, lambda: tf_agn.optimizers.Adam(1e-2, compression="int4"))
    x, y = data()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    assert model.optimizer.get_config()["compression"] == "int4"
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert type(loaded.optimizer.compression) is compression.Int4
    assert loaded.optimizer.compression.get_config() == compression.Int4().get_config()
    for got, want in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)

    def owed(m):  # the residuals summed over the replicas
        return [
            np.sum([t.numpy() for t in strategy.experimental_local_results(v.value)], axis=0)
            for v in m.optimizer.variables if v.path.endswith("residual")
        ]

    saved, restored = owed(model), owed(loaded)
    assert len(saved) == len(restored) == 4 and np.abs(saved[0]).max() > 0
    for got, want in zip(restored, saved, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_stock_strategy_gives_the_local_transports_weights_bitwise():
    """Without tf_agn's ops the reduce-scatter is an all-gather of the same
    codes, summed in the same order, as for int8 (tests/test_any_strategy.py)."""
    want, want_stats = local_transport_change("int4")
    got, stats = weight_change(reduction_to_one_device(), "int4")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert stats["bytes_sent"] == want_stats["bytes_sent"]


def test_the_replica_side_work_compiles_with_xla():
    """Packing codes into bytes and back, compiled whole, as a TPU compiles
    the step, gives the eager result."""
    size, shapes, compressor = 3, [(40, 24), (24,), (7, 5)], compression.Int4(chunk_size=64)
    rng = np.random.default_rng(0)
    values = [[tf.constant(rng.normal(size=s), tf.float32) for s in shapes] for _ in range(size)]
    states = [[{"residual": tf.zeros(s)} for s in shapes] for _ in range(size)]

    def step():
        return combine_replicas(
            SimulatedReplicas(size), AggregationMethod.MEAN, values, compressor=compressor, states=states
        )

    eager, compiled = step(), tf.function(step, jit_compile=True)()
    for got, want in zip(tf.nest.flatten(compiled), tf.nest.flatten(eager), strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    # What the replicas owe plus what they received is what they sent.
    for i in range(len(shapes)):
        sent = sum(v[i].numpy() for v in values) / size
        owed = sum(eager[1][r][i]["residual"].numpy() for r in range(size))
        np.testing.assert_allclose(eager[0][0][i].numpy() + owed, sent, atol=1e-5)


def test_streaming_diloco_trains_with_4_bit_outer_gradients_near_float32():
    """6 windows of H = 4, F = 2 fragments, τ = 1, with compression="int4"
    and uncompressed: the centers' changes differ by under 5%.

    One exchange rounds each element of Δ by at most max|Δ| / 7 (half a
    step where each replica sends, half where the owner re-quantizes the
    sum); error feedback sends that rounding with the next exchange, so
    what has not landed after 6 windows is about one exchange's rounding,
    1/7 of one of 6 windows' changes, ≈ 2.4%. The bound leaves 2x for the
    outer Nesterov momentum and the runs' drift apart (measured: 2.6%;
    int8 0.15%; int4 without error feedback 8.5%, past the bound).
    """
    (plain, int4), difference = int4_against_float32(local_steps=4, sync_delay=1)
    assert 1e-3 < difference < 0.05, difference
    # 12 exchanges of one fragment each (3*4 + 4 + 4*3 + 3 = 31 and
    # 4*4 + 4 + 3*2 + 2 = 28 values): each padded for 4 replicas to 4
    # chunks of 512, 2048 codes in 1024 bytes and 4 scales, where float32
    # sends 4 bytes a value.
    assert int4.optimizer.communication_stats()["bytes_sent"] == 12 * (2048 // 2 + 4 * 4)
    assert plain.optimizer.communication_stats()["bytes_sent"] == 6 * 4 * (31 + 28)


def test_a_variable_cut_between_slices_keeps_error_feedback_for_each_piece():
    # H = 6, F = 2, τ = 2: fragment 1's slices cut variable 2 (16 values)
    # after its 14th (test_streaming_diloco), so each piece has its own
    # residual, and the centers stay near float32's as above.
    (_, int4), difference = int4_against_float32(local_steps=6, sync_delay=2)
    assert 1e-3 < difference < 0.05, difference
    residuals = {
        v.path.rpartition("/")[2]: tuple(v.shape)
        for v in int4.optimizer.variables
        if v.path.endswith("_residual")
    }
    assert len(residuals) == 9, residuals
    kernel = int4.trainable_variables[2].path.replace("/", "_")
    assert residuals[f"{kernel}_0_14_residual"] == (14,)
    assert residuals[f"{kernel}_14_16_residual"] == (2,)


def int4_against_float32(local_steps, sync_delay, steps=24):
    """StreamingDiLoCo (F = 2) uncompressed and with int4: both models, and
    how far int4's centers end from float32's, relative to how far
    float32's moved."""
    def run_with(compressor):
        return fit_recording(
            lambda: StreamingDiLoCo(
                keras.optimizers.SGD(LEARNING_RATE), local_steps=local_steps, num_fragments=2,
                sync_delay=sync_delay, compression=compressor,
            ),
            steps,
        )

    (plain, plain_states), (int4, int4_states) = run_with(None), run_with("int4")
    start = np.concatenate([w.ravel() for w in initial_weights()])
    plain_centers, int4_centers = (
        np.concatenate([c.ravel() for c in states[-1][1]]) for states in (plain_states, int4_states)
    )
    difference = np.linalg.norm(int4_centers - plain_centers) / np.linalg.norm(plain_centers - start)
    return (plain, int4), difference
