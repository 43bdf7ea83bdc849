"""A fixed-seed sweep of what tf_agn's training computes, recorded as a
fixture so that a rebuild of the core can show it changed no number.

Every configuration trains the same small MLP (12-16-8, fixed initial
weights) on the same numpy data with one epoch of `model.fit`, `STEPS`
steps, and records under `<transport>/<configuration>/`:

    weight_change/<i>_<name>: w_T - w_0 of model weight i;
    optimizer/<i>_<name>: the value of optimizer variable i (momentum,
        iterations, accumulators, compression residuals, AGN's center...);
    history/<metric>: `History.history[metric]` (one epoch: one value).

Each array has a leading axis of replicas: one row per replica, or a single
row when every replica holds the same value (they differ under NONE, and a
compressor's residuals are per replica). The configurations are every
aggregation method x compression x (plain, `gradient_accumulation_steps=3`)
with `tf_agn.optimizers.SGD(momentum=0.9)`, plus AGN with λ = 4 (inner
`keras.optimizers.SGD(momentum=0.9)`) under each method, and under MEAN
with int8 commits; the transports are

    mirrored_local, mirrored_collective: `tf_agn.strategies.mirrored` on 4
        logical CPUs with that transport;
    workers_collective: `tf_agn.strategies.multi_worker_mirrored` across 2
        worker processes on localhost, one replica each (this file is also
        their worker script).

tests/test_behaviour_sweep.py runs the sweep and compares it with
`FIXTURE`, tests/data/behaviour_sweep.npz.xz: an .npz, xz-compressed as a
whole (`save`, `load`), about 300 kB. Compressing each of its ~1800 small
arrays on its own, as `np.savez_compressed` does, makes it 4x larger.

The recording names the machine it was made on (`machine`). Elsewhere
tests/test_behaviour_sweep.py cannot compare bitwise with it, so it runs
the code that made it (the last commit that changed the fixture, taken
from git) on this machine and compares with that instead.

Re-recording (about 3 minutes of CPU, 4 on a busy 2-core machine):

    python tests/behaviour_sweep.py --record

Re-record only when a change is meant to alter these numbers (a fix, a new
rounding), never to make a failing comparison pass; commit the new fixture
with the change and say in the commit message which configurations moved
and why. A change that only reorders arithmetic should instead list the
affected configurations in test_behaviour_sweep.py's `ROUNDING_CHANGES`,
with its reason, and keep the recording.
"""

import dataclasses
import io
import lzma
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_agn  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "data" / "behaviour_sweep.npz.xz"
NUM_DEVICES = 4  # logical CPUs under mirrored(), as tests/conftest.py
NUM_WORKERS = 2
MIRRORED_TRANSPORTS = ("local", "collective")
TRANSPORTS = tuple(f"mirrored_{t}" for t in MIRRORED_TRANSPORTS) + ("workers_collective",)

