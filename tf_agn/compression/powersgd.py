"""`PowerSGD`: low-rank gradients by one power iteration per step.

Vogels, Karimireddy and Jaggi (NeurIPS 2019), Algorithms 1 and 2, with Q
orthonormalized before use as PyTorch's hook does. Each gradient of rank
>= 2 is a matrix M (its last axis the columns), plus this replica's
residual e; Q (cols x r) is warm-started from the previous step:

    M = g + e
    P = M orthonormalize(Q);   all-reduce P
    P^ = orthonormalize(P)
    Q_w = M^T P^;              all-reduce Q
    applied = P^ Q^T
    e = M - P^ Q_w^T

Vectors, and matrices too small to gain `min_compression_rate`, travel
uncompressed in the first all-reduce.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_agn.compression.compressor import StateSpec
from tf_agn.compression.compressor import each_finite
from tf_agn.compression.compressor import num_elements
from tf_agn.compression.error_feedback import ErrorFeedbackCompressor
from tf_agn.compression.error_feedback import compiled


@keras.saving.register_keras_serializable(package="tf_agn")
class PowerSGD(ErrorFeedbackCompressor):
    """Rank-r PowerSGD with error feedback and warm-started Q.

    Args:
        rank: r, the rank of each compressed gradient; an int >= 1.
        min_compression_rate: compress a matrix only if it sends this many
            times fewer floats (rows * cols / ((rows + cols) * rank)).
        error_feedback: see `tf_agn.compression.ErrorFeedbackCompressor`.
        start_step: see `tf_agn.compression.ErrorFeedbackCompressor`.
        seed: the seed of the first Q, the same on every worker.

    Raises:
        ValueError: for a `rank` that is not an int >= 1, or a
            `min_compression_rate` below 1.
    """

    name = "powersgd"
    # Its factors are products of whole matrices: no reduce-scatter.
    patterns = {"all_reduce": ("all_reduce",)}

    def __init__(
        self, rank=1, min_compression_rate=2.0, error_feedback=True, start_step=0, seed=0
    ):
        super().__init__(error_feedback, start_step)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1; received {rank!r}.")
        if not min_compression_rate >= 1:
            raise ValueError(
                f"min_compression_rate must be >= 1; received {min_compression_rate!r}."
            )
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)

    def matrix_shape(self, shape):
        """`(rows, cols)` if a value of `shape` is compressed, else None."""
        if shape.rank < 2:
            return None
        rows, cols = shape[:-1].num_elements(), shape[-1]
        if rows * cols < self.min_compression_rate * (rows + cols) * self.rank:
            return None
        return rows, cols

    def state_spec(self, shape):
        matrix = self.matrix_shape(shape)
        if matrix is None:
            return {}
        seed = self.seed

        def first_q(shape, dtype):
            return tf.random.stateless_normal(shape, seed=[seed, 0], dtype=dtype)

        rows, cols = matrix
        # Q is kept transposed ([r, cols]): XLA's CPU dot reads a large
        # transposed operand about six times slower, so every product reads M
        # as it lies.
        spec = {"powersgd_q": StateSpec((self.rank, cols), first_q)}
        if self.error_feedback:
            # The residual M - P^ Q_w^T is kept as its factors, saving a pass
            # over the gradients per step; it is linear in M and Q_w (owed).
            spec["powersgd_m"] = StateSpec(shape, "zeros", owed=True)
            spec["powersgd_p"] = StateSpec((rows, self.rank), "zeros")
            spec["powersgd_local_q"] = StateSpec((self.rank, cols), "zeros", owed=True)
        return spec

    def residual(self, state):
        """M - P^ Q_w^T, from the factors that `state` keeps."""
        if "powersgd_m" not in state:
            return None
        m = state["powersgd_m"]
        return tf.reshape(_owed(state, self.matrix_shape(m.shape)), m.shape)

    def state_owing(self, state, residual):
        # All of it in M, with no low-rank part to subtract.
        return dict(
            state,
            powersgd_m=residual,
            powersgd_p=np.zeros_like(state["powersgd_p"]),
            powersgd_local_q=np.zeros_like(state["powersgd_local_q"]),
        )

    def wire_bytes(self, values, num_replicas=1, bytes_per_pack=None):
        """P and Q of each compressed matrix, other values whole; nothing is
        padded."""
        del num_replicas, bytes_per_pack

        def sent(value):
            matrix = self.matrix_shape(tf.TensorShape(value.shape))
            elements = num_elements(value) if matrix is None else sum(matrix) * self.rank
            return elements * tf.as_dtype(value.dtype).size

        return sum(sent(v) for v in values)

    def get_config(self):
        return {
            "rank": self.rank,
            "min_compression_rate": self.min_compression_rate,
            **super().get_config(),
            "seed": self.seed,
        }

    def encode(self, value, state):
        matrix = self.matrix_shape(value.shape)
        if matrix is None:
            return (value,), {}
        m = _matrix(value, state, matrix)
        basis = orthonormalize(
            tf.linalg.matmul(m, orthonormal_rows(state["powersgd_q"]), transpose_b=True)
        )
        q = tf.linalg.matmul(basis, m, transpose_a=True)
        new = {"powersgd_q": _kept_q(q, state["powersgd_q"])}
        if self.error_feedback:
            new.update(_factors(m, basis, q, value.shape))
        return (basis, q), new

    def decode(self, payload, shape, dtype):
        if len(payload) == 1:
            return payload[0]
        basis, q = payload
        return tf.cast(tf.reshape(low_rank(basis, q), shape), dtype)

    def combine(self, transport, values, states, weights, pattern="all_reduce"):
        del pattern  # Only "all_reduce" (`patterns`).
        devices, jit_compile = transport.devices, transport.jit_compile
        plan = tuple(
            (tuple(v.shape.as_list()), self.matrix_shape(v.shape)) for v in values[0]
        )
        if not any(matrix for _, matrix in plan):
            combined = transport.all_reduce(values, weights)
            return combined, states, each_finite(devices, combined)

        firsts, matrices = [], []
        for r, device in enumerate(devices):
            with tf.device(device):
                first, replica_matrices = compiled(_project, jit_compile, device)(
                    values[r], states[r], weights[r], plan
                )
            firsts.append(first)
            matrices.append(replica_matrices)
        summed_firsts = [summed for (summed,) in transport.all_reduce([[f] for f in firsts])]
        seconds, bases = [], []
        for r, device in enumerate(devices):
            with tf.device(device):
                second, basis = compiled(_project_back, jit_compile, device)(
                    summed_firsts[r], matrices[r], plan, self.rank
                )
            seconds.append(second)
            bases.append(basis)
        summed_seconds = [summed for (summed,) in transport.all_reduce([[s] for s in seconds])]
        combined, new_states, finite = [], [], []
        for r, device in enumerate(devices):
            with tf.device(device):
                tensors, qs, replica_finite = compiled(_reconstruct, jit_compile, device)(
                    summed_firsts[r],
                    summed_seconds[r],
                    bases[r],
                    [state.get("powersgd_q") for state in states[r]],
                    plan,
                    self.rank,
                )
                # Outside XLA, whose outputs would be copies of M.
                local_qs = _split_second(seconds[r], plan, self.rank)
                compressed = iter(zip(qs, matrices[r], bases[r], local_qs))
                replica_states = []
                for shape, matrix in plan:
                    new = {}
                    if matrix:
                        q, m, basis, local_q = next(compressed)
                        new["powersgd_q"] = q
                        if self.error_feedback:
                            new.update(_factors(m, basis, local_q, shape))
                    replica_states.append(new)
            combined.append(tensors)
            new_states.append(replica_states)
            finite.append(replica_finite)
        return combined, new_states, finite


def orthonormalize(matrix):
    """The thin QR's Q of `matrix` ([rows, r], rows >= r), R's diagonal made
    non-negative: every column has norm 1, whatever `matrix`'s rank."""
    # Scaled per column so that QR's squared norms neither underflow nor overflow.
    peak = tf.reduce_max(tf.abs(matrix), axis=0)
    q, r = tf.linalg.qr(matrix / tf.where(peak > 0, peak, tf.ones_like(peak)))
    # Householder QR stays orthonormal on rank-deficient input; Gram-Schmidt did not.
    return q * tf.where(tf.linalg.diag_part(r) < 0, -1.0, 1.0)


