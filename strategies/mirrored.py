"""`mirrored`: a `MirroredStrategy` that aggregates with tf_agn's ops, and
helpers for replicas on one machine (`split_cpu`, `even_batch_size`)."""

import numbers

import tensorflow as tf

from tf_agn.collectives.cross_device_ops import AggregatingAllReduce
from tf_agn.utils import devices as devices_lib


def split_cpu(num_devices):
    """Splits the host CPU into `num_devices` logical devices.

    Gives `MirroredStrategy` real replicas on a machine without
    accelerators. Call it before TensorFlow initializes its devices.

    Args:
        num_devices: how many logical CPU devices to create (at least 1).

    Returns:
        The logical CPU device names.

    Raises:
        ValueError: if `num_devices` < 1.
        RuntimeError: if TensorFlow's devices are already initialized with
            a different number of logical CPUs.

    Example:

    ```python
    tf_agn.strategies.split_cpu(4)  # first thing in the program
    strategy = tf_agn.strategies.mirrored()  # 4 replicas
    ```
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1; received {num_devices!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
        )
    except RuntimeError:
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) != num_devices:
            raise RuntimeError(
                f"Cannot split the CPU into {num_devices} devices: TensorFlow "
                f"already runs with {len(existing)}. Call split_cpu before "
                "any TensorFlow operation."
            ) from None
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def mirrored(devices=None, aggregation="mean", **ops_kwargs):
    """Returns a `MirroredStrategy` that reduces with `AggregatingAllReduce`.

    Args:
        devices: the devices to replicate on; by default every GPU, or the
            CPU when there is none (as `MirroredStrategy` chooses).
        aggregation: the default `AggregationMethod` for tf_agn optimizers
            created in this strategy's scope without a method of their own.
        **ops_kwargs: further `AggregatingAllReduce` arguments
            (`bytes_per_pack`, `compression`, `jit_compile`, ...).

    Returns:
        A `tf.distribute.MirroredStrategy`.

    Raises:
        ValueError: for an unknown aggregation or a bad ops argument, or a
            device in `devices` or `reduce_to_device` that this process
            does not have.

    Example:

    ```python
    strategy = tf_agn.strategies.mirrored(aggregation="sum", compression="fp16")
    with strategy.scope():
        model = tf_agn.models.mlp((784,), 10)  # then compile it, as usual
    ```
    """
    ops = AggregatingAllReduce(aggregation=aggregation, **ops_kwargs)
    # TensorFlow places a missing device's work on the CPU without a word.
    for device in devices or ():
        devices_lib.resolve(device, "devices")
    if ops_kwargs.get("reduce_to_device") is not None:
        devices_lib.resolve(ops_kwargs["reduce_to_device"], "reduce_to_device")
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)


def even_batch_size(batch_size, num_samples, num_replicas):
    """The largest batch size up to `batch_size` whose first batch of
    `num_samples` splits evenly across `num_replicas`.

    Args:
        batch_size: the global batch size wanted.
        num_samples: how many samples the data set holds.
        num_replicas: how many replicas share each batch.

    Returns:
        The batch size to pass to `fit`, `evaluate` or `predict`.

    Raises:
        ValueError: if an argument is not an int >= 1, or there are fewer
            samples than replicas.

    Example:

    ```python
    batch_size = tf_agn.strategies.even_batch_size(
        256, len(x_test), strategy.num_replicas_in_sync)
    model.evaluate(x_test, y_test, batch_size=batch_size)
    ```
    """
    for name, value in (
        ("batch_size", batch_size),
        ("num_samples", num_samples),
        ("num_replicas", num_replicas),
    ):
        # Integral: sizes are often numpy integers.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; received {value!r}.")
    # Only the first batch must split evenly: Keras 3 builds the model from
    # the mean of the replicas' shares of it (`_maybe_symbolic_build` of its
    # TensorFlow trainer), which fails if they differ in size. Later batches
    # may split unevenly.
    first_batch = min(batch_size, num_samples)
    if first_batch < num_replicas:
        raise ValueError(
            f"{num_samples} samples cannot be split across {num_replicas} replicas."
        )
    return first_batch - first_batch % num_replicas
