"""int8 and PowerSGD with error feedback, against numpy references.

`AggregatingAllReduce.aggregate` runs on 4 logical CPU replicas, eager and
traced, on both transports (the collective one with TensorFlow's real
all-to-all, all-gather and all-reduce), and its results are compared with
tests/error_feedback_reference.py. The optimizer-level tests (state as
optimizer variables, saving, `fit`) are in tests/test_compressed_training.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import NUM_REPLICAS
import placed_values
import replica_aggregate
from error_feedback_reference import int8_reference
from error_feedback_reference import one_step_errors
from error_feedback_reference import powersgd_reference
from error_feedback_reference import quantize_roundtrip
from tf_agn import compression
from tf_agn.compression import int8
from tf_agn.compression import powersgd

TRANSPORTS = ["local", "collective"]
# The state that holds a residual: int8's whole, PowerSGD's as factors.
RESIDUAL_STATE = ("residual", "powersgd_m", "powersgd_p", "powersgd_local_q")
SHAPES = [(40, 30), (30,), (7, 5, 3)]


def per_replica(strategy, arrays):
    """A `PerReplica` value holding `arrays[r]` on replica r's device."""
    return placed_values.per_replica(strategy, DEVICES, arrays)


def values_and_states(strategy, compressor, seed=0, residual_scale=0.1):
    """Random per-replica values and states (non-zero residuals), as numpy
    arrays and as `PerReplica` values."""
    rng = np.random.default_rng(seed)
    arrays = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(NUM_REPLICAS)]
    state_arrays = []
    for r in range(NUM_REPLICAS):
        replica = []
        for shape in SHAPES:
            state = {}
            for name, spec in compressor.state_spec(tf.TensorShape(shape)).items():
                if name in RESIDUAL_STATE:
                    state[name] = (rng.normal(size=spec.shape) * residual_scale).astype(np.float32)
                else:
                    state[name] = spec.initializer(spec.shape, tf.float32).numpy()
            replica.append(state)
        state_arrays.append(replica)
    values = [per_replica(strategy, [a[i] for a in arrays]) for i in range(len(SHAPES))]
    states = [
        {name: per_replica(strategy, [s[i][name] for s in state_arrays]) for name in state_arrays[0][i]}
        for i in range(len(SHAPES))
    ]
    return arrays, state_arrays, values, states


def initial_state(strategy, compressor, shape):
    """`compressor`'s state for a value of `shape` as every replica starts
    it, as `PerReplica` values."""
    state = {}
    for name, spec in compressor.state_spec(tf.TensorShape(shape)).items():
        initial = spec.initializer if callable(spec.initializer) else tf.zeros
        state[name] = per_replica(strategy, [initial(spec.shape, tf.float32).numpy()] * NUM_REPLICAS)
    return state


def owed(compressor, state):
    """`compressor.residual` of one replica's `state` (numpy arrays), as a
    numpy array; 0 without error feedback."""
    residual = compressor.residual({name: tf.constant(v) for name, v in state.items()})
    return 0 if residual is None else residual.numpy()


def replica_state(states, r):
    """Replica r's state, from `run`'s per-replica lists."""
    return {name: copies[r] for name, copies in states.items()}


def run(strategy, ops, method, values, states, compressor, traced, value_scale=1.0, step=None):
    """`ops.aggregate` with a stateful compressor, as numpy arrays: for each
    value, one array per replica; for each state, one per replica."""
    local = strategy.experimental_local_results

    def aggregate():
        combined, new_states = replica_aggregate.aggregate(strategy, 
            method, values, value_scale, compressor=compressor, states=states, step=step
        )
        return (
            [local(c) for c in combined],
            [{name: local(v) for name, v in s.items()} for s in new_states],
        )

    combined, new_states = tf.function(aggregate)() if traced else aggregate()
    return (
        [[t.numpy() for t in c] for c in combined],
        [{name: [t.numpy() for t in v] for name, v in s.items()} for s in new_states],
    )


