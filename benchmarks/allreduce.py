r"""Times all-reducing model-sized gradient sets across logical CPU devices.

Every candidate reduces the same per-replica float32 tensors, in one
process, in interleaved rounds (the order rotates every round), so that the
load of a shared machine falls on all of them alike. The table reports
each candidate's median and minimum time and its ratios to
`reduction_to_one_device` and to `numpy_floor` (medians over rounds of the
ratio within a round):

- `ours`: `tf_agn.AggregatingAllReduce()` with its defaults;
- `ours_nojit`: the same with `jit_compile=False`;
- `ours_<n>`: the same with `bytes_per_pack=<n>`, for each `--bytes_per_pack`;
- `reduction_to_one_device`: `tf.distribute.ReductionToOneDevice()`;
- `hierarchical_copy`: `tf.distribute.HierarchicalCopyAllReduce()`;
- `harness_only`: the timed function without the reduction, i.e. the fixed
  cost that every TensorFlow row above includes;
- `numpy_floor`: numpy summing the replicas' arrays into preallocated
  outputs (`out=`). It reads the same bytes, on one thread, but allocates,
  scales and broadcasts nothing: a floor, not a competitor.

A timed call runs a `tf.function` that reduces every tensor to every device
and returns one scalar that adds one element of every output on every
device, so it cannot return before all the work is done. Before timing,
`ours` is checked against numpy on every device.

Targets (from the issue): on the ResNet-50 set, `ours` >= 2x faster than
`reduction_to_one_device` and within 1.5x of `numpy_floor`.

BERT-base at full size (110M parameters) holds 4 replicas' inputs twice (as
numpy arrays for the floor and as tensors) plus the outputs: about 9 GiB of
RAM. `--bert_scale` shrinks it.

Usage:

    python benchmarks/allreduce.py --sets=resnet50 --repeats=40
    python benchmarks/allreduce.py --bytes_per_pack=1048576,67108864
"""

import gc
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn.strategies import split_cpu  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 20, "Timed rounds per candidate.")
flags.DEFINE_integer("num_devices", 4, "Logical CPU devices (replicas).")
flags.DEFINE_list("sets", ["resnet50", "bert_base"], "Gradient sets to time.")
flags.DEFINE_list(
    "bytes_per_pack",
    [],
    "Extra pack sizes, in bytes, to time `ours` with besides its default.",
)
flags.DEFINE_enum(
    "reduce_op", "mean", ["mean", "sum"], "The tf.distribute.ReduceOp."
)
flags.DEFINE_float(
    "bert_scale",
    1.0,
    "Fraction of BERT-base's vocabulary and layers to build, for machines "
    "with too little memory for 4 replicas of 110M parameters.",
)
flags.DEFINE_bool(
    "bfc_cpu_allocator",
    False,
    "Set TF_CPU_ALLOCATOR_USE_BFC=true, so that TensorFlow pools host "
    "memory rather than taking it from malloc for every output. Shows how "
    "much of each TensorFlow row is page faults on fresh output memory.",
)

SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE = 2.0
MAX_RATIO_TO_NUMPY = 1.5


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


def distribute(arrays, devices):
    """Per-replica values: `arrays[r][i]` on `devices[r]`, for every i."""
    strategy = tf.distribute.MirroredStrategy(devices)

    def value_fn(context, index):
        replica = context.replica_id_in_sync_group
        # MirroredStrategy calls this without a device scope, and an eager
        # constant lives on CPU:0 in any scope: the identity moves it.
        with tf.device(devices[replica]):
            return tf.identity(tf.constant(arrays[replica][index]))

    return [
        strategy.experimental_distribute_values_from_function(
            lambda context, i=i: value_fn(context, i)
        )
        for i in range(len(arrays[0]))
    ]


def numpy_floor(per_replica_arrays):
    """Returns a function that sums the replicas' arrays into fixed outputs."""
    outputs = [np.empty_like(a) for a in per_replica_arrays[0]]

    def run():
        for index, out in enumerate(outputs):
            first, second, *rest = [r[index] for r in per_replica_arrays]
            np.add(first, second, out=out)
            for array in rest:
                np.add(out, array, out=out)
        return outputs

    return run


def reduce_fns(strategy, values, reduce_op, devices):
    """`tf.function`s that all-reduce `values` with `strategy`.

    Args:
        strategy: a `MirroredStrategy`, or None to skip the reduction and
            time the rest of the function alone.
        values: the per-replica values.
        reduce_op: a `tf.distribute.ReduceOp`.
        devices: the replicas' devices.

    Returns:
        `(timed, full)`: `timed()` returns a scalar that reads one element
        of every output on every device; `full()` returns every output.
    """

    def all_reduce():
        if strategy is None:
            return values
        return strategy.extended.batch_reduce_to(
            reduce_op, [(v, v) for v in values]
        )

    @tf.function
    def timed():
        reduced = all_reduce()
        firsts = []
        for index, device in enumerate(devices):
            with tf.device(device):
                # One strided slice per output: cheap, yet a data dependency,
                # which (unlike a control dependency) Grappler cannot prune.
                firsts.append(
                    tf.add_n([_first(r.values[index]) for r in reduced])
                )
        return tf.add_n(firsts)

    @tf.function
    def full():
        return [r.values for r in all_reduce()]

    return timed, full


