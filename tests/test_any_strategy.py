"""tf_agn's optimizers aggregate and compress under any strategy: without
tf_agn's cross-device ops each replica sends its own values through what
every replica context offers, `all_reduce` and `all_gather`
(`tf_agn.transports.ReplicaTransport`), the path `TPUStrategy` can run.

- Under a stock `MirroredStrategy` on 4 logical CPUs (`ReductionToOneDevice`,
  and its default ops in a process of their own) and under `KerasMultiWorkerMirroredStrategy` across
  2 workers (TensorFlow's own collectives), the weight change w_T - w_0
  after 10 steps is what tf_agn's local transport gives: within 1e-4 for
  PowerSGD and uncompressed steps, to the bit for int8 (whose reduce-scatter
  here is an all-gather of the same codes, summed in the same order), and
  for the casts within the rounding of their sum: the stock ops sum float16
  and bfloat16 values in that dtype, as NCCL and tf_agn's collective
  transport do, where the local transport sums them in float32.
- Every compressor's replica-side work (encode, a sum over simulated
  replicas standing in for the collective, decode) gives its eager result
  in one `tf.function(jit_compile=True)`, as a TPU compiles the step.
- `communication_stats` counts the (n - 1) payloads int8's all-gather
  brings each replica, and tf_agn warns where that exceeds a float32 ring.
"""

import functools
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from compression_model import build
from compression_model import data
from conftest import DEVICES
from tf_agn import compression
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.routing import combine_replicas
from tf_agn.transports import ReplicaTransport
from worker_cluster import run_workers

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "any_strategy_worker.py")
STEPS = 10
GLOBAL_BATCH = 64
# Relative difference by norm from the local transport's weight change.
TOLERANCE = {
    "none": 1e-6,
    "powersgd": 1e-4,
    "int8": 0.0,
    # One rounding of each partial sum to the wire dtype (unit roundoff
    # 2^-11 and 2^-8; see test_a_stock_strategy_sums_the_casts_in_their_wire_dtype):
    # measured 1.3e-4 to 1.6e-4 and 1.0e-3 to 1.1e-3.
    "fp16": 4e-4,
    "bf16": 4e-3,
}


def compressor(name):
    return {"none": None, "powersgd": compression.PowerSGD(rank=2)}.get(name, name)


def weight_change(strategy, name, accumulation=None):
    model = build(
        strategy,
        lambda: tf_agn.optimizers.SGD(
            0.1, compression=compressor(name), gradient_accumulation_steps=accumulation
        ),
    )
    before = [w.copy() for w in model.get_weights()]
    x, y = data(rows=STEPS * GLOBAL_BATCH)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    change = [after - start for after, start in zip(model.get_weights(), before)]
    return change, model.optimizer.communication_stats()


@functools.cache
def local_transport_change(name, accumulation=None, num_replicas=len(DEVICES)):
    strategy = tf_agn.strategies.mirrored(DEVICES[:num_replicas], transport="local")
    return weight_change(strategy, name, accumulation)