def relative_error(got, want):
    """||got - want|| / ||want||, in float64."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def strategy_for(transport):
    ops = tf_agn.AggregatingAllReduce(transport=transport, timeout_seconds=60)
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops), ops


# int8.


def test_int8_roundtrip_error_is_at_most_half_a_step_per_chunk():
    rng = np.random.default_rng(0)
    chunks = rng.normal(size=(64, 512)).astype(np.float32) * rng.uniform(0, 100, (64, 1)).astype(np.float32)
    chunks[3] = 0  # an all-zero chunk stays zero
    codes, scales = int8.quantize(tf.constant(chunks))
    restored = int8.dequantize(codes, scales).numpy()
    assert codes.dtype == tf.int8
    step = np.abs(chunks).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(restored - chunks) <= step / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(restored[3], 0)
    np.testing.assert_allclose(restored, quantize_roundtrip(chunks.reshape(-1), 512).reshape(64, 512), atol=1e-6)
    # A chunk's largest magnitude travels exactly.
    rows = np.arange(64)
    peaks = np.abs(chunks).argmax(axis=1)
    np.testing.assert_allclose(restored[rows, peaks], chunks[rows, peaks], rtol=1e-6)


def test_a_non_finite_element_makes_its_chunk_non_finite():
    chunks = np.ones((2, 8), np.float32)
    chunks[0, 3] = np.inf
    codes, scales = int8.quantize(tf.constant(chunks))
    restored = int8.dequantize(codes, scales).numpy()
    assert not np.isfinite(restored[0]).any()
    np.testing.assert_array_equal(restored[1], 1)


@pytest.mark.parametrize("traced", [False, True])
def test_int8_codes_stay_within_127_and_one_step_of_tiny_and_extreme_values(traced):
    # Chunks whose largest magnitude is subnormal, or whose step m/127 is
    # (TensorFlow flushes subnormals to zero on CPUs), and whose step is
    # exact (127) or near float32's largest value.
    tiny = np.finfo(np.float32).tiny
    peaks = np.array([1e-40, 1e-37, tiny * 127 * 0.99, 127.0, 3e38], np.float32)
    chunks = peaks[:, None] * np.linspace(-1, 1, 9, dtype=np.float32)
    quantize = tf.function(int8.quantize, jit_compile=True) if traced else int8.quantize
    codes, scales = quantize(tf.constant(chunks))
    codes, scales = codes.numpy().astype(np.int32), scales.numpy()
    assert np.all(np.abs(codes) <= 127)
    restored = int8.dequantize(tf.constant(codes, tf.int8), tf.constant(scales)).numpy()
    # A step no larger than the chunk's m/127 or the smallest normal float.
    assert np.all(scales <= np.maximum(peaks / 127, tiny) * (1 + 1e-6))
    assert np.all(np.abs(restored - chunks) <= scales[:, None])
    np.testing.assert_array_equal(codes[3], np.round(np.linspace(-127, 127, 9)))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("method", ["sum", "mean"])
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_int8_one_step_matches_the_reference(transport, traced, method, bits):
    strategy, ops = strategy_for(transport)
    compressor = {8: compression.Int8, 4: compression.Int4}[bits](chunk_size=16)
    arrays, state_arrays, values, states = values_and_states(strategy, compressor)
    combined, new_states = run(strategy, ops, method, values, states, compressor, traced, value_scale=2.0)
    scale = 2.0 / NUM_REPLICAS if method == "mean" else 2.0
    flat = [np.concatenate([a.reshape(-1) for a in replica]) * np.float32(scale) for replica in arrays]
    residuals = [np.concatenate([s[i]["residual"].reshape(-1) for i in range(len(SHAPES))]) for s in state_arrays]
    want, want_residuals = int8_reference(flat, residuals, 16, bits=bits)
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
    for r in range(NUM_REPLICAS):
        got = np.concatenate([combined[i][r].reshape(-1) for i in range(len(SHAPES))])
        got_residual = np.concatenate([new_states[i]["residual"][r].reshape(-1) for i in range(len(SHAPES))])
        # The owner's float32 sum may add the replicas in another order,
        # which can move a rounding by one step in rare elements.
        close = np.isclose(got, want, atol=1e-5)
        assert close.mean() > 0.99, close.mean()
        step = np.abs(want).max() / (2 ** (bits - 1) - 1)
        np.testing.assert_allclose(got, want, atol=step * 1.01)
        np.testing.assert_allclose(got_residual[close], want_residuals[r][close], atol=1e-5)
        np.testing.assert_allclose(got + got_residual, want + want_residuals[r], atol=1e-5)
        np.testing.assert_array_equal(got, np.concatenate([combined[i][0].reshape(-1) for i in range(len(SHAPES))]))
    assert sizes[-1] == flat[0].size


# PowerSGD.


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("traced", [False, True])
def test_powersgd_one_step_matches_the_reference(transport, traced):
    strategy, ops = strategy_for(transport)
    compressor = compression.PowerSGD(rank=2, min_compression_rate=1)
    arrays, state_arrays, values, states = values_and_states(strategy, compressor)
    combined, new_states = run(strategy, ops, "mean", values, states, compressor, traced)
    scale = 1 / NUM_REPLICAS
    for i, shape in enumerate(SHAPES):
        if len(shape) < 2:  # a vector travels exactly
            want = sum(a[i] for a in arrays) * scale
            for r in range(NUM_REPLICAS):
                np.testing.assert_allclose(combined[i][r], want, rtol=1e-6, atol=1e-6)
            assert new_states[i] == {}
            continue
        rows = int(np.prod(shape[:-1]))
        matrices = [
            (a[i] * scale + owed(compressor, s[i])).reshape(rows, shape[-1])
            for a, s in zip(arrays, state_arrays)
        ]
        # The state holds Q transposed ([r, cols]); the reference, Q.
        q = state_arrays[0][i]["powersgd_q"].T
        want, want_residuals, want_q = powersgd_reference(matrices, q)
        for r in range(NUM_REPLICAS):
            np.testing.assert_allclose(combined[i][r].reshape(rows, -1), want, atol=2e-5)
            np.testing.assert_allclose(
                owed(compressor, replica_state(new_states[i], r)).reshape(rows, -1),
                want_residuals[r],
                atol=2e-5,
            )
            np.testing.assert_allclose(new_states[i]["powersgd_q"][r], want_q.T, atol=2e-4)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_powersgd_is_exact_when_the_rank_reaches_the_gradients(transport):
    strategy, ops = strategy_for(transport)
    compressor = compression.PowerSGD(rank=3)
    rng = np.random.default_rng(1)
    columns = rng.normal(size=(64, 3))  # every replica's gradient: rank 3, one column space
    arrays = [(columns @ rng.normal(size=(3, 32))).astype(np.float32) for _ in range(NUM_REPLICAS)]
    value = per_replica(strategy, arrays)
    state = initial_state(strategy, compressor, [64, 32])
    (combined,), (new_state,) = run(strategy, ops, "sum", [value], [state], compressor, traced=True)
    for r in range(NUM_REPLICAS):
        np.testing.assert_allclose(combined[r], sum(arrays), atol=1e-4)
        np.testing.assert_allclose(owed(compressor, replica_state(new_state, r)), 0, atol=1e-4)
    # One rank short, it is not.
    short = compression.PowerSGD(rank=2)
    state = {
        "powersgd_q": per_replica(strategy, [np.ones((2, 32), np.float32)] * NUM_REPLICAS),
        "powersgd_m": state["powersgd_m"],
        "powersgd_p": per_replica(strategy, [np.zeros((64, 2), np.float32)] * NUM_REPLICAS),
        "powersgd_local_q": per_replica(strategy, [np.zeros((2, 32), np.float32)] * NUM_REPLICAS),
    }
    (combined,), _ = run(strategy, ops, "sum", [value], [state], short, traced=True)
    assert np.abs(combined[0] - sum(arrays)).max() > 1e-2


# PowerSGD's numerics: rank-deficient, degenerate, tiny and huge gradients,
# step by step against the float64 reference from the state each step
# starts from.

KERNEL = (96, 48)


def random_rank(rng, rank, scale=1.0, shape=KERNEL, singular_values=None):
    """A random `shape` matrix of rank `rank` (with `singular_values`, if
    given), times `scale`, as float32."""
    left = np.linalg.qr(rng.normal(size=(shape[0], rank)))[0]
    right = np.linalg.qr(rng.normal(size=(shape[1], rank)))[0]
    values = np.ones(rank) if singular_values is None else np.asarray(singular_values)
    return ((left * values) @ right.T * scale).astype(np.float32)


def powersgd_steps(transport, compressor, steps, shape=KERNEL):
    """Runs a SUM aggregation with `compressor` once per entry of `steps`
    (each a list of one gradient per replica), carrying the state.

    Returns:
        For each step `(before, combined, after)`: every replica's state
        before and after it (numpy dicts), and replica 0's result; every
        replica's result is checked to be replica 0's.
    """
    strategy, ops = strategy_for(transport)
    state = initial_state(strategy, compressor, shape)
    results = []
    for gradients in steps:
        value = per_replica(strategy, gradients)
        (combined,), (after,) = run(strategy, ops, "sum", [value], [state], compressor, traced=True)
        for copy in combined[1:]:
            np.testing.assert_array_equal(copy, combined[0])
        copies = {name: [t.numpy() for t in strategy.experimental_local_results(v)] for name, v in state.items()}
        before = [replica_state(copies, r) for r in range(NUM_REPLICAS)]
        results.append((before, combined[0], [replica_state(after, r) for r in range(NUM_REPLICAS)]))
        state = {name: per_replica(strategy, copies) for name, copies in after.items()}
    return results


def reference_step(compressor, before, gradients):
    """The float64 reference's `(applied, residuals, q)` for one step that
    starts from our state `before`."""
    matrices = [g.astype(np.float64) + owed(compressor, s) for g, s in zip(gradients, before)]
    return powersgd_reference(matrices, before[0]["powersgd_q"].T.astype(np.float64))


def assert_orthonormal(basis, tolerance=1e-5):
    error = np.abs(basis.T.astype(np.float64) @ basis - np.eye(basis.shape[1])).max()
    assert error < tolerance, error


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("gradient_rank", [1, 2])
def test_powersgd_is_exact_on_gradients_of_lower_rank(transport, gradient_rank):
    """Rank-1 and rank-2 gradients at rank 4, over 5 steps: every applied
    update is the summed gradient and no residual is left, where one pass
    of Gram-Schmidt was 42-96% off."""
    compressor = compression.PowerSGD(rank=4)
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(5):
        # One column space, so the sum has the replicas' rank.
        columns = random_rank(rng, gradient_rank, shape=(KERNEL[0], gradient_rank))
        steps.append([(columns @ rng.normal(size=(gradient_rank, KERNEL[1]))).astype(np.float32) for _ in range(NUM_REPLICAS)])
    for gradients, (before, combined, after) in zip(steps, powersgd_steps(transport, compressor, steps)):
        total = sum(g.astype(np.float64) for g in gradients)
        assert relative_error(combined, total) < 1e-5
        want, _, _ = reference_step(compressor, before, gradients)
        assert relative_error(combined, want) < 1e-5
        for state in after:
            assert_orthonormal(state["powersgd_p"])
            assert np.linalg.norm(owed(compressor, state)) < 1e-5 * np.linalg.norm(total)


@pytest.mark.parametrize("ratio", [1e-4, 1e-6])
def test_powersgd_is_accurate_on_nearly_rank_deficient_gradients(ratio):
    """Gradients of rank r whose smallest singular value is `ratio` times
    the largest (where one pass of Gram-Schmidt failed from about 3e-4)."""
    compressor = compression.PowerSGD(rank=4)
    rng = np.random.default_rng(4)
    steps = []
    for _ in range(5):
        total = random_rank(rng, 4, singular_values=[1.0, 0.3, 0.01, ratio])
        steps.append([total / np.float32(NUM_REPLICAS)] * NUM_REPLICAS)
    for gradients, (before, combined, after) in zip(steps, powersgd_steps("local", compressor, steps)):
        want, _, _ = reference_step(compressor, before, gradients)
        assert relative_error(combined, want) < 1e-5
        # What is not applied is owed, not lost.
        owed_before = sum(owed(compressor, state) for state in before)
        owed_after = sum(owed(compressor, state) for state in after)
        assert relative_error(combined + owed_after, sum(gradients) + owed_before) < 1e-6
        assert_orthonormal(after[0]["powersgd_p"])


def test_powersgd_recovers_its_rank_after_a_degenerate_step():
    """A gradient with one nonzero row leaves Q with one nonzero column;
    the next full-rank gradients are applied at full rank again, where the
    dead columns used to stay 0 for good."""
    compressor = compression.PowerSGD(rank=4)
    rng = np.random.default_rng(5)
    one_row = np.zeros(KERNEL, np.float32)
    one_row[7] = rng.normal(size=KERNEL[1])
    steps = [[one_row] * NUM_REPLICAS]
    steps += [[rng.normal(size=KERNEL).astype(np.float32) for _ in range(NUM_REPLICAS)] for _ in range(4)]
    results = powersgd_steps("local", compressor, steps)
    q_after_degenerate = results[0][2][0]["powersgd_q"]
    assert (np.abs(q_after_degenerate).max(axis=1) == 0).sum() == 3  # the degenerate step
    for step, (gradients, (before, combined, after)) in enumerate(zip(steps[1:], results[1:])):
        singular_values = np.linalg.svd(combined, compute_uv=False)
        assert singular_values[3] > 1e-2 * singular_values[0], singular_values[:5]
        assert singular_values[4] < 1e-5 * singular_values[0], singular_values[:5]
        assert np.abs(after[0]["powersgd_q"]).max(axis=1).min() > 0
        basis = after[0]["powersgd_p"]
        assert_orthonormal(basis)
        matrices = sum(g.astype(np.float64) + owed(compressor, s) for g, s in zip(gradients, before))
        # The projection onto P^'s span, whichever new directions it took.
        assert relative_error(combined, basis @ (basis.T @ matrices)) < 1e-5
        if step > 0:  # Q is of full rank again: as the reference
            want, _, _ = reference_step(compressor, before, gradients)
            assert relative_error(combined, want) < 1e-5


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scale", [1e-11, 1e-30, 2e8], ids=["1e-11", "1e-30", "sigma_1e10"])
def test_powersgd_tiny_and_huge_gradients_give_the_reference(transport, scale):
    """Elements of 1e-11 and 1e-30 in a 1152 x 128 kernel, and a summed
    gradient whose top singular value is about 1e10, over 5 steps: never 0
    or NaN where the uncompressed sum is finite, always the reference."""
    shape = (1152, 128)
    compressor = compression.PowerSGD(rank=4)
    rng = np.random.default_rng(6)
    steps = [
        [(rng.normal(size=shape) * scale).astype(np.float32) for _ in range(NUM_REPLICAS)]
        for _ in range(5)
    ]
    if scale > 1:
        top = np.linalg.svd(sum(steps[0]).astype(np.float64), compute_uv=False)[0]
        assert 5e9 < top < 5e10, top
    for gradients, (before, combined, after) in zip(steps, powersgd_steps(transport, compressor, steps, shape)):
        assert np.isfinite(combined).all() and np.abs(combined).max() > 0
        want, _, _ = reference_step(compressor, before, gradients)
        assert relative_error(combined, want) < 1e-5
        assert_orthonormal(after[0]["powersgd_p"])


def test_powersgd_follows_the_papers_algorithm_over_steps():
    """Five steps of random gradients from the same first Q, against the
    float64 reference carrying its own Q and residuals: orthonormalizing Q
    before P = M Q changes no span, so the paper's steps are ours."""
    compressor = compression.PowerSGD(rank=4)
    rng = np.random.default_rng(7)
    steps = [[rng.normal(size=KERNEL).astype(np.float32) for _ in range(NUM_REPLICAS)] for _ in range(5)]
    results = powersgd_steps("local", compressor, steps)
    q = results[0][0][0]["powersgd_q"].T.astype(np.float64)
    residuals = [np.zeros(KERNEL)] * NUM_REPLICAS
    for gradients, (_, combined, _) in zip(steps, results):
        want, residuals, q = powersgd_reference([g + e for g, e in zip(gradients, residuals)], q)
        assert relative_error(combined, want) < 1e-4


