r"""Times the gradient all-reduce that Keras really runs, on logical CPUs.

Keras' optimizer (keras/src/backend/tensorflow/optimizer.py,
`_all_reduce_sum_gradients`) all-reduces gradients in replica context:
inside `strategy.run`, every replica calls
`tf.distribute.get_replica_context().all_reduce(ReduceOp.SUM, grads)`, and
`MirroredStrategy` hands the per-replica lists to its cross-device ops
(`batch_reduce_to` through `merge_call`, on CPUs). This benchmark times
that path, on `--num_devices` logical CPU devices of one process
(`tf_agn.strategies.split_cpu`), for these candidates, each a
`tf.distribute.MirroredStrategy` on the same devices, built once and used
for every set and mode:

- `stock_default`: `MirroredStrategy(devices)` with no cross-device ops,
  i.e. what TensorFlow picks itself (its `CollectiveAllReduce`, RING, on
  logical CPUs; the header prints what this TensorFlow picked);
- `reduction_to_one_device`: `tf.distribute.ReductionToOneDevice()`;
- `ours_local`: `tf_agn.AggregatingAllReduce(transport="local")`;
- `ours_collective`: `tf_agn.AggregatingAllReduce(transport="collective")`;
- `numpy_floor`: the memory-bandwidth floor: numpy reads every replica's
  values once and writes their sum once, over one contiguous buffer per
  replica, in cache-sized chunks on every core (`numpy_floor`). It places,
  scales and broadcasts nothing and pays no per-tensor cost: a floor, not
  a competitor.

`ours` in the targets is the transport that `transport="auto"` (the
default) picks on these devices: "local" on logical CPUs of one process.

Modes (`--modes`):

- `keras_path`: one `tf.function` runs `strategy.run(replica_fn)`; each
  replica computes its gradient tensors on its own device (`x * 1.0` of
  its part of the inputs, so every tensor carries the replica's device, as
  real gradients do), all-reduces them with SUM exactly as Keras' optimizer
  does, and returns a scalar that adds one element of every output, so
  nothing can be pruned; the function returns the sum over replicas.
- `unplaced`: the same, but the tensors all-reduced are the raw function
  inputs passed to `strategy.run`, whose device string is ''.
- `fit_step`: one `model.fit` training step of the AGN paper's MLP
  (784-1000-2000-1000-10, ReLU) with Keras' stock `keras.optimizers.Adam`,
  compiled under each strategy, on a fixed batch of local random data
  (`--fit_batch_size` per replica). Each timed sample is the median step
  time of one `fit` call of `--fit_steps` steps, measured by a callback
  from `on_train_batch_begin` until the step's loss is read; the
  gradient sets do not apply, so this mode runs once, after them, and its
  table has no numpy column.

In `keras_path` and `unplaced`, the replicas' arrays enter the function as
captured inputs (placeholders without a device), not as Python arguments:
tf.function's Python call path costs ~20 us per argument tensor, which
would swamp the tiny set (8,000 tensors), and Keras passes its gradients
no such way. Grappler may fold `x * 1.0` into an identity; the tensors
still carry their replica's device when the cross-device ops see them,
which is what the mode is about.

Gradient sets (`--sets`): `resnet50` (the trainable weight shapes of
`keras.applications.ResNet50`), `tiny` (`--tiny_tensors` tensors of
`--tiny_size` floats: per-tensor overhead), `big` (one tensor of
`--big_size` floats: bandwidth) and, not by default, `bert_base`
(`--bert_scale` shrinks it). Every replica holds its own float32 random
arrays.

Before timing, every candidate's `keras_path` result is checked against
numpy (the SUM of the replicas' arrays, rtol 1e-5) on every replica, and
every timed function's scalar against numpy's; a candidate that fails to
build or checks wrong is reported and left out of the timing.

All candidates of a set (both reduce modes, and the numpy floor) run in
interleaved rounds whose order rotates every round, so that the load of a
shared machine falls on all of them alike. Each table gives every
candidate's median and minimum time and its ratios to
`reduction_to_one_device`, `stock_default` (baseline/this: above 1 is
faster) and `numpy_floor` (this/numpy: above 1 is slower); a ratio is the
median over rounds of the ratio within one round.

Targets, named by the constants at the top of this file (each verdict
line starts with PASS: or FAIL:; a target whose set or mode did not run
has no line; one whose candidate failed is a FAIL):

1. resnet50, keras_path: `ours` takes at most `MAX_OURS_TO_NUMPY_FLOOR`
   times the numpy floor;
2. tiny and big, keras_path: `ours_local` is at least
   `MIN_SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE` times as fast as
   `reduction_to_one_device` (not slower);
3. every set with both modes: `ours_local`'s unplaced time is at most
   `MAX_UNPLACED_TO_KERAS_PATH` times its keras_path time;
4. fit_step: `ours` is at least `MIN_FIT_SPEEDUP_VS_STOCK_DEFAULT` times as
   fast as `stock_default`;
5. every set, keras_path: `ours_collective` is at least
   `MIN_COLLECTIVE_SPEEDUP_VS_STOCK_DEFAULT` times as fast as
   `stock_default` (the same machinery: TensorFlow's ring collectives).

Usage (the first takes ~16 minutes on 2 CPU cores, most of it tracing
the tiny set: 2,000 tensors on 4 replicas, for 4 candidates and 2 modes):

    python benchmarks/allreduce.py --repeats=10
    python benchmarks/allreduce.py --sets=resnet50 --modes=keras_path
    python benchmarks/allreduce.py --sets=tiny --tiny_tensors=200 \
        --repeats=1 --fit_steps=2
"""

