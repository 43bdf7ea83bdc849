"""A worker of tests/test_any_strategy.py's cluster, or its stock
`MirroredStrategy` alone.

Usage: python any_strategy_worker.py OUT_DIR (with TF_CONFIG set)
       python any_strategy_worker.py --stock_mirrored OUT_DIR

Under `tf_agn.strategies.KerasMultiWorkerMirroredStrategy`, whose
cross-device ops are TensorFlow's own collectives, it trains the
compressed-training tests' model with `tf_agn.optimizers.SGD` and each of
`CONFIGURATIONS` (int8 with gradient accumulation among them), each
worker's one replica fed its slice of every global batch, and writes each
weight change and `communication_stats` to OUT_DIR/worker<i>.npz.

With `--stock_mirrored` it trains the same under a stock
`MirroredStrategy` with its default cross-device ops on 4 logical CPUs, in
a process of its own: TensorFlow's collectives there start their group and
instance keys afresh in every strategy, so a float16 collective of this
strategy meets, under the same keys, the float32 one of any stock strategy
the process made before, and TensorFlow aborts both.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from compression_model import build  # noqa: E402
from compression_model import data  # noqa: E402
from multi_worker_data import distributed_dataset  # noqa: E402
from worker_cluster import wait_for_files  # noqa: E402
from worker_cluster import write_results  # noqa: E402

STOCK_MIRRORED = sys.argv[1:2] == ["--stock_mirrored"]
# The strategy must exist before any other TensorFlow op runs.
if STOCK_MIRRORED:
    STRATEGY = tf.distribute.MirroredStrategy(tf_agn.strategies.split_cpu(4))
else:
    STRATEGY = tf_agn.strategies.KerasMultiWorkerMirroredStrategy()

STEPS = 10
GLOBAL_BATCH = 64
LEARNING_RATE = 0.1
# (name, compression, gradient_accumulation_steps)
CONFIGURATIONS = (
    ("none", None, None),
    ("fp16", "fp16", None),
    ("bf16", "bf16", None),
    ("int8", "int8", None),
    ("powersgd", "powersgd", None),
    ("int8_k2", "int8", 2),
)


def compressor(name):
    if name == "powersgd":
        return tf_agn.compression.PowerSGD(rank=2)
    return name


def optimizer(compression, accumulation):
    return tf_agn.optimizers.SGD(
        LEARNING_RATE, compression=compressor(compression),
        gradient_accumulation_steps=accumulation,
    )


def main(out_dir):
    x, y = data(rows=STEPS * GLOBAL_BATCH)
    if STOCK_MIRRORED:
        task_index = 0
        # Keras splits each global batch over the replicas.
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    else:
        task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        dataset = distributed_dataset(STRATEGY, x, y, GLOBAL_BATCH)
    results = {}
    for name, compression, accumulation in CONFIGURATIONS:
        model = build(STRATEGY, lambda: optimizer(compression, accumulation))
        before = [np.array(w) for w in model.get_weights()]
        model.fit(dataset, epochs=1, verbose=0)
        for i, (after, start) in enumerate(zip(model.get_weights(), before)):
            results[f"{name}/{i}"] = after - start
        for key, value in model.optimizer.communication_stats().items():
            results[f"{name}/{key}"] = np.array(value)
        print(f"trained {name}", flush=True)
    write_results(out_dir, task_index, results)
    if STOCK_MIRRORED:
        return
    num_workers = STRATEGY.num_replicas_in_sync  # one replica each
    wait_for_files([os.path.join(out_dir, f"worker{i}.npz") for i in range(num_workers)])


if __name__ == "__main__":
    if len(sys.argv) != 2 + STOCK_MIRRORED:
        sys.exit(__doc__)
    keras.utils.set_random_seed(0)
    main(sys.argv[-1])
    sys.stdout.flush()
    os._exit(0)  # Skip TensorFlow's slow cluster shutdown; results are on disk.