# Error feedback, over many steps.


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "compressor",
    [compression.Int8(chunk_size=16), compression.PowerSGD(rank=1, min_compression_rate=1)],
    ids=["int8", "powersgd"],
)
def test_applied_updates_plus_residuals_sum_to_the_true_gradients(transport, compressor):
    strategy, ops = strategy_for(transport)
    _, _, _, states = values_and_states(strategy, compressor, residual_scale=0)
    applied = [np.zeros(s, np.float64) for s in SHAPES]
    true = [np.zeros(s, np.float64) for s in SHAPES]
    for step in range(6):
        arrays, _, values, _ = values_and_states(strategy, compressor, seed=10 + step)
        combined, states = replica_aggregate.aggregate(strategy, "sum", values, compressor=compressor, states=states)
        for i in range(len(SHAPES)):
            applied[i] += strategy.experimental_local_results(combined[i])[0].numpy()
            true[i] += sum(a[i] for a in arrays)
    for i in range(len(SHAPES)):
        copies = {name: strategy.experimental_local_results(v) for name, v in states[i].items()}
        left = sum(
            owed(compressor, {name: c[r].numpy() for name, c in copies.items()})
            for r in range(NUM_REPLICAS)
        )
        np.testing.assert_allclose(applied[i] + left, true[i], atol=1e-4)
        if states[i]:
            assert np.abs(left).max() > 1e-3  # something was dropped, and kept


