"""A gradient's road, from a tf_agn optimizer's `apply` to the op that
carries it between replicas, crosses at most `MAX_MODULES` tf_agn modules
and enters none twice, on every transport, with every compressor, with
accumulation, with sharded state and in a windowed optimizer's commit.

The stack is captured where the op is created: a collective op of the
collective transport, or the compiled sum, stack or concatenation that
moves a pack on the local transport. `MirroredStrategy` creates it on
the main thread, inside a `merge_call`, so the stacks of the replica
threads waiting in a `merge_call` (one per nesting: a windowed
optimizer's commit nests one in another) are joined to it. The road
starts at the outermost optimizer's `apply` on the joined stack, Keras's
or tf_agn's.
"""

import inspect
import itertools
import os
import threading
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from tf_agn.collectives import packing
from tf_agn.transports import local

# The widest roads: a cast (aggregating, step, routing, compression.cast,
# packing, the transport) and DistributedOptimizer (distributed_optimizer,
# aggregating, step, routing, compression.int8, the transport).
MAX_MODULES = 6
PACKAGES = {
    os.path.join(os.path.dirname(os.path.abspath(package.__file__)), ""): package.__name__
    for package in (tf_agn, tf_agn.strategies)
}
OPTIMIZERS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(package.__file__)), "")
    for package in (tf_agn.optimizers, inspect.getmodule(keras.optimizers.SGD))
)
COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2")


def module_of(filename):
    """The dotted name of the tf_agn module `filename` holds, or None."""
    prefixes = [prefix for prefix in PACKAGES if filename.startswith(prefix)]
    if not prefixes:
        return None
    prefix = max(prefixes, key=len)
    path = os.path.splitext(filename[len(prefix):])[0]
    return ".".join([PACKAGES[prefix], *path.split(os.sep)])


class Road:
    """Records, for each op that carries values between replicas from an
    optimizer's `apply`, the tf_agn modules its stack enters, in order.

    Frames of other packages are left out, then consecutive frames of one
    module are one entry: a call back through Keras (`super()`) or across a
    `merge_call` stays in its module.
    """

    def __init__(self):
        self.waiting = {}  # {thread id: its stack in `merge_call`}
        self.roads = []

    def merge_call(self, original):
        def merge_call(context, merge_fn, args=(), kwargs=None):
            ident = threading.get_ident()
            self.waiting[ident] = traceback.extract_stack()
            try:
                return original(context, merge_fn, args, kwargs)
            finally:
                del self.waiting[ident]

        return merge_call

    def recording(self, op):
        def recorded(*args, **kwargs):
            self.record()
            return op(*args, **kwargs)

        return recorded

    def record(self):
        # Replicas of one `merge_call` wait with the same stack; an outer
        # `merge_call`'s replicas wait with a shorter one.
        waiting = {
            tuple((f.filename, f.lineno, f.name) for f in stack)
            for ident, stack in list(self.waiting.items())
            if ident != threading.get_ident()
        }
        here = tuple((f.filename, f.lineno, f.name) for f in traceback.extract_stack())
        stacks = sorted(waiting, key=len) + [here]
        frames = [frame for stack in stacks for frame in stack]
        starts = [
            i for i, (filename, _, function) in enumerate(frames)
            if function == "apply" and filename.startswith(OPTIMIZERS)
        ]
        if starts:
            modules = [module_of(filename) for filename, _, _ in frames[starts[0]:]]
            ours = [module for module in modules if module is not None]
            self.roads.append([module for module, _ in itertools.groupby(ours)])


class RecordingTF:
    """`tf` for `tf_agn.transports.local`, recording where it stacks and
    concatenates (its all-to-all and all-gather)."""

    def __init__(self, road):
        self._road = road

    def __getattr__(self, name):
        if name in ("stack", "concat"):
            return self._road.recording(getattr(tf, name))
        return getattr(tf, name)


@pytest.fixture
def road(monkeypatch):
    recorder = Road()
    monkeypatch.setattr(
        tf.distribute.ReplicaContext, "merge_call",
        recorder.merge_call(tf.distribute.ReplicaContext.merge_call),
    )
    for name in COLLECTIVES:
        monkeypatch.setattr(tf.raw_ops, name, recorder.recording(getattr(tf.raw_ops, name)))
    weighted_sum_fn = packing.weighted_sum_fn
    monkeypatch.setattr(
        packing, "weighted_sum_fn", lambda jit: recorder.recording(weighted_sum_fn(jit))
    )
    monkeypatch.setattr(local, "tf", RecordingTF(recorder))
    return recorder


CONFIGURATIONS = {
    "sgd": lambda: tf_agn.optimizers.SGD(0.1),
    "adam_fp16": lambda: tf_agn.optimizers.Adam(compression="fp16"),
    "sgd_int8": lambda: tf_agn.optimizers.SGD(0.1, compression="int8"),
    "sgd_powersgd": lambda: tf_agn.optimizers.SGD(
        0.1, compression=tf_agn.compression.PowerSGD(rank=1)
    ),
    "sgd_int8_accumulation": lambda: tf_agn.optimizers.SGD(
        0.1, compression="int8", gradient_accumulation_steps=2
    ),
    "distributed_lion": lambda: tf_agn.optimizers.DistributedOptimizer(
        keras.optimizers.Lion(1e-3), compression="int8"
    ),
    "adam_sharded": lambda: tf_agn.optimizers.Adam(shard_optimizer_state=True),
    "sgd_int8_sharded_accumulation": lambda: tf_agn.optimizers.SGD(
        0.1, compression=tf_agn.compression.Int8(start_step=1), shard_optimizer_state=True,
        gradient_accumulation_steps=2,
    ),
    "agn_int8": lambda: tf_agn.optimizers.AGN(
        keras.optimizers.SGD(0.1), local_steps=1, compression="int8"
    ),
    "agn_powersgd": lambda: tf_agn.optimizers.AGN(
        keras.optimizers.SGD(0.1), local_steps=1,
        compression=tf_agn.compression.PowerSGD(rank=1),
    ),
}


@pytest.mark.parametrize("transport", ["local", "collective"])
@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_a_gradients_road_is_short(road, name, transport):
    strategy = tf_agn.strategies.mirrored(DEVICES, transport=transport)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(16), keras.layers.Dense(4)]
        )
        model.compile(CONFIGURATIONS[name](), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 32)).astype("float32")
    model.fit(x, x[:, :4], batch_size=16, epochs=1, verbose=0)
    assert road.roads, "no op carried a gradient from an optimizer's apply"
    widest = max(road.roads, key=lambda entries: len(set(entries)))
    assert len(set(widest)) <= MAX_MODULES, " -> ".join(widest)
    reentered = [" -> ".join(entries) for entries in road.roads if len(set(entries)) < len(entries)]
    assert not reentered, reentered