import concurrent.futures
import datetime
import functools
import gc
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn import _compat  # noqa: E402
from tf_agn import transports  # noqa: E402
from tf_agn.strategies import split_cpu  # noqa: E402

# Targets.
MAX_OURS_TO_NUMPY_FLOOR = 1.25  # resnet50, keras_path: ours / numpy_floor.
MIN_SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE = 1.0  # tiny, big: R1D / ours_local.
MAX_UNPLACED_TO_KERAS_PATH = 1.10  # ours_local: unplaced / keras_path.
MIN_FIT_SPEEDUP_VS_STOCK_DEFAULT = 1.0  # fit_step: stock_default / ours.
MIN_COLLECTIVE_SPEEDUP_VS_STOCK_DEFAULT = 1.0  # stock / ours_collective.

NUMPY_FLOOR_TARGET_SETS = ("resnet50",)
REDUCTION_TO_ONE_DEVICE_TARGET_SETS = ("tiny", "big")

# The full check of every output against numpy.
RTOL = 1e-5
ATOL = 1e-5
# The check of a timed function's scalar: a float32 sum of up to 4 x 2,000
# terms.
SCALAR_RTOL = 1e-4
SCALAR_ATOL = 1e-3

MODES = ("keras_path", "unplaced", "fit_step")
REDUCE_MODES = ("keras_path", "unplaced")
SETS = ("resnet50", "tiny", "big", "bert_base")
STOCK = "stock_default"
R1D = "reduction_to_one_device"
FLOOR = "numpy_floor"

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 20, "Timed rounds per candidate.")
flags.DEFINE_integer("num_devices", 4, "Logical CPU devices (replicas).")
flags.DEFINE_list(
    "sets", ["resnet50", "tiny", "big"], f"Gradient sets, of {', '.join(SETS)}."
)
flags.DEFINE_list("modes", list(MODES), f"Modes, of {', '.join(MODES)}.")
flags.DEFINE_integer(
    "fit_steps", 5, "Steps per timed `fit` call in the fit_step mode."
)
flags.DEFINE_integer(
    "fit_batch_size", 128, "Per-replica batch size in the fit_step mode."
)
flags.DEFINE_integer("tiny_tensors", 2000, "Tensors in the tiny set.")
flags.DEFINE_integer("tiny_size", 256, "Floats per tensor of the tiny set.")
flags.DEFINE_integer("big_size", 32 * 2**20, "Floats in the big set's tensor.")
flags.DEFINE_float(
    "bert_scale",
    1.0,
    "Fraction of BERT-base's vocabulary and layers to build, for machines "
    "with too little memory for 4 replicas of 110M parameters.",
)