def test_without_error_feedback_what_is_dropped_is_lost():
    strategy, ops = strategy_for("local")
    compressor = compression.PowerSGD(rank=1, error_feedback=False)
    assert list(compressor.state_spec(tf.TensorShape([40, 30]))) == ["powersgd_q"]
    _, _, values, states = values_and_states(strategy, compressor)
    arrays, _, _, _ = values_and_states(strategy, compressor)
    combined, _ = run(strategy, ops, "sum", values, states, compressor, traced=False)
    assert np.abs(combined[0][0] - sum(a[0] for a in arrays)).max() > 1e-2


# The state's guard, start_step, the other methods.


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "compressor",
    [compression.Int8(chunk_size=16), compression.PowerSGD(rank=2, min_compression_rate=1)],
    ids=["int8", "powersgd"],
)
def test_a_non_finite_value_leaves_the_state_alone(transport, compressor):
    strategy, ops = strategy_for(transport)
    arrays, state_arrays, _, states = values_and_states(strategy, compressor)
    arrays[2][0][0, 0] = np.nan
    values = [per_replica(strategy, [a[i] for a in arrays]) for i in range(len(SHAPES))]
    combined, new_states = run(strategy, ops, "sum", values, states, compressor, traced=True)
    assert not np.isfinite(combined[0][0]).all()
    for i in range(len(SHAPES)):
        for name, copies in new_states[i].items():
            for r in range(NUM_REPLICAS):
                np.testing.assert_array_equal(copies[r], state_arrays[r][i][name])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("magnitude", [1e20, 1e30, 1e37, 5e37])
