r"""Times the gradient all-reduce across worker processes, on Keras's path.

Started without `TF_CONFIG`, this script runs itself as every worker of a
`--num_workers` cluster on localhost (`python -m tf_agn.strategies.launch
--multi_worker` does the same for any command) and worker 0 prints the
results. Each worker builds one `MultiWorkerMirroredStrategy`, with one
replica on its CPU (the strategy takes GPUs, or the CPU, never logical
CPUs); its all-reduce is swapped between these candidates, each traced
while installed:

- `mwms_default`: what `MultiWorkerMirroredStrategy` builds itself,
  TensorFlow's `CollectiveAllReduce` (the header prints its
  implementation), which packs everything into one collective;
- `ours`: `tf_agn.AggregatingAllReduce(transport="collective")`, what
  `tf_agn.strategies.multi_worker_mirrored()` installs;
- `ours_fp16`: the same with `compression="fp16"`.

Each timed call is `allreduce.py`'s `keras_path` mode: inside
`strategy.run`, every replica computes its tensors on its device and
all-reduces them with `replica_context.all_reduce(SUM, ...)`, as Keras's
optimizer does; `ours_fp16` sums them as tf_agn's optimizers do
(`tf_agn.collectives.routing.aggregate`), the only path compression
applies to. Every candidate's outputs are first checked against numpy
on every local replica (fp16 within its precision). Candidates run in
interleaved rounds whose order rotates every round, the same order on
every worker (collectives must meet in one order).

Bytes on the wire are measured, not computed: the loopback interface's
transmitted bytes (`/proc/net/dev`, every process of this network
namespace, TCP and gRPC headers included) over `--byte_calls` calls of a
candidate, then one all-reduce of a scalar, after which every worker has
received all it needs from the calls before. The table shows them per
call, next to what a ring moves: every worker sends 2(n - 1)/n of its
payload, n = all replicas. Keep other localhost traffic (tests, clusters)
off the machine while it runs.

Targets (verdict lines):

1. every set: `ours` is at least `MIN_SPEEDUP_VS_MWMS` times as fast as
   `mwms_default`;
2. every set: `ours_fp16` puts at most `MAX_FP16_BYTES_RATIO` times the
   bytes of `ours` on the wire.

Usage (~5 minutes on 2 CPU cores for the first):

    python benchmarks/multi_worker_allreduce.py --repeats=10
    python benchmarks/multi_worker_allreduce.py --sets=big --repeats=3
"""

import datetime
import gc
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import allreduce  # noqa: E402  (benchmarks/allreduce.py: sets and timing)
import tf_agn  # noqa: E402
from tf_agn import _compat  # noqa: E402
from tf_agn.collectives import cross_device_ops  # noqa: E402
from tf_agn.collectives import routing  # noqa: E402
from tf_agn.strategies import launch  # noqa: E402

# Targets.
MIN_SPEEDUP_VS_MWMS = 1.0  # mwms_default / ours.
# fp16 halves the payload; headers and the sync call add a little.
MAX_FP16_BYTES_RATIO = 0.55

MWMS = "mwms_default"
FP16 = "ours_fp16"
FP16_RTOL = 1e-2
FP16_ATOL = 2e-2

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Worker processes.")
flags.DEFINE_integer(
    "byte_calls", 3, "Calls per candidate whose loopback bytes are counted."
)
# allreduce.py's flags that apply here: --sets, --repeats and the sizes of
# the sets. Its other flags (--num_devices, --modes, --fit_*) do not.
FLAGS.set_default("sets", ["resnet50", "big"])
FLAGS.set_default("repeats", 10)


def loopback_bytes_sent():
    """Bytes the loopback interface has transmitted, from /proc/net/dev."""
    with open("/proc/net/dev") as stats:
        for line in stats:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    raise RuntimeError("/proc/net/dev lists no loopback interface 'lo'.")


def our_ops(strategy, **kwargs):
    """tf_agn's collective all-reduce for this worker of `strategy`."""
    resolver = strategy.cluster_resolver
    return tf_agn.AggregatingAllReduce(
        transport="collective",
        num_workers=len(resolver.cluster_spec().as_dict()["worker"]),
        worker_index=int(resolver.task_id),
        **kwargs,
    )