def resnet50_shapes():
    """The trainable weight shapes of `keras.applications.ResNet50`."""
    import keras

    model = keras.applications.ResNet50(weights=None)
    shapes = [tuple(w.shape) for w in model.trainable_weights]
    keras.backend.clear_session()
    return shapes


def bert_base_shapes(scale=1.0):
    """The trainable weight shapes of BERT-base (~110M parameters).

    Args:
        scale: fraction of the vocabulary and of the 12 layers to keep.

    Returns:
        A list of shapes.
    """
    hidden, ffn = 768, 3072
    vocab = max(1, int(30522 * scale))
    layers = max(1, round(12 * scale))
    layer_norm = [(hidden,), (hidden,)]
    # Word, position and token-type embeddings, then their layer norm.
    shapes = [(vocab, hidden), (512, hidden), (2, hidden)] + layer_norm
    for _ in range(layers):
        for _ in "qkvo":
            shapes += [(hidden, hidden), (hidden,)]
        shapes += layer_norm
        shapes += [(hidden, ffn), (ffn,), (ffn, hidden), (hidden,)]
        shapes += layer_norm
    shapes += [(hidden, hidden), (hidden,)]  # Pooler.
    return shapes


def set_shapes(set_name):
    if set_name == "resnet50":
        return resnet50_shapes()
    if set_name == "tiny":
        return [(FLAGS.tiny_size,)] * FLAGS.tiny_tensors
    if set_name == "big":
        return [(FLAGS.big_size,)]
    if set_name == "bert_base":
        return bert_base_shapes(FLAGS.bert_scale)
    raise ValueError(f"Unknown set {set_name!r}; allowed: {', '.join(SETS)}.")


def build_strategies(devices):
    """The TensorFlow candidates' strategies, by name, built once."""
    mirrored = tf.distribute.MirroredStrategy
    return {
        STOCK: mirrored(devices),
        R1D: mirrored(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        ),
        "ours_local": mirrored(
            devices,
            cross_device_ops=tf_agn.AggregatingAllReduce(transport="local"),
        ),
        "ours_collective": mirrored(
            devices,
            cross_device_ops=tf_agn.AggregatingAllReduce(
                transport="collective"
            ),
        ),
    }


def describe_stock(strategy):
    """What `MirroredStrategy` picked when given no cross-device ops."""
    ops = _compat.cross_device_ops(strategy.extended)
    text = f"{type(ops).__module__}.{type(ops).__name__}"
    options = getattr(ops, "_options", None)
    implementation = getattr(options, "implementation", None)
    if implementation is not None:
        text += f" (implementation {implementation.name})"
    return text


def place(arrays, devices):
    """Eager tensors: `[i][r]` is `arrays[r][i]` on `devices[r]`."""
    placed = []
    for index in range(len(arrays[0])):
        copies = []
        for replica, device in enumerate(devices):
            with tf.device(device):
                # An eager constant lives on CPU:0 in any device scope: the
                # identity moves it.
                copies.append(tf.identity(tf.constant(arrays[replica][index])))
        placed.append(tuple(copies))
    return placed


def function_inputs(strategy, tensors):
    """`tensors` (from `place`) as inputs of the function being traced, each
    wrapped as a per-replica value of `strategy`.

    The tensors enter as captured inputs: placeholders made outside any
    device scope, so their device string is ''. Passing them as Python
    arguments would be the same to the graph, but tf.function's Python call
    path spends ~20 us per argument tensor, which for the tiny set
    (8,000 tensors) would swamp what is timed.
    """
    graph = tf.compat.v1.get_default_graph()
    captured = [[graph.capture(t) for t in copies] for copies in tensors]
    return [
        strategy.experimental_distribute_values_from_function(
            # Replica ids count every worker's replicas; `c` holds this one's.
            lambda context, c=c: c[context.replica_id_in_sync_group % len(c)]
        )
        for c in captured
    ]