def test_powersgd_large_values_give_the_projection_or_nan(transport, magnitude):
    """PowerSGD decides finiteness from its small buffers, not its results.
    Orthonormalization's scaling keeps P^ inside float32 at any size, so
    the result is the reference's as long as Q's column sums, which bound
    P^ Q^T, fit in float32 (with a factor 2 of margin); past that the
    results are NaN, never a finite wrong value, and the state stays."""
    strategy, ops = strategy_for(transport)
    compressor = compression.PowerSGD(rank=2, min_compression_rate=1)
    arrays, state_arrays, _, states = values_and_states(strategy, compressor, residual_scale=0)
    for replica in arrays:
        replica[0] *= np.float32(magnitude)
    values = [per_replica(strategy, [a[i] for a in arrays]) for i in range(len(SHAPES))]
    combined, new_states = run(strategy, ops, "sum", values, states, compressor, traced=True)
    want, _, want_q = powersgd_reference([a[0] for a in arrays], state_arrays[0][0]["powersgd_q"].T)
    fits = 2 * np.abs(want_q).sum(axis=1).max() < np.finfo(np.float32).max
    assert fits == (magnitude <= 1e37)  # both branches are exercised
    for r in range(NUM_REPLICAS):
        np.testing.assert_allclose(combined[1][r], sum(a[1] for a in arrays), rtol=1e-6)
        if fits:
            assert relative_error(combined[0][r], want) < 1e-5
            continue
        assert np.isnan(combined[0][r]).all() and np.isnan(combined[2][r]).all()
        for i in range(len(SHAPES)):
            for name, copies in new_states[i].items():
                np.testing.assert_array_equal(copies[r], state_arrays[r][i][name])


