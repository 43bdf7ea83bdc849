"""`AggregatingAllReduce`: packed, XLA-compiled cross-device reduction."""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as tf_values

from tf_agn import packing
from tf_agn.aggregation import AggregationMethod


class AggregatingAllReduce(tf.distribute.CrossDeviceOps):
    """Cross-device ops that pack tensors and reduce them in XLA.

    Use it as `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or
    build the strategy with `tf_agn.strategies.mirrored(...)`.

    There are two ways in:

    - TensorFlow's own (`reduce`, `batch_reduce`, `broadcast`, gather), used
      by Keras, metrics and `strategy.reduce`. These always do exactly the
      `tf.distribute.ReduceOp` (SUM or MEAN) the caller asks for.
    - `aggregate(method, values)`, used by tf_agn's optimizers. It also does
      the two methods TensorFlow has no ReduceOp for: ONLY_FIRST_REPLICA
      packs replica 0's tensors and broadcasts that buffer, and NONE
      communicates nothing. `aggregation` is the default method optimizers
      use when they are given none.

    How a batch is reduced: dense tensors are grouped per dtype into packs
    of at most `bytes_per_pack` bytes. Every pack is summed and scaled by one
    `tf.function(jit_compile=True)` call on the reduce device, and the result
    is broadcast to the destinations. Where devices have memory of their own
    (GPUs), each replica first concatenates its part of the pack into one
    flat buffer, so that a pack crosses devices as one transfer; logical CPU
    devices share host memory and are read in place (`flatten_packs="auto"`;
    True or False forces either way). float16 and
    bfloat16 values are summed in float32. With `compression`, float32 and
    float64 tensors are cast to float16 or bfloat16 on their own device
    before they travel, and summed in full precision after.

    Fallback: on a device type XLA cannot compile for (anything but CPU, GPU
    and TPU), or with `jit_compile=False`, the same function runs as an
    ordinary graph function.

    Sparse gradients (`tf.IndexedSlices`, from embeddings) are gathered, not
    densified: the result holds every replica's rows and indices, scaled,
    and repeated indices add up when the optimizer applies them. This keeps
    the cost proportional to the rows touched rather than the table size.

    Integer values (metric counters) can be summed; their MEAN is refused,
    since it has no integer answer.

    Args:
        aggregation: the default `AggregationMethod` (or its name) for tf_agn
            optimizers in a strategy that uses these ops.
        bytes_per_pack: the most bytes one pack may hold. The default,
            4 MiB, is explained at `packing.DEFAULT_BYTES_PER_PACK`.
        compression: None, "fp16" or "bf16".
        jit_compile: whether to compile the reduction with XLA.
        reduce_to_device: the device that reduces; by default the first
            destination device.
        flatten_packs: "auto", True or False: whether each replica's part of
            a pack is concatenated into one flat buffer before it travels.

    Raises:
        ValueError: for an unknown aggregation or compression, or a
            `bytes_per_pack` that is not a positive int.
    """

    def __init__(
        self,
        aggregation="mean",
        bytes_per_pack=packing.DEFAULT_BYTES_PER_PACK,
        compression=None,
        jit_compile=True,
        reduce_to_device=None,
        flatten_packs="auto",
    ):
        super().__init__()
        if (
            isinstance(bytes_per_pack, bool)
            or not isinstance(bytes_per_pack, int)
            or bytes_per_pack <= 0
        ):
            raise ValueError(
                "bytes_per_pack must be a positive int; received "
                f"{bytes_per_pack!r}."
            )
        if compression not in packing.COMPRESSION_DTYPES:
            raise ValueError(
                f"Unknown compression {compression!r}. Allowed: None, "
                '"fp16", "bf16".'
            )
        self.aggregation = AggregationMethod.parse(aggregation)
        self.bytes_per_pack = bytes_per_pack
        self.compression = compression
        self.jit_compile = bool(jit_compile)
        self.reduce_to_device = reduce_to_device
        if flatten_packs not in ("auto", True, False):
            raise ValueError(
                f'flatten_packs must be "auto", True or False; received '
                f"{flatten_packs!r}."
            )
        self.flatten_packs = flatten_packs

    # TensorFlow's entry points.

    def reduce_implementation(
        self, reduce_op, per_replica_value, destinations, options
    ):
        del options  # Packing and compression are configured on `self`.
        return self._aggregate(
            AggregationMethod.parse(reduce_op),
            [per_replica_value],
            [destinations],
        )[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options
        values, destinations = zip(*value_destination_pairs)
        return self._aggregate(AggregationMethod.parse(reduce_op), values, destinations)

    def broadcast_implementation(self, tensor, destinations):
        return _mirror(tensor, self._devices(destinations))

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        del options
        devices = self._devices(destinations, per_replica_value)
        with tf.device(self.reduce_to_device or devices[0]):
            gathered = tf.concat(per_replica_value.values, axis=axis)
        return _mirror(gathered, devices)

    # tf_agn's entry point.

    def aggregate(self, method, per_replica_values, value_scale=1.0):
        """Combines per-replica values with any `AggregationMethod`.

        Call it in cross-replica context, for example inside `merge_call`.

        Args:
            method: an `AggregationMethod` or its name.
            per_replica_values: a list of `tf.distribute.DistributedValues`
                (or plain tensors, for a single replica).
            value_scale: a Python float every value is multiplied by first.
                Optimizers use it to undo Keras' 1/n loss scaling inside the
                compiled reduction rather than in a separate pass.

        Returns:
            A list with one entry per value: `Mirrored` values for SUM, MEAN
            and ONLY_FIRST_REPLICA, `PerReplica` values for NONE.
        """
        values = [
            tf_cross_device_ops._make_tensor_into_per_replica(v)
            for v in per_replica_values
        ]
        return self._aggregate(
            AggregationMethod.parse(method), values, values, value_scale
        )

    def _aggregate(self, method, values, destinations, value_scale=1.0):
        if method is AggregationMethod.NONE:
            return [_scale_per_replica(v, value_scale) for v in values]
        devices = [self._devices(d, v) for d, v in zip(destinations, values)]
        results = [None] * len(values)
        dense = []
        for index, value in enumerate(values):
            if isinstance(value.values[0], tf.IndexedSlices):
                results[index] = self._gather_slices(
                    method, value, devices[index], value_scale
                )
            else:
                dense.append(index)
        # A shape not fully known while tracing counts as one element.
        sizes = [
            (
                values[i].values[0].dtype,
                values[i].values[0].shape.num_elements() or 1,
            )
            for i in dense
        ]
        for pack in packing.plan_packs(sizes, self.bytes_per_pack):
            pack = [dense[i] for i in pack]
            reduced = self._combine_pack(
                method,
                [values[i] for i in pack],
                devices[pack[0]],
                value_scale,
            )
            for index, tensor in zip(pack, reduced):
                results[index] = _mirror(tensor, devices[index])
        return results

    def _combine_pack(self, method, values, devices, value_scale):
        """Reduces one pack of same-dtype dense values on one device."""
        dtype = values[0].values[0].dtype
        num_replicas = len(values[0].values)
        scale = _method_scale(method, dtype, num_replicas, value_scale)
        if method is AggregationMethod.ONLY_FIRST_REPLICA:
            # Only replica 0's tensors travel.
            replicas = [0]
            device = values[0].values[0].device
        else:
            replicas = range(num_replicas)
            device = self.reduce_to_device or devices[0]
        like = [v.values[0] for v in values]
        flatten = self._flatten_packs(devices)
        sources = [self._send([v.values[r] for v in values], flatten) for r in replicas]
        with tf.device(device):
            reduced = packing.combine_fn(self._jit(device))(sources, scale, dtype)
            return packing.unflatten(reduced[0], like) if flatten else reduced

    def _send(self, tensors, flatten):
        """Prepares one replica's part of a pack for the trip: compressed
        and, where transfers are real copies, flattened into one buffer."""
        dtype = tensors[0].dtype
        target = packing.COMPRESSION_DTYPES[self.compression]
        if target is not None and dtype in (tf.float32, tf.float64):
            dtype = target
        if not flatten:
            if dtype == tensors[0].dtype:
                return tensors
            with tf.device(tensors[0].device):
                return [tf.cast(t, dtype) for t in tensors]
        device = tensors[0].device
        with tf.device(device):
            return [packing.flatten_fn(self._jit(device))(tensors, dtype)]

    def _flatten_packs(self, devices):
        if self.flatten_packs == "auto":
            return any(
                tf.DeviceSpec.from_string(d).device_type != "CPU" for d in devices
            )
        return self.flatten_packs

    def _jit(self, device):
        return self.jit_compile and packing.supports_xla(device)

    def _gather_slices(self, method, value, devices, value_scale):
        slices = value.values
        if method is AggregationMethod.ONLY_FIRST_REPLICA:
            slices = slices[:1]
        scale = _method_scale(method, slices[0].dtype, len(value.values), value_scale)
        with tf.device(self.reduce_to_device or devices[0]):
            gathered = tf.IndexedSlices(
                tf.concat([s.values for s in slices], 0)
                * tf.constant(scale, slices[0].dtype),
                tf.concat([s.indices for s in slices], 0),
                slices[0].dense_shape,
            )
        return _mirror(gathered, devices)

    def _devices(self, destinations, value=None):
        if tf_cross_device_ops.check_destinations(destinations):
            source = destinations
        else:
            source = value
        return tf_cross_device_ops.get_devices_from(source, self._canonicalize_devices)


def _method_scale(method, dtype, num_replicas, value_scale):
    """The factor applied to the sum (or to replica 0's value)."""
    if dtype.is_integer:
        if method is AggregationMethod.MEAN or value_scale != 1:
            raise ValueError(
                f"Cannot {method.name} {dtype.name} values with scale "
                f"{value_scale}: integers can only be summed or taken from "
                "the first replica, unscaled."
            )
        return 1
    if method is AggregationMethod.MEAN:
        return value_scale / num_replicas
    return value_scale


def _scale_per_replica(value, scale):
    if scale == 1:
        return value
    scaled = []
    for local in value.values:
        with tf.device(local.device):
            scaled.append(scale_value(local, scale))
    return distribute_utils.regroup(tuple(scaled))


def scale_value(value, scale):
    """Multiplies a tensor or `tf.IndexedSlices` by a Python number."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(
            value.values * tf.cast(scale, value.dtype),
            value.indices,
            value.dense_shape,
        )
    return value * tf.cast(scale, value.dtype)


def _mirror(value, devices):
    """Places a copy of `value` on every device, as a `Mirrored` value.

    Between devices in host memory (logical CPUs) the identity shares the
    buffer, so nothing is copied; between GPUs it is the transfer.
    """
    copies = []
    for device in devices:
        with tf.device(device):
            copies.append(
                tf.nest.map_structure(tf.identity, value, expand_composites=True)
            )
    return distribute_utils.regroup(tuple(copies), wrap_class=tf_values.Mirrored)