def replica_sum(per_replica_arrays):
    """The SUM every candidate must produce, tensor by tensor."""
    return [functools.reduce(np.add, parts) for parts in zip(*per_replica_arrays)]


def numpy_floor(per_replica_arrays, threads=None, chunk_elements=1 << 16):
    """Returns a function that sums the replicas' values at memory speed.

    Each replica's arrays are first copied into one contiguous buffer (not
    timed), so the timed pass pays nothing per tensor. The pass is cut into
    chunks of `chunk_elements`, small enough that the running sum stays in
    cache while the n inputs are added into it: the inputs are read once
    and the output written once, the least any all-reduce on one host
    moves. The chunks are spread over `threads` threads (default: every
    core); numpy releases the GIL inside its additions.

    Returns:
        A function returning the flat sum.
    """
    flat = [
        np.concatenate([a.ravel() for a in arrays]) for arrays in per_replica_arrays
    ]
    total = np.empty_like(flat[0])
    chunks = [
        slice(start, start + chunk_elements)
        for start in range(0, total.size, chunk_elements)
    ]
    threads = threads or os.cpu_count()

    def add_chunks(my_chunks):
        for chunk in my_chunks:
            out = total[chunk]
            np.add(flat[0][chunk], flat[1][chunk], out=out)
            for values in flat[2:]:
                np.add(out, values[chunk], out=out)

    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def run():
        list(pool.map(add_chunks, [chunks[i::threads] for i in range(threads)]))
        return total

    return run


def _first(tensor):
    return tensor[(0,) * tensor.shape.rank]


def reduce_fns(strategy, tensors, mode, sum_in_replica=None):
    """`tf.function`s that all-reduce per-replica values as Keras does.

    Args:
        strategy: the candidate's `MirroredStrategy`.
        tensors: the replicas' tensors, from `place`.
        mode: "keras_path" (each replica's tensors computed on its device)
            or "unplaced" (the raw function inputs, without a device).
        sum_in_replica: a function that sums a replica's list of tensors
            across replicas, in replica context; by default
            `replica_context.all_reduce(SUM, ...)`, as Keras's optimizer.

    Returns:
        `(timed, full, devices_seen)`: `timed()` returns a scalar that
        adds one element of every output of every replica; `full()`
        returns every output (a list of distributed values); `devices_seen`
        collects, while they trace, the set of devices of each replica's
        tensors.
    """
    devices_seen = []

    def gradients(tensors):
        if mode == "keras_path":
            grads = [t * 1.0 for t in tensors]
        else:
            grads = list(tensors)
        devices_seen.append(frozenset(g.device for g in grads))
        return grads

    def all_reduce(tensors):
        if sum_in_replica is not None:
            return sum_in_replica(gradients(tensors))
        # What Keras' optimizer does in `_all_reduce_sum_gradients`.
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, gradients(tensors)
        )

    def replica_scalar(*tensors):
        # One strided slice per output: cheap, yet a data dependency,
        # which (unlike a control dependency) Grappler cannot prune.
        return tf.add_n([_first(r) for r in all_reduce(tensors)])

    @tf.function
    def timed():
        args = function_inputs(strategy, tensors)
        scalars = strategy.run(replica_scalar, args=tuple(args))
        return tf.add_n(list(strategy.experimental_local_results(scalars)))

    @tf.function
    def full():
        args = function_inputs(strategy, tensors)
        return strategy.run(lambda *t: list(all_reduce(t)), args=tuple(args))

    return timed, full, devices_seen


def check_devices(name, mode, devices_seen, devices):
    """Raises AssertionError unless the traced tensors were placed as the
    mode says: each replica's on its device, or all on ''."""
    if mode == "keras_path":
        for seen in devices_seen:
            assert len(seen) == 1 and "" not in seen, (name, mode, seen)
        placed = {_device_key(d) for seen in devices_seen for d in seen}
        assert placed <= {_device_key(d) for d in devices}, (name, mode, placed)
    else:
        for seen in devices_seen:
            assert seen == {""}, (name, mode, seen)