LAYER_SIZES = (12, 16, 8)
GLOBAL_BATCH = 16
# One epoch: every epoch costs `fit` new dataset iterators, more CPU than
# its steps. A multiple of 3: two accumulation windows.
STEPS = 6
LEARNING_RATE = 0.05
MOMENTUM = 0.9
ACCUMULATION_STEPS = 3
AGN_LOCAL_STEPS = 4  # 6 steps: one full window, then a partial one at the end
METHODS = ("none", "sum", "mean", "only_first_replica")
COMPRESSIONS = ("none", "fp16", "int8", "powersgd")
WORKER_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One point of the sweep: which optimizer, and its settings."""

    optimizer: str  # "sgd" or "agn"
    method: str
    compression: str = "none"
    accumulation_steps: int = 1

    @property
    def name(self):
        """E.g. "sgd-mean-int8-k3", "agn4-sum-none-k1"."""
        optimizer = f"agn{AGN_LOCAL_STEPS}" if self.optimizer == "agn" else self.optimizer
        return f"{optimizer}-{self.method}-{self.compression}-k{self.accumulation_steps}"


CONFIGURATIONS = tuple(
    Configuration("sgd", method, compression, steps)
    for method in METHODS
    for compression in COMPRESSIONS
    for steps in (1, ACCUMULATION_STEPS)
) + tuple(Configuration("agn", method) for method in METHODS) + (
    Configuration("agn", "mean", "int8"),  # compressed commits
)


def compressor(name):
    """The `compression=` argument for a sweep compression name."""
    if name == "powersgd":
        # Rank 2 on the 12x16 and 16x8 kernels sends 3.4x and 2.7x fewer
        # floats, above the default min_compression_rate of 2: both are
        # compressed (the state holds their factors).
        return tf_agn.compression.PowerSGD(rank=2)
    return None if name == "none" else name


def make_optimizer(configuration):
    """The optimizer of `configuration`, built in a strategy's scope."""
    if configuration.optimizer == "agn":
        return tf_agn.optimizers.AGN(
            keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM),
            local_steps=AGN_LOCAL_STEPS,
            aggregation_method=configuration.method,
            compression=compressor(configuration.compression),  # its commits
        )
    return tf_agn.optimizers.SGD(
        LEARNING_RATE,
        momentum=MOMENTUM,
        aggregation_method=configuration.method,
        compression=compressor(configuration.compression),
        gradient_accumulation_steps=configuration.accumulation_steps,
    )


def initial_weights(seed=1):
    """The MLP's kernels and biases, from numpy's fixed-seed generator."""
    rng = np.random.RandomState(seed)
    weights = []
    for rows, cols in zip(LAYER_SIZES, LAYER_SIZES[1:]):
        weights.append((rng.randn(rows, cols) / np.sqrt(rows)).astype("float32"))
        weights.append((rng.randn(cols) * 0.1).astype("float32"))
    return weights


def data(seed=0):
    """Inputs and targets for `STEPS` global batches."""
    rng = np.random.RandomState(seed)
    x = rng.randn(GLOBAL_BATCH * STEPS, LAYER_SIZES[0]).astype("float32")
    projection = rng.randn(LAYER_SIZES[0], LAYER_SIZES[-1]).astype("float32")
    return x, np.tanh(x @ projection).astype("float32")


def build_model():
    """The MLP with `initial_weights()`. Layers are named, so that the
    optimizer's variable names do not depend on how many models this
    process built before."""
    model = keras.Sequential(
        [keras.Input((LAYER_SIZES[0],))]
        + [
            keras.layers.Dense(units, activation="tanh" if i == 0 else None, name=f"dense{i}")
            for i, units in enumerate(LAYER_SIZES[1:])
        ],
        name="mlp",
    )
    model.set_weights(initial_weights())
    return model


def per_replica(copies):
    """Stacks one array per replica along a new first axis."""
    return np.stack([np.asarray(copy) for copy in copies])


def run(configuration, strategy):
    """Trains `configuration` under `strategy` and returns its arrays, each
    with one row per local replica (see the module docstring for keys)."""
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=make_optimizer(configuration), loss="mse")
    x, y = data()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    arrays = {}
    final = zip(*tf_agn.replica_weights(model))  # per weight: its copies
    for i, (weight, start, copies) in enumerate(zip(model.weights, initial_weights(), final)):
        arrays[f"weight_change/{i}_{weight.name}"] = per_replica(copies) - start
    optimizer = model.optimizer
    state = zip(*tf_agn.replica_weights(optimizer.variables))
    for i, (variable, copies) in enumerate(zip(optimizer.variables, state)):
        arrays[f"optimizer/{i}_{variable.name}"] = per_replica(copies)
    for metric, values in history.history.items():
        arrays[f"history/{metric}"] = np.asarray(values)[None]
    return arrays


