"""When a training step's kernels and collectives ran, read from what
TensorFlow's profiler recorded, and drawn as a timeline.

A `fit` step runs as one call of Keras's train function; the profile holds
that call on the calling thread, every kernel on the executor's threads
(`tf_Compute`), and every collective from its launch to its end on the
collective executor's threads. `overlap.py --profile` uses it to show
where the executor holds a pack back:

    with step_profile.recording(logdir):
        model.fit(...)
    steps = step_profile.read_steps(logdir)
    print("\n".join(step_profile.describe(steps[-1])))
"""

import collections
import contextlib
import glob
import os

import tensorflow as tf

from tf_agn import _compat

# Keras's train function, as the profile names its call.
TRAIN_FUNCTION = "multi_step_on_iterator"
EXECUTOR_THREADS = "tf_Compute"
COLLECTIVE_THREADS = "collective_ops"
COLLECTIVE_KERNELS = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2",
                      "CollectiveBcastRecvV2", "CollectiveAllToAllV2")
# A kernel of the backward pass: what the gradient tape recorded.
BACKWARD = "gradient_tape"

# Times are milliseconds from the start of the step.
Interval = collections.namedtuple("Interval", ["start", "stop", "name"])
Step = collections.namedtuple("Step", ["duration", "threads", "collectives"])
Step.__doc__ = """One step: its `duration`, the kernels each executor
thread ran (`threads`, a list of lists of `Interval`), and its
`collectives` (`Interval`s from launch to end, in launch order)."""


@contextlib.contextmanager
def recording(logdir):
    """Profiles the block into `logdir`."""
    tf.profiler.experimental.start(logdir)
    try:
        yield
    finally:
        tf.profiler.experimental.stop()


def _events(plane):
    """`(thread name, start ns, stop ns, event name)` of every event on
    `plane`."""
    names = plane.event_metadata
    for line in plane.lines:
        for event in line.events:
            start = line.timestamp_ns + event.offset_ps / 1e3
            yield line.name, start, start + event.duration_ps / 1e3, names[event.metadata_id].name


def read_steps(logdir):
    """The `Step`s of every train-function call in the newest profile under
    `logdir`, in order.

    Raises:
        FileNotFoundError: if `logdir` holds no profile.
    """
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"No profile (*.xplane.pb) under {logdir}.")
    (host,) = [p for p in _compat.read_xspace(paths[-1]).planes if p.name == "/host:CPU"]
    events = list(_events(host))
    calls = sorted((start, stop) for _, start, stop, name in events if name == TRAIN_FUNCTION)
    return [_step(events, start, stop) for start, stop in calls]


def _step(events, start, stop):
    threads = collections.defaultdict(list)
    collectives = []

    def interval(begin, end, name):
        return Interval((begin - start) / 1e6, (end - start) / 1e6, name)

    for thread, begin, end, name in events:
        # A kernel's event is "op name:op type"; the runtime's own are "A::B".
        if not start <= begin < stop or ":" not in name or "::" in name or " " in name:
            continue
        kind = name.rsplit(":", 1)[1]
        if thread.startswith(EXECUTOR_THREADS):
            threads[thread].append(interval(begin, end, name))
        elif thread.startswith(COLLECTIVE_THREADS) and kind in COLLECTIVE_KERNELS:
            collectives.append(interval(begin, end, name))
    return Step(
        (stop - start) / 1e6,
        [sorted(kernels) for _, kernels in sorted(threads.items())],
        sorted(collectives),
    )


def idle_gaps(step, min_ms=1.0):
    """Where no collective of `step` ran for at least `min_ms` between two
    of them: `(collective, gap, kernels)` for each collective launched that
    long after the one before it ended (the earliest it could launch: they
    keep one order), with the executor's `kernels` that ran meanwhile."""
    gaps = []
    for before, collective in zip(step.collectives, step.collectives[1:]):
        gap = collective.start - before.stop
        if gap >= min_ms:
            ran = [k for kernels in step.threads for k in kernels
                   if k.start < collective.start and k.stop > before.stop]
            gaps.append((collective, gap, ran))
    return gaps


def describe(step):
    """Lines that say when `step`'s backward pass ran, when each collective
    did, and what the executor ran while none did."""
    backward = [k for kernels in step.threads for k in kernels if BACKWARD in k.name]
    lines = [
        f"step {step.duration:.1f} ms; backward pass from {min(k.start for k in backward):.1f} "
        f"to {max(k.stop for k in backward):.1f} ms; {len(step.threads)} executor thread(s)"
        if backward else f"step {step.duration:.1f} ms; no backward pass"
    ]
    for number, collective in enumerate(step.collectives):
        lines.append(f"  collective {number}: {collective.start:7.1f} to {collective.stop:7.1f} ms")
    for collective, gap, ran in idle_gaps(step):
        longest = max(ran, key=lambda k: k.stop - k.start, default=None)
        lines.append(
            f"  before collective {step.collectives.index(collective)}, none ran for {gap:.1f} ms; "
            f"the executor ran {len(ran)} kernel(s)"
            + (f", the longest {longest.name} ({longest.stop - longest.start:.1f} ms)"
               if longest else "")
        )
    return lines


def plot(steps, titles, path):
    """Draws `steps` one above another (titled `titles`) into `path`: each
    executor thread's kernels (backward pass dark) and the collectives."""
    import matplotlib  # noqa: PLC0415  (optional: only for the figure)

    matplotlib.use("Agg")
    from matplotlib import pyplot  # noqa: PLC0415

    figure, axes = pyplot.subplots(len(steps), 1, figsize=(10, 1.2 + 1.1 * len(steps)),
                                   sharex=True, squeeze=False)
    for axis, step, title in zip(axes[:, 0], steps, titles):
        rows = [*step.threads, step.collectives]
        for row, intervals in enumerate(rows):
            is_link = row == len(rows) - 1
            colors = [
                "tab:orange" if is_link else "tab:blue" if BACKWARD in k.name else "silver"
                for k in intervals
            ]
            axis.broken_barh([(k.start, k.stop - k.start) for k in intervals], (row - 0.4, 0.8),
                             facecolors=colors, edgecolor="black", linewidth=0.3)
        axis.set_yticks(range(len(rows)),
                        [f"executor {i}" for i in range(len(step.threads))] + ["collectives"])
        axis.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's start (blue: backward pass)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
