"""numpy references of int8 (and int4) and PowerSGD with error feedback, and a check
that runs `AggregatingAllReduce.aggregate` against them.

The references follow the papers' algorithms step by step, in numpy,
independently of the TensorFlow code: PowerSGD in float64 (Vogels et al.
2019, Algorithms 1 and 2), int8 and int4 in float32 as the wire carries them.
tests/test_error_feedback.py runs `check` on logical CPUs;
tests/gpu_worker.py on GPUs.
"""

import numpy as np
import tensorflow as tf

import placed_values
import replica_aggregate

def quantize(chunks, bits=8):
    """The symmetric codes (within ±(2^(bits-1) - 1), as float32) and the
    float32 scales of finite `chunks` ([n, chunk_size])."""
    levels = np.float32(2 ** (bits - 1) - 1)
    # Steps below the smallest normal float32 would be flushed to zero.
    scales = np.maximum(np.abs(chunks).max(axis=1) / levels, np.finfo(np.float32).tiny)
    return np.clip(np.round(chunks / scales[:, None]), -levels, levels), scales


def quantize_roundtrip(flat, chunk_size, bits=8):
    """What `bits`-bit integers with one scale per chunk make of `flat`
    (float32, a multiple of `chunk_size` long)."""
    codes, scales = quantize(flat.reshape(-1, chunk_size), bits)
    return (codes * scales[:, None]).astype(np.float32).reshape(-1)


def int8_reference(values, residuals, chunk_size, bits=8):
    """One int8 (or, with `bits=4`, int4) aggregation of one pack.

    Args:
        values: for each replica, its scaled values, flat float32.
        residuals: for each replica, its residuals, flat float32.
        chunk_size: the elements that share a scale.
        bits: the bits of a code.

    Returns:
        `(applied, new_residuals)`: the sum every replica receives, and
        each replica's new residual.
    """
    n, length = len(values), values[0].size
    unit = n * chunk_size
    padded = -(-length // unit) * unit
    part = padded // n
    sent = [np.pad(v + e, (0, padded - length)).astype(np.float32) for v, e in zip(values, residuals)]
    restored = [quantize_roundtrip(s, chunk_size, bits) for s in sent]
    total = np.zeros(padded, np.float32)
    for r in restored:
        total += r
    applied = np.concatenate(
        [quantize_roundtrip(total[j * part : (j + 1) * part], chunk_size, bits) for j in range(n)]
    )
    new = []
    for w in range(n):
        error = sent[w] - restored[w]
        own = slice(w * part, (w + 1) * part)
        error[own] += total[own] - applied[own]
        new.append(error[:length])
    return applied[:length], new


def orthogonalize(matrix):
    """The paper's orthogonalization of `matrix`'s columns, in float64:
    Gram-Schmidt's basis (each column's span kept in order, positive
    coefficients on the diagonal), computed stably by a QR decomposition
    so that it stays orthonormal for rank-deficient inputs too."""
    q, r = np.linalg.qr(matrix.astype(np.float64))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def powersgd_reference(matrices, q):
    """One rank-r PowerSGD aggregation of one matrix.

    Args:
        matrices: for each replica, its scaled value plus residual, as a
            matrix.
        q: the warm-started Q ([cols, r]), the same on every replica.

    Returns:
        `(applied, new_residuals, new_q)`.
    """
    matrices = [m.astype(np.float64) for m in matrices]
    p = sum(m @ q for m in matrices)
    basis = orthogonalize(p)
    local_qs = [m.T @ basis for m in matrices]
    new_q = sum(local_qs)
    applied = basis @ new_q.T
    residuals = [m - basis @ lq.T for m, lq in zip(matrices, local_qs)]
    return applied, residuals, new_q


def one_step_errors(ops, strategy, devices, seed=0):
    """The largest differences between one `ops.aggregate` (MEAN, traced)
    of random values with int8 and with PowerSGD, and the references; for
    tests/gpu_worker.py, where a GPU runs the compiled compressors.

    PowerSGD is also checked on the gradients where a less careful
    orthogonalization fails: rank 1 at rank 4, elements of 1e-30, and a
    top singular value near 1e10.

    Returns:
        `{"int8": float, "powersgd": float, "powersgd_rank_1": float,
        "powersgd_tiny": float, "powersgd_huge": float}`: for int8 in
        units of one quantization step of the sum (at most 1 where the
        owner's sum rounded differently), for PowerSGD absolute, and for
        its hard cases relative to the reference's norm.
    """
    from tf_agn import compression

    n = len(devices)
    rng = np.random.default_rng(seed)
    arrays = [rng.normal(size=(64, 48)).astype(np.float32) for _ in range(n)]
    scaled = [a / np.float32(n) for a in arrays]

    def aggregate(compressor, arrays):
        spec = compressor.state_spec(tf.TensorShape(arrays[0].shape))
        initial = {
            key: s.initializer(s.shape, tf.float32).numpy()
            if callable(s.initializer)
            else np.zeros(s.shape, np.float32)
            for key, s in spec.items()
        }
        state = {
            key: placed_values.per_replica(strategy, devices, [value] * n)
            for key, value in initial.items()
        }
        values = placed_values.per_replica(strategy, devices, arrays)

        @tf.function
        def run():
            (combined,), _ = replica_aggregate.aggregate(strategy, "mean", [values], compressor=compressor, states=[state])
            return strategy.experimental_local_results(combined)

        return [t.numpy() for t in run()], initial

    got, _ = aggregate(compression.Int8(chunk_size=64), arrays)
    want, _ = int8_reference(
        [s.reshape(-1) for s in scaled], [np.zeros(64 * 48, np.float32)] * n, 64
    )
    step = np.abs(want).max() / 127
    errors = {"int8": max(float(np.abs(g.reshape(-1) - want).max() / step) for g in got)}

    got, initial = aggregate(compression.PowerSGD(rank=2), arrays)
    want, _, _ = powersgd_reference(scaled, initial["powersgd_q"].T)
    errors["powersgd"] = max(float(np.abs(g - want).max()) for g in got)

    column = rng.normal(size=(64, 1))
    hard_cases = {
        "powersgd_rank_1": [column @ rng.normal(size=(1, 48)) for _ in range(n)],
        "powersgd_tiny": [rng.normal(size=(64, 48)) * 1e-30 for _ in range(n)],
        "powersgd_huge": [rng.normal(size=(64, 48)) * 1e9 for _ in range(n)],
    }
    for name, hard in hard_cases.items():
        hard = [a.astype(np.float32) for a in hard]
        got, initial = aggregate(compression.PowerSGD(rank=4), hard)
        want, _, _ = powersgd_reference([a / np.float32(n) for a in hard], initial["powersgd_q"].T)
        errors[name] = max(float(np.linalg.norm(g - want) / np.linalg.norm(want)) for g in got)
    return errors
