"""One worker of test_non_finite_multi_worker.py: the overflow scenario of
tests/overflow.py across 2 worker processes.

Each worker runs `tf_agn.strategies.multi_worker_mirrored()` from its own
`TF_CONFIG` with its single CPU, so it is exactly one replica (it must not
import conftest, which splits the CPU). Worker 1's shard of the second
batch overflows float16. For every case of overflow.MULTI_WORKER_CASES the
worker compiles the test MLP under `mixed_float16` in the strategy's scope,
fits the three batches one `fit` at a time, and records its own copy of:

    <case>/before/<i>: weight i after the first (finite) batch;
    <case>/after/<i>: weight i after the overflowing batch;
    <case>/scale, <case>/counter: the loss scale and its step counter
        after the overflowing batch;
    <case>/final/<i>, <case>/iterations: after the last batch.

Usage: python non_finite_worker.py OUT_DIR. It writes OUT_DIR/worker<i>.npz,
waits until every worker has written its own, and exits without
TensorFlow's slow cluster shutdown.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402

# The strategy must exist before any other TensorFlow op runs.
STRATEGY = tf_agn.strategies.multi_worker_mirrored()

from mlp import build_mlp  # noqa: E402
from mlp import initial_params  # noqa: E402
from overflow import BATCH  # noqa: E402
from overflow import NUM_BATCHES  # noqa: E402
from overflow import NUM_REPLICAS  # noqa: E402
from overflow import MULTI_WORKER_CASES  # noqa: E402
from overflow import OVERFLOW_BATCH  # noqa: E402
from overflow import batches  # noqa: E402
from overflow import case_key  # noqa: E402
from overflow import loss_scale_per_replica  # noqa: E402
from overflow import mixed_float16  # noqa: E402
from overflow import tf_agn_optimizer  # noqa: E402
from worker_cluster import wait_for_files  # noqa: E402
from worker_cluster import write_results  # noqa: E402

# What each of the NUM_BATCHES batches is recorded as, once fitted.
STAGES = ("before", "after", "final")
assert len(STAGES) == NUM_BATCHES and STAGES[OVERFLOW_BATCH] == "after"


def batch_dataset(x, y, index):
    """Global batch `index`, replica r (input pipeline r) getting its r-th
    consecutive shard, as MirroredStrategy splits a batch."""
    shard = BATCH // NUM_REPLICAS

    def dataset_fn(context):
        start = index * BATCH + context.input_pipeline_id * shard
        rows = slice(start, start + shard)
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(shard)

    return STRATEGY.distribute_datasets_from_function(dataset_fn)


def own_weights(model):
    (weights,) = tf_agn.replica_weights(model)  # this worker's one copy
    return weights


def run_case(name, accumulation_steps, x, y):
    key = case_key(name, accumulation_steps)
    with mixed_float16(), STRATEGY.scope():
        model = build_mlp(initial_params())
        model.compile(optimizer=tf_agn_optimizer(name, accumulation_steps), loss="mse")
    result = {}
    for index, stage in enumerate(STAGES):
        model.fit(batch_dataset(x, y, index), verbose=0)
        for i, array in enumerate(own_weights(model)):
            result[f"{key}/{stage}/{i}"] = array
        if stage == "after":
            ((scale, counter),) = loss_scale_per_replica(model)
            result[f"{key}/scale"], result[f"{key}/counter"] = scale, counter
    result[f"{key}/iterations"] = int(model.optimizer.iterations.numpy())
    print(f"{key} done", flush=True)
    return result


def main(out_dir):
    if STRATEGY.num_replicas_in_sync != NUM_REPLICAS:
        raise RuntimeError(f"{STRATEGY.num_replicas_in_sync} replicas; expected {NUM_REPLICAS}.")
    x, y = batches()
    result = {}
    for name, accumulation_steps in MULTI_WORKER_CASES:
        result.update(run_case(name, accumulation_steps, x, y))
    task_index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    write_results(out_dir, task_index, result)
    wait_for_files([os.path.join(out_dir, f"worker{i}.npz") for i in range(NUM_REPLICAS)])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
    # Results are on disk and every peer is done with this one. Shutting the
    # gRPC server and collective executor down at exit takes seconds: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
