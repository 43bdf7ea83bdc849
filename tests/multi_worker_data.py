"""The per-replica values the multi-worker tests aggregate: built by each
worker (multi_worker_worker.py) and again by the test for its reference."""

import numpy as np
import tensorflow as tf

DTYPES = ["float16", "bfloat16", "float32"]
SHAPES = [(3, 5), (7,), (11,)]


def replica_arrays(replica, dtype_name):
    """Global replica `replica`'s arrays, rounded to `dtype_name`."""
    rng = np.random.default_rng(len(SHAPES))
    bases = [rng.uniform(0.5, 1.5, size=s) for s in SHAPES]
    dtype = getattr(tf, dtype_name)
    return [tf.cast(b * (replica + 1) + replica, dtype).numpy() for b in bases]


def replica_slices(replica):
    """Global replica `replica`'s rows and indices into a (6, 4) table."""
    rng = np.random.default_rng(100 + replica)
    rows = rng.uniform(size=(replica + 1, 4)).astype(np.float32)
    return rows, rng.integers(0, 6, size=replica + 1)


def large_values(replica):
    """Global replica `replica`'s float32 values that float16 and bfloat16
    cannot hold: past 65504, integers past 2048 (float16's last exact
    one), and 1001 (bfloat16 rounds it to 1000). Sums over a few replicas
    are integers below 2**24, exact in float32."""
    base = np.array([70001.0, 1001.0, 2049.0, 123457.0])
    return (base * (replica + 1) + replica).astype(np.float32)


# The endings of the names of compression state variables: int8's
# residual; PowerSGD's Q and the factors of its residual.
COMPRESSION_STATE = ("_residual", "_powersgd_q", "_powersgd_m", "_powersgd_p", "_powersgd_local_q")


def stateful_compressors():
    """The compressors the workers train with, by name, each new: int8 in
    chunks small enough for the test MLP, PowerSGD on its 3x4 and 4x2
    kernels."""
    from tf_agn import compression

    return {
        "int8": compression.Int8(chunk_size=4),
        "powersgd": compression.PowerSGD(rank=1, min_compression_rate=1),
    }


def shard_indices(num_rows, batch_size, num_pipelines, pipeline_id):
    """Row indices, step by step, of `pipeline_id`'s slice of each global
    batch: consecutive slices, as MirroredStrategy splits a batch."""
    if batch_size % num_pipelines or num_rows % batch_size:
        raise ValueError(
            f"{num_rows} rows do not split into global batches of "
            f"{batch_size} over {num_pipelines} pipelines."
        )
    per_replica = batch_size // num_pipelines
    starts = np.arange(0, num_rows, batch_size) + pipeline_id * per_replica
    return starts[:, None] + np.arange(per_replica)[None, :]


def distributed_dataset(strategy, x, y, batch_size):
    def dataset_fn(context):
        if context.num_input_pipelines != strategy.num_replicas_in_sync:
            raise RuntimeError(
                f"{context.num_input_pipelines} input pipelines for "
                f"{strategy.num_replicas_in_sync} replicas: each pipeline "
                "must feed exactly one replica."
            )
        per_replica = context.get_per_replica_batch_size(batch_size)
        rows = shard_indices(
            len(x), batch_size, context.num_input_pipelines,
            context.input_pipeline_id,
        ).reshape(-1)
        dataset = tf.data.Dataset.from_tensor_slices((x[rows], y[rows]))
        return dataset.batch(per_replica, drop_remainder=True)

    return strategy.distribute_datasets_from_function(dataset_fn)