def relative_difference(got, want):
    got = np.concatenate([g.ravel() for g in got]).astype(np.float64)
    want = np.concatenate([w.ravel() for w in want]).astype(np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def reduction_to_one_device():
    return tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


@pytest.fixture(scope="module")
def stock_default(tmp_path_factory):
    """What the worker script trained under a stock `MirroredStrategy`
    with its default ops, in a process of its own (its docstring says
    why)."""
    out_dir = tmp_path_factory.mktemp("stock_default")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run(
        [sys.executable, WORKER_SCRIPT, "--stock_mirrored", str(out_dir)],
        check=True, env=env, timeout=600,
    )
    return np.load(out_dir / "worker0.npz")


def trained(results, key, num_weights):
    change = [results[f"{key}/{i}"] for i in range(num_weights)]
    stats = {name: int(results[f"{key}/{name}"]) for name in ("bytes_sent", "all_reduce_calls")}
    return change, stats


@pytest.mark.parametrize("name", sorted(TOLERANCE))
def test_stock_mirrored_strategy_gives_the_local_transports_weights(name, stock_default):
    want, want_stats = local_transport_change(name)
    stock_results = [
        weight_change(reduction_to_one_device(), name),
        trained(stock_default, name, len(want)),
    ]
    for got, stats in stock_results:
        assert relative_difference(got, want) <= TOLERANCE[name]
        assert stats["bytes_sent"] == want_stats["bytes_sent"]
        if name != "none":
            # It compressed: fewer bytes than float32's.
            assert stats["bytes_sent"] < local_transport_change("none")[1]["bytes_sent"]


def test_stock_mirrored_strategy_accumulates_and_compresses_once_per_window(stock_default):
    want, want_stats = local_transport_change("int8", accumulation=2)
    got, stats = trained(stock_default, "int8_k2", len(want))
    assert relative_difference(got, want) <= TOLERANCE["int8"]
    assert stats["all_reduce_calls"] == want_stats["all_reduce_calls"] == STEPS // 2


@pytest.mark.parametrize("cast", [compression.FP16, compression.BF16], ids=["fp16", "bf16"])
def test_a_stock_strategy_sums_the_casts_in_their_wire_dtype(cast):
    # Where the casts' tolerance above comes from: the strategy rounds every
    # partial sum to the wire dtype (here bitwise numpy's left-to-right sum
    # in that dtype), where the local transport sums the same values in
    # float32. One all-reduce of 4 replicas already differs by about
    # 3.4e-4 (fp16) and 2.7e-3 (bf16); summing in float32 instead would need
    # float32 on the wire or every replica's payload (an all-gather).
    wire_dtype = cast.wire_dtype(tf.float32).as_numpy_dtype
    rng = np.random.default_rng(0)
    values = rng.normal(size=(len(DEVICES), 1000)).astype(np.float32)
    strategy = reduction_to_one_device()

    @tf.function
    def replica_sum():
        context = tf.distribute.get_replica_context()
        mine = tf.gather(tf.constant(values), context.replica_id_in_sync_group)
        return ReplicaTransport(context).all_reduce([[mine]], cast=cast)[0][0]

    on_the_wire = functools.reduce(np.add, values.astype(wire_dtype)).astype(np.float32)
    in_float32 = values.astype(wire_dtype).astype(np.float32).sum(0)
    unit_roundoff = {"fp16": 2.0**-11, "bf16": 2.0**-8}[cast.name]
    for got in strategy.experimental_local_results(strategy.run(replica_sum)):
        np.testing.assert_array_equal(got.numpy(), on_the_wire)
        assert 0.1 * unit_roundoff < relative_difference([got.numpy()], [in_float32]) < (
            (len(DEVICES) - 1) * unit_roundoff
        )


def test_int8_receives_every_replicas_payload_from_an_all_gather():
    _, stats = weight_change(reduction_to_one_device(), "int8")
    _, ours = local_transport_change("int8")
    assert stats["bytes_sent"] == ours["bytes_sent"] == ours["bytes_received"]
    assert stats["bytes_received"] == (len(DEVICES) - 1) * stats["bytes_sent"]


class _Context:
    """A replica context of `size` replicas, for the warning alone."""

    def __init__(self, size):
        self.num_replicas_in_sync = size
        self.replica_id_in_sync_group = tf.constant(0)
        self.strategy = tf.distribute.get_strategy()


@pytest.mark.parametrize("size, warns", [(7, False), (8, True)])
def test_a_gathered_int8_payload_past_a_float32_rings_warns(size, warns):
    from tf_agn.collectives import routing

    context = _Context(size)
    values = [tf.zeros([1024, 64])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routing._warn_if_gathering_costs_more(
            context, compression.Int8(), values, ReplicaTransport(context)
        )
        routing._warn_if_gathering_costs_more(
            context, compression.PowerSGD(rank=4), values, ReplicaTransport(context)
        )
    messages = [str(w.message) for w in caught]
    assert len(messages) == int(warns)
    if warns:
        assert f"each of {size} replicas receives {size - 1} compressed payloads" in messages[0]


# Across 2 workers under TensorFlow's own collectives.


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("any_strategy_workers")
    return run_workers(WORKER_SCRIPT, [], workdir, 2, 300)


@pytest.mark.parametrize(
    "name, accumulation",
    [("none", None), ("fp16", None), ("bf16", None), ("int8", None), ("powersgd", None), ("int8", 2)],
)
def test_keras_multi_worker_strategy_gives_the_local_transports_weights(
    workers, name, accumulation
):
    want, want_stats = local_transport_change(name, accumulation, num_replicas=2)
    key = name if accumulation is None else f"{name}_k{accumulation}"
    for worker in workers:
        got = [worker[f"{key}/{i}"] for i in range(len(want))]
        assert relative_difference(got, want) <= TOLERANCE[name]
        assert int(worker[f"{key}/bytes_sent"]) == want_stats["bytes_sent"]
        assert int(worker[f"{key}/all_reduce_calls"]) == want_stats["all_reduce_calls"]


# XLA: the replica-side work of every compressor, compiled whole.


class SimulatedReplicas:
    """A stand-in for a replica context's collectives: `size` replicas in
    one function, ranks as tensors (as `ReplicaTransport`'s), sums taken in
    the values' own dtype (as a strategy's all-reduce takes them)."""

    def __init__(self, size):
        self.size = size
        self.devices = ("",) * size
        self.bytes_per_pack = 2**62
        self.jit_compile = False  # The test compiles the whole function.

    def rank(self, replica):
        return tf.constant(replica)

    def all_reduce(self, tensors, weights=None, cast=None):
        weights = weights or [1.0] * self.size
        wire = [
            [v * tf.cast(w, v.dtype) for v in pack] for pack, w in zip(tensors, weights)
        ]
        if cast is not None:
            wire = [[cast.compress(v) for v in pack] for pack in wire]
        summed = [tf.add_n(list(position)) for position in zip(*wire)]
        if cast is not None:
            summed = [cast.decompress(s, like.dtype) for s, like in zip(summed, tensors[0])]
        return [summed] * self.size

    def all_gather(self, tensors):
        return [tf.concat(tensors, 0)] * self.size

    def all_to_all(self, tensors):
        return [tf.stack([t[j] for t in tensors]) for j in range(self.size)]

    def reduce_scatter(self, tensors, weights=None, sum_parts=None):
        reduce = sum_parts or (lambda rows: tf.reduce_sum(rows, 0))
        tensors = [t * tf.cast(w, t.dtype) for t, w in zip(tensors, weights)] if weights else tensors
        return [reduce(rows) for rows in self.all_to_all(tensors)]


def initial_state(compressor, shape):
    state = {}
    for key, spec in compressor.state_spec(tf.TensorShape(shape)).items():
        initial = spec.initializer if callable(spec.initializer) else tf.zeros
        state[key] = initial(spec.shape, tf.float32)
    return state


@pytest.mark.parametrize("method", ["mean", "only_first_replica"])
@pytest.mark.parametrize(
    "compressor",
    [compression.FP16, compression.BF16, compression.Int8(chunk_size=64), compression.PowerSGD(rank=2)],
    ids=["fp16", "bf16", "int8", "powersgd"],
)
def test_every_compressors_replica_side_work_compiles_with_xla(compressor, method):
    size, shapes = 3, [(40, 24), (24,), (7, 5)]
    rng = np.random.default_rng(0)
    values = [[tf.constant(rng.normal(size=s), tf.float32) for s in shapes] for _ in range(size)]
    states = [[initial_state(compressor, s) for s in shapes] for _ in range(size)]

    def step():
        combined, new_states = combine_replicas(
            SimulatedReplicas(size), AggregationMethod.parse(method), values,
            compressor=compressor, states=states,
        )
        return combined, new_states

    eager = step()
    compiled = tf.function(step, jit_compile=True)()
    # XLA may round a sum in the wire dtype once rather than per addition.
    rtol = {"fp16": 2e-3, "bf16": 1.6e-2}.get(compressor.name, 1e-5)
    flat = [(g, w) for g, w in zip(tf.nest.flatten(compiled), tf.nest.flatten(eager)) if w is not None]
    assert len(flat) >= size * len(shapes)  # Every combined value, and any state.
    for got, want in flat:
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=rtol, atol=rtol)
    # The vector (uncompressed by PowerSGD) is every replica's mean, or
    # replica 0's alone.
    vectors = [np.asarray(v[1]) for v in values]
    want = sum(vectors) / size if method == "mean" else vectors[0]
    for replica in range(size):
        np.testing.assert_allclose(eager[0][replica][1].numpy(), want, rtol=1e-2, atol=1e-2)