def test_powersgd_finiteness_bounds_the_decoded_product():
    """Q's entries are finite but sum, down a column, past what float32
    holds: P^ Q^T could overflow, so the step is not finite."""
    parts = [tf.ones([3])]
    bases = [tf.eye(4, 2)]
    for q_value, want in ((1e37, True), (1e38, False), (np.inf, False)):
        q = tf.fill([2, 5], np.float32(q_value))
        assert bool(powersgd._finite(parts, bases, [q])) is want, q_value
    finite_q = [tf.ones([2, 5])]
    assert bool(powersgd._finite(parts, bases, finite_q))
    assert not bool(powersgd._finite([tf.constant([np.nan])], bases, finite_q))
    assert not bool(powersgd._finite(parts, [tf.fill([4, 2], np.nan)], finite_q))


def test_powersgd_moderate_values_stay_finite_and_exact():
    """The finiteness check's margin costs nothing at sizes gradients have:
    values of 1e15 (squared norms near 1e32) still combine to the sum."""
    strategy, ops = strategy_for("local")
    compressor = compression.PowerSGD(rank=3, min_compression_rate=1)
    rng = np.random.default_rng(2)
    columns = rng.normal(size=(40, 3))
    arrays = [(columns @ rng.normal(size=(3, 30)) * 1e15).astype(np.float32) for _ in range(NUM_REPLICAS)]
    state = initial_state(strategy, compressor, [40, 30])
    value = per_replica(strategy, arrays)
    (combined,), _ = run(strategy, ops, "sum", [value], [state], compressor, traced=True)
    np.testing.assert_allclose(combined[0], sum(arrays), rtol=1e-3, atol=1e-4 * 1e15)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_before_start_step_values_travel_exactly_and_the_state_waits(transport):
    strategy, ops = strategy_for(transport)
    compressor = compression.PowerSGD(rank=1, min_compression_rate=1, start_step=3)
    arrays, state_arrays, values, states = values_and_states(strategy, compressor)
    for step, exact in ((2, True), (3, False)):
        combined, new_states = run(
            strategy, ops, "sum", values, states, compressor, traced=True, step=tf.constant(step, tf.int64)
        )
        error = np.abs(combined[0][1] - sum(a[0] for a in arrays)).max()
        moved = np.abs(
            owed(compressor, replica_state(new_states[0], 0)) - owed(compressor, state_arrays[0][0])
        ).max()
        if exact:
            assert error < 1e-5 and moved == 0
        else:
            assert error > 1e-2 and moved > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_only_first_replica_sends_replica_0s_value_and_none_sends_nothing(transport):
    strategy, ops = strategy_for(transport)
    compressor = compression.Int8(chunk_size=16)
    arrays, state_arrays, _, _ = values_and_states(strategy, compressor)
    _, _, values, states = values_and_states(strategy, compressor, residual_scale=0)
    combined, new_states = run(strategy, ops, "only_first_replica", values, states, compressor, traced=True)
    for i in range(len(SHAPES)):
        step = np.abs(arrays[0][i]).max() / 127
        for r in range(NUM_REPLICAS):
            np.testing.assert_allclose(combined[i][r], arrays[0][i], atol=2 * step)
    combined, new_states = run(strategy, ops, "none", values, states, compressor, traced=False)
    for r in range(NUM_REPLICAS):
        np.testing.assert_array_equal(combined[0][r], arrays[r][0])
        np.testing.assert_array_equal(new_states[0]["residual"][r], 0)