def _device_key(device):
    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "").upper(), spec.device_index


def check_full(strategy, full, expected):
    """Raises AssertionError unless every replica's output is `expected`."""
    outputs = full()
    assert len(outputs) == len(expected), (len(outputs), len(expected))
    for output, want in zip(outputs, expected):
        locals_ = strategy.experimental_local_results(output)
        assert len(locals_) == len(strategy.extended.worker_devices)
        for local in locals_:
            np.testing.assert_allclose(local.numpy(), want, rtol=RTOL, atol=ATOL)


def expected_scalar(expected, num_replicas):
    """What a timed function must return: every replica adds the first
    element of every output."""
    return num_replicas * sum(float(e.flat[0]) for e in expected)


def time_rounds(candidates, repeats):
    """Times each candidate `repeats` times, rotating the order per round.

    Returns:
        A dict from name to an array of seconds, one per round.
    """
    names = list(candidates)
    seconds = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            result = candidates[name]()
            if isinstance(result, tf.Tensor):
                result.numpy()
            seconds[name].append(time.perf_counter() - start)
            del result
    return {name: np.array(s) for name, s in seconds.items()}


def _ratio(numerator, denominator):
    """The median over rounds of numerator / denominator, or None."""
    if numerator is None or denominator is None:
        return None
    return float(np.median(numerator / denominator))


def _fmt(ratio):
    return f"{ratio:.2f}" if ratio is not None else "-"


def print_table(title, seconds, names, failed):
    """One table: the rows of `names` from `seconds` (name -> array)."""
    print(f"\n-- {title} --")
    print(
        f"  {'candidate':<26}{'median ms':>10}{'min ms':>9}"
        f"{'R1D/this':>10}{'stock/this':>12}{'this/numpy':>12}"
    )
    r1d, stock, floor = (seconds.get(k) for k in (R1D, STOCK, FLOOR))
    for name in names:
        if name in failed:
            print(f"  {name:<26}{'failed':>10}   ({failed[name]})")
            continue
        if name not in seconds:
            continue
        times = seconds[name]
        print(
            f"  {name:<26}{1e3 * np.median(times):>10.1f}"
            f"{1e3 * times.min():>9.1f}"
            f"{_fmt(_ratio(r1d, times)):>10}"
            f"{_fmt(_ratio(stock, times)):>12}"
            f"{_fmt(_ratio(times, floor)):>12}"
        )


class Verdicts:
    """Collects the PASS/FAIL lines, printed together at the end."""

    def __init__(self):
        self.lines = []

    def add(self, target, value, passed, text):
        """Adds the line for target number `target` (1 to 5, as the module
        docstring lists them; lines print in that order). `text` is
        formatted with `value`, a ratio shown as "1.23x"; a None value,
        where a candidate failed, is a FAIL."""
        if value is None:
            self.lines.append(
                (target, f"FAIL: {text.format(value='n/a (a candidate failed)')}")
            )
        else:
            verdict = "PASS" if passed(value) else "FAIL"
            line = f"{verdict}: {text.format(value=f'{value:.2f}x')}"
            self.lines.append((target, line))

    def print(self):
        print("\n== Verdicts ==")
        for _, line in sorted(self.lines, key=lambda item: item[0]):
            print(f"  {line}")


