"""`define_flags` and `strategy_from_flags`: the command-line flags that
tf_agn's examples share, and the strategy they describe."""

from absl import flags
import tensorflow as tf

from tf_agn import compression
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.strategies import tf_config
from tf_agn.strategies.mirrored import mirrored
from tf_agn.strategies.mirrored import split_cpu
from tf_agn.strategies.multi_worker import multi_worker_mirrored

# The flags belong to the module that calls `define_flags`, so that its
# `--help` lists them (absl's `--help` shows the main module's flags only).
flags.disclaim_key_flags()


COMPRESSIONS = ["none", "fp16", "bf16", "int8", "int4", "powersgd"]


def define_flags(flag_values=flags.FLAGS):
    """Defines `--aggregation`, `--compression`, `--powersgd_rank`,
    `--num_replicas` and `--cpu_replicas`.

    Safe to call more than once (from an example and a module it imports):
    a flag already defined stays as it is. Each calling module lists the
    flags in its `--help`.

    Args:
        flag_values: the `absl.flags.FlagValues` to define them in.

    Example, run as `python my_example.py --aggregation=sum
    --cpu_replicas=4` to train on 4 logical CPU devices whose gradients are
    summed:

    ```python
    from absl import app
    import tf_agn

    tf_agn.strategies.define_flags()


    def main(argv):
        strategy = tf_agn.strategies.strategy_from_flags()
        with strategy.scope():
            ...


    if __name__ == "__main__":
        app.run(main)
    ```
    """
    _define(
        flags.DEFINE_enum,
        "aggregation",
        "mean",
        AggregationMethod.names(),
        "How replicas combine their gradients (see tf_agn.AggregationMethod).",
        flag_values=flag_values,
    )
    _define(
        flags.DEFINE_enum,
        "compression",
        "none",
        COMPRESSIONS,
        "How tf_agn's optimizers send gradients (see tf_agn.compression); "
        "int8, int4 and powersgd keep error feedback.",
        flag_values=flag_values,
    )
    _define(
        flags.DEFINE_integer,
        "powersgd_rank",
        4,
        "The rank of --compression=powersgd.",
        lower_bound=1,
        flag_values=flag_values,
    )
    _define(
        flags.DEFINE_integer,
        "num_replicas",
        0,
        "How many devices to train on; 0 = all available.",
        lower_bound=0,
        flag_values=flag_values,
    )
    _define(
        flags.DEFINE_integer,
        "cpu_replicas",
        4,
        "Without a GPU, split the CPU into this many logical devices, so "
        "there are replicas whose gradients to combine; 0 = do not split.",
        lower_bound=0,
        flag_values=flag_values,
    )


def _define(define, name, *args, flag_values, **kwargs):
    """Defines flag `name` unless it exists, and makes it a key flag."""
    # absl refuses to define a flag twice, which would break any two
    # modules that both call `define_flags`.
    if name not in flag_values:
        define(name, *args, flag_values=flag_values, **kwargs)
    flags.declare_key_flag(name, flag_values=flag_values)


def strategy_from_flags(flag_values=flags.FLAGS):
    """Returns the strategy that the flags of `define_flags` ask for.

    In a worker of a multi-worker cluster (a `TF_CONFIG` whose task is a
    "worker" or "chief" of a cluster without "ps", as
    `python -m tf_agn.strategies.launch --multi_worker N` sets it), that is
    `multi_worker_mirrored`, on every GPU of the worker or its one CPU.
    Otherwise it is `mirrored`, on every GPU or, without one, on the CPU
    split into `--cpu_replicas` logical devices (one device if 0);
    `--num_replicas` > 0 keeps the first that many. Either way gradients
    are combined by `--aggregation` and travel as `--compression` says (the
    defaults of every tf_agn optimizer under the strategy).

    Call it before anything else runs TensorFlow (building a model,
    creating a tensor), so that the CPU can still be split. See
    `define_flags` for an example.

    Args:
        flag_values: the parsed `absl.flags.FlagValues` holding the flags.

    Returns:
        A `tf.distribute.MirroredStrategy` (or its multi-worker kind).

    Raises:
        ValueError: if `--num_replicas` exceeds the number of devices, or
            `TF_CONFIG` is not valid JSON or names a task outside its
            cluster.
        RuntimeError: if the CPU must be split but TensorFlow already runs
            with a different number of CPU devices.
    """
    settings = {
        "aggregation": flag_values.aggregation,
        "compression": compression_from_flags(flag_values),
    }
    if _is_multi_worker_task(tf_config.load()):
        # Each worker replicates on its GPUs, or its one CPU.
        return multi_worker_mirrored(**settings)
    if tf.config.list_physical_devices("GPU"):
        kind = "GPU"
    else:
        kind = "CPU"
        if flag_values.cpu_replicas > 0:
            split_cpu(flag_values.cpu_replicas)
    devices = [device.name for device in tf.config.list_logical_devices(kind)]
    num_replicas = flag_values.num_replicas or len(devices)
    if num_replicas > len(devices):
        hint = " Raise --cpu_replicas to split the CPU further."
        raise ValueError(
            f"--num_replicas={num_replicas} asks for more replicas than the "
            f"{len(devices)} {kind} device(s) there are: "
            f"{', '.join(devices)}.{hint if kind == 'CPU' else ''}"
        )
    return mirrored(devices[:num_replicas], **settings)


def compression_from_flags(flag_values=flags.FLAGS):
    """The compressor `--compression` and `--powersgd_rank` name, or None."""
    name = flag_values.compression
    if name == "none":
        return None
    if name == "powersgd":
        return compression.PowerSGD(rank=flag_values.powersgd_rank)
    return compression.get(name)


def _is_multi_worker_task(config):
    """Whether `TF_CONFIG` (parsed, or None) makes this process a worker of
    a multi-worker cluster, not a parameter-server one."""
    if config is None:
        return False
    cluster = config.get("cluster", {})
    task_type = config.get("task", {}).get("type")
    workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    return "ps" not in cluster and task_type in ("worker", "chief") and workers > 1