# Construction, names, bytes.


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: compression.Int8(chunk_size=6), "chunk_size must be a positive multiple of 4"),
        (lambda: compression.Int8(chunk_size=0), "chunk_size"),
        (lambda: compression.PowerSGD(rank=0), "rank must be an int >= 1; received 0"),
        (lambda: compression.PowerSGD(rank=2.5), "received 2.5"),
        (lambda: compression.PowerSGD(min_compression_rate=0.5), "min_compression_rate"),
        (lambda: compression.PowerSGD(start_step=-1), "start_step must be an int >= 0; received -1"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_wire_bytes():
    int8_compressor = compression.Int8()
    matrix = tf.TensorSpec([4096, 4096], tf.float32)
    assert int8_compressor.wire_bytes([matrix]) == 4096 * 4096 * (1 + 4 / 512)
    powersgd = compression.PowerSGD(rank=4)
    assert powersgd.wire_bytes([matrix]) == 2 * 4096 * 4 * 4
    # A Conv2D kernel is (3 * 3 * 64) x 128; a bias is sent whole.
    assert powersgd.matrix_shape(tf.TensorShape([3, 3, 64, 128])) == (576, 128)
    assert powersgd.wire_bytes([tf.TensorSpec([128], tf.float32)]) == 512
    assert powersgd.wire_bytes([matrix, tf.TensorSpec([128], tf.float32)], 4, 2**22) == (
        2 * 4096 * 4 * 4 + 512
    )
    # Too small to gain 2x: sent whole.
    assert powersgd.matrix_shape(tf.TensorShape([8, 8])) is None


@pytest.mark.parametrize("compressor", [compression.Int8(chunk_size=512), compression.PowerSGD(rank=2)], ids=["int8", "powersgd"])
def test_an_encoded_commit_holds_its_wire_bytes(compressor):
    """What a commit to a parameter server sends (`encode`) is what
    `wire_bytes` counts, padding included (int8 pads 1000 values to 1024
    before it quantizes; the padding's codes stay behind)."""
    rng = np.random.default_rng(0)
    for shape in ((1000,), (40, 30)):
        value = tf.constant(rng.normal(size=shape).astype(np.float32))
        state = {
            name: tf.constant(spec.initializer(spec.shape, tf.float32))
            if callable(spec.initializer) else tf.zeros(spec.shape)
            for name, spec in compressor.state_spec(tf.TensorShape(shape)).items()
        }
        payload, _ = compressor.encode(value, state)
        sent = sum(t.shape.num_elements() * t.dtype.size for t in payload)
        assert sent == compressor.wire_bytes([value]), shape
        decoded = compressor.decode(payload, tf.TensorShape(shape), tf.float32).numpy()
        if isinstance(compressor, compression.Int8):
            step = np.abs(value.numpy()).max() / 127
            assert np.abs(decoded - value.numpy()).max() <= step / 2 * (1 + 1e-6)


def test_compressors_round_trip_through_get_and_serialize():
    for compressor in (
        compression.Int8(),
        compression.Int8(chunk_size=64, error_feedback=False),
        compression.PowerSGD(rank=4, start_step=10, seed=3),
    ):
        again = compression.get(compression.serialize(compressor))
        assert type(again) is type(compressor) and again is not compressor
        assert again.get_config() == compressor.get_config()
    assert compression.serialize(compression.Int8()) == "int8"
    assert isinstance(compression.get("INT8"), compression.Int8)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_gpu_workers_check_passes_on_cpus(transport):
    """tests/gpu_worker.py runs `one_step_errors` on GPUs; here, on the same
    code paths, on logical CPUs, so that it cannot rot unseen."""
    strategy, ops = strategy_for(transport)
    errors = one_step_errors(ops, strategy, DEVICES)
    assert errors["int8"] <= 1.01, errors
    assert errors["powersgd"] <= 1e-4, errors
    for case in ("powersgd_rank_1", "powersgd_tiny", "powersgd_huge"):
        assert errors[case] <= 1e-5, errors
