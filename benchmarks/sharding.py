"""Sharded optimizer state (`shard_optimizer_state=True`): memory and speed.

    python benchmarks/sharding.py                 # every part
    python benchmarks/sharding.py --parts=memory
    python benchmarks/sharding.py --parts=saving --steps=2

1. memory: for the 784-4096-4096-1024-10 MLP (24.2M parameters) and
   ResNet-50 (23.6M with 10 classes, 32x32 inputs), Adam, sharded and unsharded, each
   trained for `--steps` steps of `model.fit` in a fresh process on
   `--num_replicas` logical CPUs: the bytes one replica holds
   (`optimizer.memory_stats()`) and the process's peak resident memory.
   Target: the MLP's peak drops by at least half of what the moments'
   sharding saves, 3 x 8 bytes x 24.2M on 4 replicas. Then, by formula,
   a 1B-parameter model: 16 bytes a parameter unsharded, 8 + 12/n sharded
   (weights and gradients whole; the moments and the part of the weights a
   step updates, sharded), beside ZeRO's published 4 + 12/n (float16
   weights and gradients, float32 master weights).
2. speed: the MLP at `--rows_per_replica` rows per replica, the median
   `model.fit` step (ms, `--repeats` rounds of `--steps`) of stock Keras
   (Adam under `tf.distribute.MirroredStrategy`'s default ops), tf_agn
   unsharded and sharded; the communication alone (a reduce-scatter and an
   all-gather of the gradients' volume against one all-reduce), with its
   bytes. Target: sharded <= 1.05x unsharded.
3. workers: the speed part's fit steps across `--num_workers` localhost
   worker processes, one CPU replica each (stock Keras over TensorFlow's
   own collectives, tf_agn's over its collective transport).
4. saving: across `--num_workers` worker processes, one CPU replica each,
   the MLP with sharded Adam trained `--steps` steps, each worker's peak
   resident memory in fresh processes: training alone, then training and
   `model.save_weights` to `.weights.h5` (as Keras's `BackupAndRestore` and
   `ModelCheckpoint(save_weights_only=True)` save), then training and
   `model.save` to `.keras`. Target: saving adds at most twice the largest
   variable's bytes to training's peak. Keras writes a `.keras` file's
   weights into an in-memory `.h5` first: that copy, the size of the
   weights file, is not counted against the target and is printed on its
   own line.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "parts", ["memory", "speed", "workers", "saving"], "memory, speed, workers, saving."
)
flags.DEFINE_integer("num_workers", 2, "Worker processes of the workers part.")
flags.DEFINE_integer("num_replicas", 4, "Logical CPU replicas.")
flags.DEFINE_list("hidden_units", ["4096", "4096", "1024"], "The MLP's hidden widths.")
flags.DEFINE_integer("steps", 5, "fit steps a round (memory: steps trained).")
flags.DEFINE_integer("repeats", 3, "Rounds of the speed part.")
flags.DEFINE_integer("rows_per_replica", 32, "Rows per replica a step.")
flags.DEFINE_list("models", ["mlp", "resnet50"], "The memory part's models.")
flags.DEFINE_string("child", None, "Internal: run one memory configuration.")
flags.DEFINE_string("saving_child", None, "Internal: run one saving configuration, as a worker.")
flags.DEFINE_string("results_dir", None, "Internal: where saving workers write their results.")

MIB = 2**20
MAX_SHARDED_TO_UNSHARDED = 1.05


def build(model_name, make_optimizer, strategy):
    import keras

    import tf_agn

    with strategy.scope():
        if model_name == "resnet50":
            model = keras.applications.ResNet50(
                weights=None, input_shape=(32, 32, 3), classes=10
            )
        else:
            hidden = tuple(int(u) for u in FLAGS.hidden_units)
            model = tf_agn.models.mlp((784,), 10, hidden_units=hidden)
        model.compile(make_optimizer(), "sparse_categorical_crossentropy")
    return model


def data(model_name, rows):
    import numpy as np

    shape = (32, 32, 3) if model_name == "resnet50" else (784,)
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, *shape)).astype("float32"), rng.integers(0, 10, rows)


def child(configuration):
    """One memory configuration, in this fresh process: prints its JSON."""
    import tf_agn

    tf_agn.strategies.split_cpu(FLAGS.num_replicas)
    model_name, shard = configuration.split(":")
    strategy = tf_agn.strategies.mirrored()
    model = build(
        model_name,
        lambda: tf_agn.optimizers.Adam(1e-4, shard_optimizer_state=shard == "sharded"),
        strategy,
    )
    rows = FLAGS.rows_per_replica * FLAGS.num_replicas
    x, y = data(model_name, rows * FLAGS.steps)
    model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
    print(json.dumps({
        "parameters": model.count_params(),
        "stats": model.optimizer.memory_stats(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def memory_part():
    print(f"\n-- memory: Adam, {FLAGS.num_replicas} replicas, {FLAGS.steps} fit steps, fresh processes")
    print("| model | state | weights MiB | gradients MiB | optimizer state MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    peaks = {}
    for model_name in FLAGS.models:
        for shard in ("unsharded", "sharded"):
            out = subprocess.run(
                [sys.executable, __file__, f"--child={model_name}:{shard}",
                 f"--num_replicas={FLAGS.num_replicas}", f"--steps={FLAGS.steps}",
                 f"--rows_per_replica={FLAGS.rows_per_replica}",
                 f"--hidden_units={','.join(FLAGS.hidden_units)}"],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]
            result = json.loads(out)
            stats = result["stats"]
            peaks[model_name, shard] = result
            print(
                f"| {model_name} ({result['parameters'] / 1e6:.1f}M) | {shard} | "
                f"{stats['weights'] / MIB:.1f} | {stats['gradients'] / MIB:.1f} | "
                f"{stats['optimizer_state'] / MIB:.1f} | {result['peak_rss_mib']:.0f} |"
            )
    if "mlp" in FLAGS.models:
        parameters = peaks["mlp", "sharded"]["parameters"]
        saved = (FLAGS.num_replicas - 1) * 8 * parameters / MIB
        drop = peaks["mlp", "unsharded"]["peak_rss_mib"] - peaks["mlp", "sharded"]["peak_rss_mib"]
        verdict = "PASS" if drop >= saved / 2 else "FAIL"
        print(
            f"  {verdict}: the MLP's peak resident memory drops by {drop:.0f} MiB; target "
            f">= {saved / 2:.0f} MiB (half of the {saved:.0f} MiB the moments' sharding saves)"
        )
    n = FLAGS.num_replicas
    print(f"\n-- 1B parameters, by formula, bytes a replica on {n} replicas (GiB)")
    print("| | formula | GiB |")
    print("|---|---|---|")
    for name, formula, value in (
        ("unsharded, float32 Adam", "16Ψ", 16),
        ("tf_agn sharded, float32 Adam", "8Ψ + 12Ψ/n", 8 + 12 / n),
        ("ZeRO-1 published (fp16, fp32 master)", "4Ψ + 12Ψ/n", 4 + 12 / n),
    ):
        print(f"| {name} | {formula} | {value * 1e9 / 2**30:.1f} |")


CANDIDATES = {
    "stock Keras (default ops)": (False, False),
    "tf_agn unsharded": (True, False),
    "tf_agn sharded": (True, True),
}


def timed_fit_steps(strategy_for, x, y, rows, say):
    """Times the median `model.fit` step of each of `CANDIDATES` (Keras's
    Adam, tf_agn's unsharded and sharded) and prints a table and verdict.

    Args:
        strategy_for: `strategy_for(name)`, the strategy candidate `name`
            is built and trained under.
        x, y: `--steps` global batches of `rows` rows.
        rows: the global batch.
        say: `print`, or nothing on a worker other than the chief.
    """
    import keras
    import numpy as np

    import tf_agn

    say("| candidate | ms a step |")
    say("|---|---|")
    medians = {}
    for name, (ours, shard) in CANDIDATES.items():

        def make_optimizer(ours=ours, shard=shard):
            if ours:
                return tf_agn.optimizers.Adam(1e-4, shard_optimizer_state=shard)
            return keras.optimizers.Adam(1e-4)

        strategy = strategy_for(name)
        model = build("mlp", make_optimizer, strategy)
        model.fit(x[: rows * 2], y[: rows * 2], batch_size=rows, verbose=0)  # trace
        times = []
        for _ in range(FLAGS.repeats):
            start = time.perf_counter()
            model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
            times.append((time.perf_counter() - start) / FLAGS.steps)
        medians[name] = 1e3 * float(np.median(times))
        say(f"| {name} | {medians[name]:.1f} |")
    ratio = medians["tf_agn sharded"] / medians["tf_agn unsharded"]
    verdict = "PASS" if ratio <= MAX_SHARDED_TO_UNSHARDED else "FAIL"
    say(f"  {verdict}: sharded / unsharded = {ratio:.2f}; target <= {MAX_SHARDED_TO_UNSHARDED}")


def speed_part():
    import tensorflow as tf

    import tf_agn

    devices = tf_agn.strategies.split_cpu(FLAGS.num_replicas)
    rows = FLAGS.rows_per_replica * FLAGS.num_replicas
    x, y = data("mlp", rows * FLAGS.steps)
    stock, ours = tf.distribute.MirroredStrategy(devices), tf_agn.strategies.mirrored(devices)
    print(f"\n-- speed: MLP, {rows} rows a step over {FLAGS.num_replicas} replicas, median fit step")
    timed_fit_steps(lambda name: ours if CANDIDATES[name][0] else stock, x, y, rows, print)
    communication_only(devices)


def workers_part():
    """The speed part across `--num_workers` worker processes, one CPU
    replica each: this process relaunches itself as every worker."""
    if "TF_CONFIG" not in os.environ:
        from tf_agn.strategies import launch

        print(f"\n-- speed: {FLAGS.num_workers} workers on localhost, one CPU replica each")
        sys.stdout.flush()
        command = [sys.executable, __file__, "--parts=workers", *_forwarded_flags()]
        code = launch.run_workers(command, FLAGS.num_workers)
        if code:
            sys.exit(code)
        return
    import tf_agn
    from tf_agn import _compat

    strategy = tf_agn.strategies.KerasMultiWorkerMirroredStrategy()
    task = int(strategy.cluster_resolver.task_id)
    ours = tf_agn.AggregatingAllReduce(
        transport="collective", num_workers=FLAGS.num_workers, worker_index=task
    )
    ops = {False: _compat.cross_device_ops(strategy.extended), True: ours}
    is_chief = task == 0

    def strategy_for(name):
        # TensorFlow's collectives for Keras's Adam, tf_agn's for tf_agn's.
        _compat.replace_cross_device_ops(strategy.extended, ops[CANDIDATES[name][0]])
        return strategy

    rows = FLAGS.rows_per_replica * FLAGS.num_workers
    x, y = data("mlp", rows * FLAGS.steps)
    say = print if is_chief else (lambda *args, **kwargs: None)
    say(f"MLP, {rows} rows a step, median fit step")
    timed_fit_steps(strategy_for, x, y, rows, say)


SAVINGS = ("training alone", ".weights.h5", ".keras")


def saving_part():
    """Each worker's peak resident memory, training alone and training then
    saving (`SAVINGS`), each in fresh worker processes."""
    from tf_agn.strategies import launch

    n = FLAGS.num_workers
    print(f"\n-- saving: sharded Adam, {n} workers on localhost, one CPU replica each, "
          f"{FLAGS.steps} fit steps, fresh processes")
    print("| run | " + " | ".join(f"worker {i} peak RSS MiB" for i in range(n)) + " |")
    print("|---|" + "---|" * n)
    results = {}
    for saving in SAVINGS:
        with tempfile.TemporaryDirectory() as directory:
            sys.stdout.flush()
            command = [sys.executable, __file__, f"--saving_child={saving}",
                       f"--results_dir={directory}", *_forwarded_flags()]
            code = launch.run_workers(command, n)
            if code:
                sys.exit(code)
            results[saving] = [
                json.load(open(os.path.join(directory, f"worker{i}.json"))) for i in range(n)
            ]
        peaks = " | ".join(f"{r['peak_rss_mib']:.0f}" for r in results[saving])
        print(f"| {saving} | {peaks} |")
    largest = results[SAVINGS[0]][0]["largest_variable_mib"]
    in_memory = max(r["weights_file_mib"] for r in results[".keras"])
    trained = [r["peak_rss_mib"] for r in results["training alone"]]
    added = {
        saving: max(r["peak_rss_mib"] - t for r, t in zip(results[saving], trained))
        for saving in SAVINGS[1:]
    }
    print(f"  Keras's in-memory .h5 of the .keras file's weights (not counted): "
          f"{in_memory:.0f} MiB; the .keras peak above the .weights.h5 one: "
          f"{added['.keras'] - added['.weights.h5']:.0f} MiB")
    added[".keras"] -= in_memory
    worst = max(added.values())
    verdict = "PASS" if worst <= 2 * largest else "FAIL"
    print(
        f"  {verdict}: saving adds at most {worst:.0f} MiB to a worker's training peak "
        f"(.weights.h5 {added['.weights.h5']:.0f}, .keras {added['.keras']:.0f} without Keras's "
        f"copy); target <= {2 * largest:.0f} MiB (twice the largest variable, {largest:.0f} MiB)"
    )


def saving_child(saving):
    """One worker of one `saving_part` run: trains, saves as `saving` says,
    and writes its peak resident memory."""
    import numpy as np

    import tf_agn

    strategy = tf_agn.strategies.multi_worker_mirrored()
    task = int(strategy.cluster_resolver.task_id)
    model = build(
        "mlp", lambda: tf_agn.optimizers.Adam(1e-4, shard_optimizer_state=True), strategy
    )
    rows = FLAGS.rows_per_replica * FLAGS.num_workers
    x, y = data("mlp", rows * FLAGS.steps)
    model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
    path = os.path.join(FLAGS.results_dir, f"worker{task}{saving}")
    weights_file = 0
    # Every worker saves, each to its own path, as Keras asks.
    if saving == ".weights.h5":
        model.save_weights(path)
    elif saving == ".keras":
        model.save(path)
        with zipfile.ZipFile(path) as archive:
            weights_file = archive.getinfo("model.weights.h5").file_size
    result = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "largest_variable_mib": max(np.prod(v.shape) * 4 for v in model.trainable_variables) / MIB,
        "weights_file_mib": weights_file / MIB,
    }
    with open(os.path.join(FLAGS.results_dir, f"worker{task}.json"), "w") as out:
        json.dump(result, out)


def _forwarded_flags():
    return [
        f"--steps={FLAGS.steps}", f"--repeats={FLAGS.repeats}",
        f"--rows_per_replica={FLAGS.rows_per_replica}",
        f"--hidden_units={','.join(FLAGS.hidden_units)}", f"--num_workers={FLAGS.num_workers}",
    ]


def communication_only(devices):
    """A reduce-scatter and an all-gather of the MLP's gradient volume,
    against one all-reduce of it, through tf_agn's road in replica context."""
    import numpy as np
    import tensorflow as tf

    import tf_agn
    from tf_agn.collectives import routing

    n = len(devices)
    widths = [784, *(int(u) for u in FLAGS.hidden_units), 10]
    count = sum(a * b + b for a, b in zip(widths, widths[1:]))
    part = -(-count // n)
    strategy = tf_agn.strategies.mirrored(devices)
    with strategy.scope():
        buffer = tf.Variable(tf.zeros([n, part]))

    @tf.function
    def all_reduce():
        # Summed whole, so that no compiler keeps only the part returned.
        return strategy.run(lambda: tf.reduce_sum(tf_agn.aggregate([tf.reshape(buffer, [-1])], "sum")[0]))

    @tf.function
    def scatter_and_gather():
        def step():
            (mine,), _ = routing.reduce_scatter([buffer * 1.0], "sum")
            (whole,) = routing.all_gather([mine])
            return tf.reduce_sum(whole)

        return strategy.run(step)

    print(f"\n-- communication alone: {count / 1e6:.1f}M float32 ({4 * n * part / MIB:.0f} MiB a replica)")
    print("| pattern | ms |")
    print("|---|---|")
    for name, function in (("all-reduce", all_reduce), ("reduce-scatter + all-gather", scatter_and_gather)):
        function()
        times = []
        for _ in range(FLAGS.repeats * FLAGS.steps):
            start = time.perf_counter()
            strategy.experimental_local_results(function())[0].numpy()
            times.append(time.perf_counter() - start)
        print(f"| {name} | {1e3 * float(np.median(times)):.1f} |")


def main(argv):
    del argv
    if FLAGS.child:
        child(FLAGS.child)
        return
    if FLAGS.saving_child:
        saving_child(FLAGS.saving_child)
        return
    if "TF_CONFIG" in os.environ:  # a worker of the workers part
        workers_part()
        return
    import tensorflow as tf

    print(f"TensorFlow {tf.__version__}; {os.cpu_count()} CPUs")
    if "memory" in FLAGS.parts:
        memory_part()
    if "speed" in FLAGS.parts:
        speed_part()
    if "workers" in FLAGS.parts:
        workers_part()
    if "saving" in FLAGS.parts:
        saving_part()


if __name__ == "__main__":
    app.run(main)