def run_set(set_name, strategies, devices, ours, verdicts):
    """Builds, checks, times and reports every candidate on one set."""
    modes = [m for m in REDUCE_MODES if m in FLAGS.modes]
    shapes = set_shapes(set_name)
    num_params = sum(int(np.prod(s)) for s in shapes)
    print(
        f"\n== {set_name}: {len(shapes)} float32 tensors, "
        f"{num_params / 1e6:.2f}M parameters ({num_params * 4 / 2**20:.1f} "
        f"MiB) per replica, {len(devices)} replicas, SUM =="
    )
    rng = np.random.default_rng(0)
    arrays = [
        [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        for _ in devices
    ]
    # One set of per-replica tensors, shared by all candidates.
    tensors = place(arrays, devices)
    expected = replica_sum(arrays)
    floor = numpy_floor(arrays)
    np.testing.assert_allclose(
        floor(), np.concatenate([e.ravel() for e in expected]), rtol=1e-6
    )
    want_scalar = expected_scalar(expected, len(devices))

    candidates = {}
    failed = {mode: {} for mode in modes}
    for mode in modes:
        for name, strategy in strategies.items():
            timed, full, devices_seen = reduce_fns(strategy, tensors, mode)
            start = time.perf_counter()
            try:
                got = float(timed().numpy())
                check_devices(name, mode, devices_seen, devices)
                np.testing.assert_allclose(
                    got, want_scalar, rtol=SCALAR_RTOL, atol=SCALAR_ATOL
                )
                if mode == "keras_path":
                    check_full(strategy, full, expected)
            except Exception as error:  # pylint: disable=broad-except
                message = f"{type(error).__name__}: {str(error).strip()}"
                message = message.splitlines()[0][:160]
                failed[mode][name] = message
                print(f"  {mode}/{name}: FAILED: {message}")
                continue
            checked = (
                "every replica's outputs match"
                if mode == "keras_path"
                else "the scalar matches"
            )
            print(
                f"  {mode}/{name}: traced, ran and checked in "
                f"{time.perf_counter() - start:.1f} s ({checked} numpy)"
            )
            candidates[(mode, name)] = timed
    candidates[FLOOR] = floor
    del expected
    gc.collect()

    seconds = time_rounds(candidates, FLAGS.repeats)
    names = list(strategies) + [FLOOR]
    by_mode = {}
    for mode in modes:
        by_mode[mode] = {
            name: seconds[(mode, name)]
            for name in strategies
            if (mode, name) in seconds
        }
        by_mode[mode][FLOOR] = seconds[FLOOR]
        print_table(f"{set_name}, {mode}", by_mode[mode], names, failed[mode])

    keras_path = by_mode.get("keras_path")
    unplaced = by_mode.get("unplaced")
    if keras_path is not None:
        if set_name in NUMPY_FLOOR_TARGET_SETS:
            verdicts.add(
                1,
                _ratio(keras_path.get(ours), keras_path[FLOOR]),
                lambda r: r <= MAX_OURS_TO_NUMPY_FLOOR,
                f"{set_name} keras_path: ours ({ours}) takes {{value}} the "
                f"numpy floor (target <= {MAX_OURS_TO_NUMPY_FLOOR}x).",
            )
        if set_name in REDUCTION_TO_ONE_DEVICE_TARGET_SETS:
            verdicts.add(
                2,
                _ratio(keras_path.get(R1D), keras_path.get("ours_local")),
                lambda r: r >= MIN_SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE,
                f"{set_name} keras_path: ours_local is {{value}} as fast as "
                f"reduction_to_one_device (target >= "
                f"{MIN_SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE}x).",
            )
        verdicts.add(
            5,
            _ratio(keras_path.get(STOCK), keras_path.get("ours_collective")),
            lambda r: r >= MIN_COLLECTIVE_SPEEDUP_VS_STOCK_DEFAULT,
            f"{set_name} keras_path: ours_collective is {{value}} as fast as "
            f"stock_default (target >= "
            f"{MIN_COLLECTIVE_SPEEDUP_VS_STOCK_DEFAULT}x).",
        )
    if keras_path is not None and unplaced is not None:
        verdicts.add(
            3,
            _ratio(unplaced.get("ours_local"), keras_path.get("ours_local")),
            lambda r: r <= MAX_UNPLACED_TO_KERAS_PATH,
            f"{set_name}: ours_local unplaced takes {{value}} its keras_path "
            f"time (target <= {MAX_UNPLACED_TO_KERAS_PATH}x).",
        )


def build_mlp(strategy, seed=0):
    """The AGN paper's MLP, compiled with Keras' Adam under `strategy`."""
    import keras

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((784,))]
            + [keras.layers.Dense(n, activation="relu") for n in (1000, 2000, 1000)]
            + [keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def run_fit(strategies, devices, ours, verdicts):
    """Times one `fit` step of the paper's MLP under every strategy."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Records each step's time, from its start until its loss is read."""

        def __init__(self):
            super().__init__()
            self.seconds = []
            self.losses = []
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            # Reading the loss waits for the step, whatever Keras did.
            self.losses.append(float(np.asarray(logs["loss"])))
            self.seconds.append(time.perf_counter() - self._start)

    global_batch = FLAGS.fit_batch_size * len(devices)
    print(
        f"\n== fit_step: MLP 784-1000-2000-1000-10, Adam, global batch "
        f"{global_batch} ({FLAGS.fit_batch_size} per replica), "
        f"{FLAGS.fit_steps} steps per timed fit call =="
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=(global_batch,)).astype(np.int32)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

    def fit_fn(model):
        def run():
            timer = StepTimer()
            model.fit(
                dataset,
                epochs=1,
                steps_per_epoch=FLAGS.fit_steps,
                verbose=0,
                shuffle=False,
                callbacks=[timer],
            )
            return timer

        return run

    candidates = {}
    failed = {}
    for name, strategy in strategies.items():
        start = time.perf_counter()
        try:
            timer = fit_fn(build_mlp(strategy))
            warmup = timer()
            assert all(np.isfinite(warmup.losses)), warmup.losses
        except Exception as error:  # pylint: disable=broad-except
            message = f"{type(error).__name__}: {str(error).strip()}"
            failed[name] = message.splitlines()[0][:160]
            print(f"  fit_step/{name}: FAILED: {failed[name]}")
            continue
        print(
            f"  fit_step/{name}: built, traced and warmed up in "
            f"{time.perf_counter() - start:.1f} s; losses "
            + ", ".join(f"{loss:.4f}" for loss in warmup.losses)
        )
        candidates[name] = timer

    names = list(candidates)
    seconds = {name: [] for name in names}
    for round_index in range(FLAGS.repeats):
        shift = round_index % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            seconds[name].append(np.median(candidates[name]().seconds))
    seconds = {name: np.array(s) for name, s in seconds.items()}
    print_table("fit_step (ms per step)", seconds, list(strategies), failed)
    verdicts.add(
        4,
        _ratio(seconds.get(STOCK), seconds.get(ours)),
        lambda r: r >= MIN_FIT_SPEEDUP_VS_STOCK_DEFAULT,
        f"fit_step: ours ({ours}) steps {{value}} as fast as stock_default "
        f"(target >= {MIN_FIT_SPEEDUP_VS_STOCK_DEFAULT}x).",
    )


def main(argv):
    del argv
    for set_name in FLAGS.sets:
        if set_name not in SETS:
            raise app.UsageError(
                f"Unknown set {set_name!r}; allowed: {', '.join(SETS)}."
            )
    for mode in FLAGS.modes:
        if mode not in MODES:
            raise app.UsageError(
                f"Unknown mode {mode!r}; allowed: {', '.join(MODES)}."
            )
    devices = split_cpu(FLAGS.num_devices)
    tf.get_logger().setLevel("ERROR")
    import keras

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
        f"; {os.cpu_count()} CPUs (os.cpu_count()); load average {load}; "
        f"TensorFlow {tf.__version__}; Keras {keras.__version__}"
    )
    strategies = build_strategies(devices)
    transport = transports.choose_transport(devices, num_workers=1)
    ours = f"ours_{transport}"
    print(
        f"{len(devices)} logical CPU devices; stock_default: MirroredStrategy "
        f"picks {describe_stock(strategies[STOCK])}; "
        f'transport="auto" picks "{transport}" here, so ours = {ours}; '
        f"{FLAGS.repeats} rounds"
    )
    verdicts = Verdicts()
    for set_name in FLAGS.sets:
        if any(m in FLAGS.modes for m in REDUCE_MODES):
            run_set(set_name, strategies, devices, ours, verdicts)
            gc.collect()
    if "fit_step" in FLAGS.modes:
        run_fit(strategies, devices, ours, verdicts)
    verdicts.print()


if __name__ == "__main__":
    app.run(main)