def orthonormal_rows(q):
    """`q` ([r, cols]) with orthonormal rows, as `orthonormalize` makes columns."""
    return tf.transpose(orthonormalize(tf.transpose(q)))


def _matrix(value, state, matrix):
    """M: `value` shaped as `matrix`, plus the residual `state` keeps."""
    m = tf.reshape(value, matrix)
    if "powersgd_m" in state:
        m += _owed(state, matrix)
    return m


def _owed(state, matrix):
    """The residual M - P^ Q_w^T of `state`'s factors, as a `matrix`."""
    return tf.reshape(state["powersgd_m"], matrix) - low_rank(
        state["powersgd_p"], state["powersgd_local_q"]
    )


def _factors(m, basis, local_q, shape):
    """The state that keeps the residual m - basis local_q (`_owed`)."""
    return {
        "powersgd_m": tf.reshape(m, shape),
        "powersgd_p": basis,
        "powersgd_local_q": local_q,
    }


def _project(values, states, scale, plan):
    """The first buffer (every P = M Q, then the uncompressed values, flat),
    and the matrices M, which later passes read."""
    pieces, kept = [], []
    for value, state, (_, matrix) in zip(values, states, plan):
        if not matrix:
            pieces.append(tf.reshape(value * scale, [-1]))
            continue
        m = _matrix(value * scale, state, matrix)
        kept.append(m)
        q = orthonormal_rows(state["powersgd_q"])
        pieces.append(tf.reshape(tf.linalg.matmul(m, q, transpose_b=True), [-1]))
    return _ordered(pieces, plan), kept