def sweep(strategy):
    """`run` of every configuration: {"<configuration>/<tensor>": array}."""
    return {
        f"{configuration.name}/{tensor}": array
        for configuration in CONFIGURATIONS
        for tensor, array in run(configuration, strategy).items()
    }


def collapse_equal_replicas(arrays):
    """Each array with a single row if all its rows (replicas) are
    bitwise equal: keeps the fixture small."""
    return {
        key: array[:1] if all(row.tobytes() == array[0].tobytes() for row in array) else array
        for key, array in arrays.items()
    }


def mirrored_sweep(transport, devices):
    """The sweep under `mirrored(devices, transport=transport)`, keyed
    "mirrored_<transport>/<configuration>/<tensor>"."""
    strategy = tf_agn.strategies.mirrored(devices, transport=transport)
    results = collapse_equal_replicas(sweep(strategy))
    return {f"mirrored_{transport}/{key}": array for key, array in results.items()}


def workers_sweep(workdir):
    """The sweep across `NUM_WORKERS` worker processes (this file run with
    --worker), keyed "workers_collective/<configuration>/<tensor>"; each
    worker's one replica is one row."""
    from worker_cluster import run_workers

    workers = run_workers(__file__, ["--worker"], workdir, NUM_WORKERS, WORKER_TIMEOUT_S)
    stacked = {key: np.concatenate([w[key] for w in workers]) for key in workers[0]}
    return {f"workers_collective/{k}": a for k, a in collapse_equal_replicas(stacked).items()}


def worker_main(out_dir):
    """One worker of `workers_sweep`: runs the sweep on its replica and
    writes OUT_DIR/worker<i>.npz once its peers are done too."""
    from worker_cluster import wait_for_files
    from worker_cluster import write_results

    # Before any other TensorFlow op; the collective transport by default.
    strategy = tf_agn.strategies.multi_worker_mirrored()
    index = strategy.cluster_resolver.task_id
    write_results(out_dir, index, sweep(strategy))
    wait_for_files([os.path.join(out_dir, f"worker{i}.npz") for i in range(NUM_WORKERS)])


def save(arrays, path):
    """Writes {key: array} to `path` as an xz-compressed .npz."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.parent.mkdir(exist_ok=True)
    # xz sees the whole file: the ~1800 small headers, and the arrays that
    # several transports give alike, compress across entries.
    path.write_bytes(lzma.compress(buffer.getvalue(), preset=9))


def load(path=FIXTURE):
    """{key: array} of a file `save` wrote."""
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as npz:
        return dict(npz)


def machine():
    """What the numbers depend on besides tf_agn's code, as one string: the
    versions of TensorFlow, Keras and numpy, and the CPU's vector
    instruction sets (TensorFlow's kernels round differently with AVX-512
    than with AVX2, and compressed configurations amplify that)."""
    import tensorflow as tf

    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            line = next((l for l in cpuinfo if l.startswith("flags")), "flags :")
        flags = set(line.split(":", 1)[1].split())
    vector = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
    return (
        f"tensorflow {tf.__version__}, keras {keras.__version__}, numpy {np.__version__}, "
        f"cpu {' '.join(vector) or 'unknown'}"
    )


def record(path=FIXTURE):
    """Runs the whole sweep and writes it to `path`, with the `machine`
    it ran on under the key "machine"."""
    devices = tf_agn.strategies.split_cpu(NUM_DEVICES)
    results = {"machine": np.array(machine())}
    for transport in MIRRORED_TRANSPORTS:
        results.update(mirrored_sweep(transport, devices))
    with tempfile.TemporaryDirectory() as workdir:
        results.update(workers_sweep(pathlib.Path(workdir)))
    save(results, path)
    print(f"{len(results)} arrays, {path.stat().st_size} bytes: {path}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        record()
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
        # Its results are on disk and its peers are done with it: skip the
        # gRPC server's slow shutdown at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        sys.exit(__doc__)