def optimizer_sum(tensors):
    """Sums a replica's tensors across replicas as tf_agn's optimizers
    combine gradients (the path compression applies to), with the
    compression of the strategy's ops, as an optimizer without its own
    takes it."""
    strategy = tf.distribute.get_strategy()
    return routing.aggregate(
        tensors, "sum", compressor=cross_device_ops.default_compression(strategy)
    )


def sync_fn(strategy):
    """A function that all-reduces one scalar: when it returns on a worker,
    every worker has finished the calls before it."""

    @tf.function
    def sync():
        value = strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.ones(())
            )
        )
        return strategy.experimental_local_results(value)[0]

    return sync


def bytes_per_call(timed, sync, calls):
    start = loopback_bytes_sent()
    for _ in range(calls):
        timed().numpy()
    sync().numpy()
    return (loopback_bytes_sent() - start) / calls


class CallTimer(keras.callbacks.Callback):
    """Times a one-epoch `fit` call's steps after its first, until its last
    loss is read: `seconds`.

    A call's first step also starts the input pipeline and, where workers
    exchange, waits for the others to arrive.
    """

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            float(logs["loss"])  # waits for the step
            self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        float(logs["loss"])  # waits for the last step
        self.seconds = time.perf_counter() - self.start


def announce(strategy, core, setup):
    """Prints which core this worker is pinned to and, on the chief, the
    machine's header and `setup`.

    Returns:
        `(is_chief, say)`: `say` prints on the chief and nowhere else.
    """
    task = int(strategy.cluster_resolver.task_id)
    say = print if task == 0 else (lambda *args, **kwargs: None)
    print(f"worker {task}: pinned to CPU {core}", flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    say(
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"{os.cpu_count()} CPUs; load average {load}; TensorFlow {tf.__version__}; "
        f"Keras {keras.__version__}\n{FLAGS.num_workers} workers, one CPU replica each; {setup}",
        flush=True,
    )
    return task == 0, say


def fit_steps(model, dataset, steps, callbacks=()):
    """One `fit` call of `steps` steps of `dataset`, silent."""
    model.fit(
        dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
        callbacks=list(callbacks),
    )


def run_set(set_name, strategy, candidates, verdicts, is_chief):
    devices = strategy.extended.worker_devices
    num_local = len(devices)
    num_replicas = strategy.num_replicas_in_sync
    first = int(strategy.cluster_resolver.task_id) * num_local
    shapes = allreduce.set_shapes(set_name)
    num_params = sum(int(np.prod(s)) for s in shapes)
    payload = num_params * 4
    say = print if is_chief else (lambda *a, **k: None)
    say(
        f"\n== {set_name}: {len(shapes)} float32 tensors, "
        f"{num_params / 1e6:.2f}M parameters ({payload / 2**20:.1f} MiB) per "
        f"replica, {num_replicas} replicas on {FLAGS.num_workers} workers, SUM =="
    )
    # Every worker draws all replicas' arrays, so it knows the sum.
    rng = np.random.default_rng(0)
    every = [
        [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        for _ in range(num_replicas)
    ]
    expected = [np.sum([r[i] for r in every], axis=0) for i in range(len(shapes))]
    tensors = allreduce.place(every[first : first + num_local], devices)
    del every
    gc.collect()

    timed_fns, failed = {}, {}
    for name, ops in candidates.items():
        _compat.replace_cross_device_ops(strategy.extended, ops)
        timed, full, _ = allreduce.reduce_fns(
            strategy, tensors, "keras_path", optimizer_sum if name == FP16 else None
        )
        start = time.perf_counter()
        try:
            timed().numpy()
            tolerance = (
                dict(rtol=FP16_RTOL, atol=FP16_ATOL)
                if name == FP16
                else dict(rtol=allreduce.RTOL, atol=allreduce.ATOL)
            )
            for output, want in zip(full(), expected):
                for local in strategy.experimental_local_results(output):
                    np.testing.assert_allclose(local.numpy(), want, **tolerance)
        except Exception as error:  # pylint: disable=broad-except
            # A failure on one worker leaves the others waiting in a
            # collective: stop the cluster rather than time the rest.
            print(f"  {name}: FAILED: {type(error).__name__}: {error}"[:400])
            raise
        say(
            f"  {name}: traced, ran and checked in "
            f"{time.perf_counter() - start:.1f} s (every local replica's "
            "outputs match numpy)"
        )
        timed_fns[name] = timed
    del expected
    sync = sync_fn(strategy)
    sync().numpy()

    wire = {
        name: bytes_per_call(timed, sync, FLAGS.byte_calls)
        for name, timed in timed_fns.items()
    }
    seconds = allreduce.time_rounds(timed_fns, FLAGS.repeats)
    if not is_chief:
        return
    ring_share = 2 * (num_replicas - 1) / num_replicas
    print(
        f"\n-- {set_name}, keras_path across workers --\n"
        f"  {'candidate':<16}{'median ms':>10}{'min ms':>9}{'mwms/this':>11}"
        f"{'MiB on wire/call':>18}{'ring payload MiB':>18}"
    )
    for name, times in seconds.items():
        wire_bytes = 2 if name == FP16 else 4
        ring = FLAGS.num_workers * ring_share * num_params * wire_bytes
        print(
            f"  {name:<16}{1e3 * np.median(times):>10.1f}{1e3 * times.min():>9.1f}"
            f"{allreduce._fmt(allreduce._ratio(seconds[MWMS], times)):>11}"
            f"{wire[name] / 2**20:>18.1f}{ring / 2**20:>18.1f}"
        )
    verdicts.add(
        1,
        allreduce._ratio(seconds[MWMS], seconds["ours"]),
        lambda r: r >= MIN_SPEEDUP_VS_MWMS,
        f"{set_name}: ours is {{value}} as fast as {MWMS} "
        f"(target >= {MIN_SPEEDUP_VS_MWMS}x).",
    )
    ratio = wire[FP16] / wire["ours"]
    verdicts.add(
        2,
        ratio,
        lambda r: r <= MAX_FP16_BYTES_RATIO,
        f"{set_name}: {FP16} puts {{value}} the bytes of ours on the wire "
        f"(target <= {MAX_FP16_BYTES_RATIO}x).",
    )


def worker_main():
    tf.get_logger().setLevel("ERROR")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    is_chief = int(strategy.cluster_resolver.task_id) == 0
    candidates = {
        MWMS: _compat.cross_device_ops(strategy.extended),
        "ours": our_ops(strategy),
        FP16: our_ops(strategy, compression="fp16"),
    }
    if is_chief:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
            f"; {os.cpu_count()} CPUs; load average {load}; TensorFlow "
            f"{tf.__version__}; Keras {keras.__version__}\n"
            f"{FLAGS.num_workers} workers, one CPU replica each; {MWMS}: {allreduce.describe_stock(strategy)}; "
            f"{FLAGS.repeats} rounds; bytes over {FLAGS.byte_calls} calls"
        )
    verdicts = allreduce.Verdicts()
    for set_name in FLAGS.sets:
        run_set(set_name, strategy, candidates, verdicts, is_chief)
        gc.collect()
    if is_chief:
        verdicts.print()


def main(argv):
    for set_name in FLAGS.sets:
        if set_name not in allreduce.SETS:
            raise app.UsageError(
                f"Unknown set {set_name!r}; allowed: {', '.join(allreduce.SETS)}."
            )
    if FLAGS.num_workers < 2:
        raise app.UsageError(f"--num_workers must be >= 2; received {FLAGS.num_workers}.")
    if "TF_CONFIG" in os.environ:
        json.loads(os.environ["TF_CONFIG"])  # a clear error if it is not JSON
        worker_main()
        return
    del argv  # absl has taken the flags out: the workers get them all
    sys.exit(launch.run_workers([sys.executable, *sys.argv], FLAGS.num_workers))


if __name__ == "__main__":
    app.run(main)
