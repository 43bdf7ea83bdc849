"""One worker of tests/test_worker_agreement.py: creates
`tf_agn.strategies.multi_worker_mirrored` with the settings it is given,
reduces once, and then exits, waits to be signalled, or trains.

Usage: python settings_worker.py BYTES_PER_PACK CONNECT_TIMEOUT_S THEN

THEN is "exit", "wait", or "fit:COMPRESSION" (one step of `model.fit`
with `tf_agn.optimizers.SGD(compression=...)`, COMPRESSION being a
built-in's name or "powersgd:RANK").

It prints "creating" before the strategy, "reduced <sum>" after one
`strategy.reduce`, "trained" after a fit, and on an error from tf_agn its
type and message ("error <Type>: <message>"), then exits with 1. It is not
a test module: it must not import conftest, which splits the CPU.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402


def _compressor(spec):
    name, _, rank = spec.partition(":")
    return tf_agn.compression.PowerSGD(rank=int(rank)) if name == "powersgd" else name


def _fit_one_step(strategy, compression):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(
            tf_agn.optimizers.SGD(0.1, compression=_compressor(compression)), "mse"
        )
    rows = np.ones((4, 8), "float32")
    model.fit(rows, rows[:, :4], batch_size=4, epochs=1, verbose=0)


def _fail(error):
    print(f"error {type(error).__name__}: {error}", flush=True)
    os._exit(1)  # Skip TensorFlow's cluster shutdown.


def main(bytes_per_pack, connect_timeout, then):
    print("creating", flush=True)
    try:
        strategy = tf_agn.strategies.multi_worker_mirrored(
            bytes_per_pack=int(bytes_per_pack),
            connect_timeout_seconds=float(connect_timeout),
        )
    except (ValueError, TimeoutError) as error:
        _fail(error)
    ones = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group + 1))
    )
    print(f"reduced {float(strategy.reduce('SUM', ones, axis=None))}", flush=True)
    if then == "wait":
        time.sleep(600)
    elif then.startswith("fit:"):
        try:
            _fit_one_step(strategy, then[len("fit:"):])
        except ValueError as error:
            _fail(error)
        print("trained", flush=True)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