def _first(tensor):
    return tensor[(0,) * tensor.shape.rank]


def check(full, expected):
    """Raises AssertionError unless every device's output is `expected`."""
    for value, want in zip(full(), expected):
        for local in value:
            np.testing.assert_allclose(
                local.numpy(), want, rtol=1e-5, atol=1e-5
            )


def time_rounds(candidates, repeats):
    """Times each candidate `repeats` times, rotating the order per round.

    Returns:
        A dict from name to a list of seconds.
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
    return seconds


def candidate_ops():
    """The cross-device ops to time, by name."""
    ops = {
        "ours": tf_agn.AggregatingAllReduce(),
        "ours_nojit": tf_agn.AggregatingAllReduce(jit_compile=False),
    }
    for size in FLAGS.bytes_per_pack:
        ops[f"ours_{size}"] = tf_agn.AggregatingAllReduce(
            bytes_per_pack=int(size)
        )
    ops["reduction_to_one_device"] = tf.distribute.ReductionToOneDevice()
    ops["hierarchical_copy"] = tf.distribute.HierarchicalCopyAllReduce()
    return ops


def report(seconds):
    """Prints the table and the verdicts on the targets.

    Ratios are medians over rounds of the ratio within a round: the
    candidates of a round ran back to back, so a change in the machine's
    load between rounds cancels out.
    """
    seconds = {name: np.array(s) for name, s in seconds.items()}
    baseline = seconds["reduction_to_one_device"]
    floor = seconds["numpy_floor"]
    print(
        f"\n  {'candidate':<26}{'median ms':>10}{'min ms':>9}"
        f"{'R1D/this':>10}{'this/numpy':>12}"
    )
    for name, times in seconds.items():
        print(
            f"  {name:<26}{1e3 * np.median(times):>10.1f}"
            f"{1e3 * times.min():>9.1f}"
            f"{np.median(baseline / times):>10.2f}"
            f"{np.median(times / floor):>12.2f}"
        )
    speedup = np.median(baseline / seconds["ours"])
    passed = speedup >= SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE
    print(
        f"  {'PASS' if passed else 'FAIL'}: ours is {speedup:.2f}x faster "
        f"than ReductionToOneDevice (target >= "
        f"{SPEEDUP_VS_REDUCTION_TO_ONE_DEVICE}x)."
    )
    ratio = np.median(seconds["ours"] / floor)
    passed = ratio <= MAX_RATIO_TO_NUMPY
    print(
        f"  {'PASS' if passed else 'FAIL'}: ours takes {ratio:.2f}x the numpy "
        f"floor (target <= {MAX_RATIO_TO_NUMPY}x)."
    )


def run_set(set_name, shapes, devices):
    """Builds, checks, times and reports every candidate on one set."""
    num_params = sum(int(np.prod(s)) for s in shapes)
    print(
        f"\n== {set_name}: {len(shapes)} float32 tensors, "
        f"{num_params / 1e6:.1f}M parameters ({num_params * 4 / 2**20:.0f} "
        f"MiB) per replica, {len(devices)} replicas, "
        f"{FLAGS.reduce_op.upper()} =="
    )
    rng = np.random.default_rng(0)
    arrays = [
        [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        for _ in devices
    ]
    # One set of per-replica tensors, shared by all candidates.
    values = distribute(arrays, devices)
    reduce_op = tf.distribute.ReduceOp[FLAGS.reduce_op.upper()]
    floor = numpy_floor(arrays)
    expected = floor()
    if reduce_op == tf.distribute.ReduceOp.MEAN:
        expected = [e / len(devices) for e in expected]

    candidates = {}
    for name, cross_device_ops in candidate_ops().items():
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=cross_device_ops
        )
        timed, full = reduce_fns(strategy, values, reduce_op, devices)
        start = time.perf_counter()
        timed().numpy()
        print(
            f"  {name}: traced and compiled in "
            f"{time.perf_counter() - start:.1f} s"
        )
        if name == "ours":
            check(full, expected)
            print("  ours: every device's result matches numpy.")
        candidates[name] = timed
    candidates["harness_only"] = reduce_fns(None, values, reduce_op, devices)[0]
    candidates["numpy_floor"] = floor
    report(time_rounds(candidates, FLAGS.repeats))


def main(argv):
    del argv
    if FLAGS.bfc_cpu_allocator:
        # Read when TensorFlow creates its devices, in split_cpu below.
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    devices = split_cpu(FLAGS.num_devices)
    tf.get_logger().setLevel("ERROR")
    print(
        f"{os.cpu_count()} CPU cores; TF_CPU_ALLOCATOR_USE_BFC="
        f"{os.environ.get('TF_CPU_ALLOCATOR_USE_BFC', 'unset')}"
    )
    builders = {
        "resnet50": resnet50_shapes,
        "bert_base": lambda: bert_base_shapes(FLAGS.bert_scale),
    }
    for set_name in FLAGS.sets:
        run_set(set_name, builders[set_name](), devices)
        gc.collect()


if __name__ == "__main__":
    app.run(main)