def _ordered(pieces, plan):
    """`pieces` with the compressed ones first, as one flat buffer."""
    compressed = [p for p, (_, matrix) in zip(pieces, plan) if matrix]
    uncompressed = [p for p, (_, matrix) in zip(pieces, plan) if not matrix]
    return tf.concat(compressed + uncompressed, 0)


def _split_first(summed, plan, rank):
    """The summed first buffer as P's and uncompressed values, in `plan`'s order."""
    compressed = [(matrix[0], rank) for _, matrix in plan if matrix]
    uncompressed = [shape for shape, matrix in plan if not matrix]
    sizes = [r * c for r, c in compressed] + [int(np.prod(s)) for s in uncompressed]
    pieces = tf.split(summed, sizes) if len(sizes) > 1 else [summed]
    ps = [tf.reshape(p, s) for p, s in zip(pieces, compressed)]
    rest = [tf.reshape(p, s) for p, s in zip(pieces[len(ps) :], uncompressed)]
    return [ps.pop(0) if matrix else rest.pop(0) for _, matrix in plan]


def _project_back(summed_first, matrices, plan, rank):
    """The second buffer (every Q_w^T = P^T M, flat) and the P^'s."""
    ps = [p for p, (_, matrix) in zip(_split_first(summed_first, plan, rank), plan) if matrix]
    bases = [orthonormalize(p) for p in ps]
    qs = [
        tf.reshape(tf.linalg.matmul(basis, m, transpose_a=True), [-1])
        for m, basis in zip(matrices, bases)
    ]
    return tf.concat(qs, 0), bases


def _split_second(second, plan, rank):
    """The second buffer (summed or not) as the Q^T's, [rank, cols] each."""
    shapes = [(rank, matrix[1]) for _, matrix in plan if matrix]
    sizes = [rank * cols for _, cols in shapes]
    pieces = tf.split(second, sizes) if len(sizes) > 1 else [second]
    return [tf.reshape(p, s) for p, s in zip(pieces, shapes)]


def _reconstruct(summed_first, summed_second, bases, old_qs, plan, rank):
    """`(tensors, qs, finite)`: the combined values, the Q's to keep, and
    whether the result is finite."""
    parts = _split_first(summed_first, plan, rank)
    summed_qs = _split_second(summed_second, plan, rank)
    finite = _finite(parts, bases, summed_qs)
    tensors, qs = [], []
    compressed = iter(zip(bases, summed_qs))
    for part, old_q, (shape, matrix) in zip(parts, old_qs, plan):
        if not matrix:
            tensors.append(part)
            continue
        basis, q = next(compressed)
        tensors.append(tf.where(finite, tf.reshape(low_rank(basis, q), shape), np.nan))
        qs.append(_kept_q(q, old_q))
    return tensors, qs, finite


def _finite(parts, bases, qs):
    """Whether every combined value is finite, read from the small buffers."""
    # No element of P^ Q^T exceeds the sum of |Q| down its column (P^'s
    # columns have norm 1), so a finite doubled sum bounds it.
    checks = [tf.reduce_all(tf.math.is_finite(part)) for part in parts]
    checks += [tf.reduce_all(tf.math.is_finite(basis)) for basis in bases]
    checks += [tf.reduce_all(tf.math.is_finite(2 * tf.reduce_sum(tf.abs(q), 0))) for q in qs]
    return tf.reduce_all(checks)


def low_rank(basis, q):
    """P^ Q^T from `basis` ([rows, r]) and Q^T (`q`, [r, cols])."""
    # Broadcast products, not a dot, so that XLA fuses them into the consumer.
    return tf.reduce_sum(basis[:, :, None] * q[None, :, :], axis=1)


def _kept_q(q, old_q):
    """`q`, or `old_q` where `q` is all 0 (no later step could recover)."""
    return tf.where(tf.reduce_any(tf.not_equal(q, 0)), q, old_q)
