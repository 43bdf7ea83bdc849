"""One worker of tests/test_worker_agreement.py: creates
`tf_agn.strategies.multi_worker_mirrored` with the settings it is given,
reduces once, and then exits or waits to be signalled.

Usage: python settings_worker.py BYTES_PER_PACK CONNECT_TIMEOUT_S exit|wait

It prints "creating" before the strategy, "reduced <sum>" after one
`strategy.reduce`, and on an error from the strategy its type and message
("error <Type>: <message>"), then exits with 1. It is not a test module:
it must not import conftest, which splits the CPU.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402


def main(bytes_per_pack, connect_timeout, then):
    print("creating", flush=True)
    try:
        strategy = tf_agn.strategies.multi_worker_mirrored(
            bytes_per_pack=int(bytes_per_pack),
            connect_timeout_seconds=float(connect_timeout),
        )
    except (ValueError, TimeoutError) as error:
        print(f"error {type(error).__name__}: {error}", flush=True)
        sys.stdout.flush()
        os._exit(1)  # Skip TensorFlow's cluster shutdown.
    ones = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group + 1))
    )
    print(f"reduced {float(strategy.reduce('SUM', ones, axis=None))}", flush=True)
    if then == "wait":
        time.sleep(600)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
