"""`AggregatingAllReduce`: tf_agn's transports as TensorFlow cross-device ops."""

import functools

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression as compression_lib
from tf_agn import transports
from tf_agn.collectives import packing
from tf_agn.collectives import placement
# routing imports this module too: both import the other by module.
from tf_agn.collectives import routing
from tf_agn.collectives.aggregation_method import AggregationMethod

CommunicationOptions = tf.distribute.experimental.CommunicationOptions
CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation


class AggregatingAllReduce(tf.distribute.CrossDeviceOps):
    """Cross-device ops that pack tensors and reduce them in XLA.

    Use it as `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or
    through `tf_agn.strategies.mirrored` / `multi_worker_mirrored`.
    TensorFlow's own entry points (`strategy.reduce`, `replica_context.all_reduce`,
    ...) get exactly the SUM or MEAN asked for, uncompressed;
    `aggregation` and `compression` are only the defaults of tf_agn's
    optimizers. Dense tensors travel in packs, sparse ones are gathered.
    `CommunicationOptions` a caller passes override the constructor's,
    field by field.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=tf_agn.AggregatingAllReduce(aggregation="sum")
    )
    ```

    Args:
        aggregation: the default `AggregationMethod` (or its name) of tf_agn
            optimizers.
        bytes_per_pack: the most bytes one pack of one dtype may hold.
        compression: None, "fp16", "bf16", "int8" or a `tf_agn.compression`
            compressor: the default of tf_agn optimizers.
        jit_compile: whether to compile the packing and reduction with XLA.
        reduce_to_device: the device that reduces for "local"; by default
            the first replica's.
        flatten_packs: "auto", True or False, for "local": whether a
            replica's part of a pack travels as one flat buffer.
        transport: "auto", "local" (one XLA sum on one device) or
            "collective" (TensorFlow's collectives; "auto" takes it across
            workers and on GPUs).
        timeout_seconds: for "collective": how long a collective waits for
            its peers (None or 0: for ever). TensorFlow holds a thread per
            collective for the whole timeout, so keep it short.
        implementation: for "collective": a `CommunicationImplementation`
            or its name ("auto", "ring", "nccl").
        num_workers: how many processes run this program together.
        worker_index: this process's index among them.

    Raises:
        ValueError: naming a bad argument.
    """

    def __init__(
        self,
        aggregation="mean",
        bytes_per_pack=packing.DEFAULT_BYTES_PER_PACK,
        compression=None,
        jit_compile=True,
        reduce_to_device=None,
        flatten_packs="auto",
        transport="auto",
        timeout_seconds=transports.DEFAULT_TIMEOUT_SECONDS,
        implementation="auto",
        num_workers=1,
        worker_index=0,
    ):
        super().__init__()
        _check_arguments(
            bytes_per_pack, flatten_packs, transport, timeout_seconds, num_workers, worker_index
        )
        self.default_aggregation = AggregationMethod.parse(aggregation)
        self.bytes_per_pack = bytes_per_pack
        self.default_compressor = compression_lib.get(compression)
        self.jit_compile = bool(jit_compile)
        self.reduce_to_device = reduce_to_device
        self.flatten_packs = flatten_packs
        self.transport_name = transport
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.options = CommunicationOptions(
            bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds,
            implementation=_parse_implementation(implementation),
        )

    @property
    def _num_between_graph_workers(self):
        # When 1, TensorFlow returns a lone local replica's value unreduced.
        return self.num_workers

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, [per_replica_value], [destinations], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        values, destinations = zip(*value_destination_pairs)
        return self._reduce(reduce_op, values, destinations, options)

    def broadcast_implementation(self, tensor, destinations):
        return placement.mirror(tensor, placement.destination_devices(destinations, self))

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        devices = placement.destination_devices(destinations, self, per_replica_value)
        if self.num_workers == 1:
            with tf.device(self.reduce_to_device or devices[0]):
                gathered = tf.concat(per_replica_value.values, axis=axis)
            return placement.mirror(gathered, devices)
        transport = self.transport_for(per_replica_value, destinations, options)
        axis = _static_axis(axis) % per_replica_value.values[0].shape.rank
        moved = [[_axis_swapped(t, axis, d)] for t, d in zip(per_replica_value.values, transport.devices)]
        gathered, _ = self.combine_function(transport, None, pattern="all_gather_rows")(moved)
        gathered = [_axis_swapped(rows, axis, d) for (rows,), d in zip(gathered, transport.devices)]
        return self._place(gathered, transport.devices, devices)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        # Without merge_call (MultiWorkerMirroredStrategy's XLA steps on GPUs):
        # each replica launches its own part, which only collectives can.
        flat = tf.nest.flatten(value, expand_composites=False)
        devices = placement.calling_replica_devices(flat, self, replica_id)
        options, name = self._options(options, devices)
        if name != "collective":
            raise NotImplementedError('Replica-context all-reduce needs transport="collective".')
        transport = transports.CollectiveTransport(
            self._group(devices), options, self.jit_compile, replicas=(replica_id,)
        )
        (reduced,), _ = routing.combine_replicas(transport, AggregationMethod.parse(reduce_op), [flat])
        return tf.nest.pack_sequence_as(value, reduced)

    def transport_for(self, value, destinations=None, options=None):
        """The transport over the devices of `value`'s local replicas."""
        devices = placement.replica_devices(value, self, destinations)
        options, name = self._options(options, devices)
        if name == "collective":
            return transports.CollectiveTransport(self._group(devices), options, self.jit_compile)
        return transports.LocalTransport(
            devices, self.reduce_to_device, self.flatten_packs, self.jit_compile,
            options.bytes_per_pack,
        )

    def combine_function(self, transport, method, value_scale=1, compressor=None, pattern="all_reduce"):
        """`combine_replicas` on `transport` as a function of
        `(values, states=None, step=None)`, runnable eagerly."""
        combine = functools.partial(
            routing.combine_replicas, transport, method, value_scale=value_scale, compressor=compressor,
            pattern=pattern,
        )
        return transport.eager((pattern, method, value_scale, compressor), combine)

    def _reduce(self, reduce_op, values, destinations, options):
        values = [_compat.make_tensor_into_per_replica(v) for v in values]
        transport = self.transport_for(values[0], destinations[0], options)
        combine = self.combine_function(transport, AggregationMethod.parse(reduce_op))
        per_replica = [[v.values[r] for v in values] for r in range(len(transport.devices))]
        combined, _ = combine(per_replica)
        return [
            self._place(replicas, transport.devices, placement.destination_devices(destination, self, value))
            for value, destination, replicas in zip(values, destinations, zip(*combined))
        ]

    def _place(self, replicas, sources, devices):
        if tuple(devices) == tuple(sources):
            return _compat.regroup(tuple(replicas), wrap_class=_compat.Mirrored)
        return placement.mirror(replicas[0], devices)

    def _group(self, devices):
        return transports.collective_group(
            devices,
            group_size=len(devices) * self.num_workers,
            first_replica=self.worker_index * len(devices),
        )

    def _options(self, options, devices):
        """`(merged options, transport name)` for `devices`."""
        merged = self.options.merge(options)
        if merged.implementation == CommunicationImplementation.AUTO:
            merged.implementation = transports.default_implementation(devices)
        transport = self.transport_name
        if transport == "auto":
            transport = transports.choose_transport(devices, self.num_workers)
        if transport == "collective" and len(set(devices)) < len(devices):
            if self.num_workers > 1:
                raise ValueError(
                    f"Cannot tell which device each of {len(devices)} replicas' "
                    f"values belongs to (they are on {sorted(set(devices))}): "
                    "make them inside the strategy's scope or strategy.run."
                )
            # One process: "local" needs no per-replica device.
            transport = "local"
        return merged, transport


def _axis_swapped(tensor, axis, device):
    """`tensor` with dimensions 0 and `axis` swapped, on `device`."""
    if not axis:
        return tensor
    perm = list(range(tensor.shape.rank))
    perm[0], perm[axis] = axis, 0
    with tf.device(device):
        return tf.transpose(tensor, perm)


def _check_arguments(
    bytes_per_pack, flatten_packs, transport, timeout_seconds, num_workers, worker_index
):
    if not _is_positive_int(bytes_per_pack):
        raise ValueError(f"bytes_per_pack must be a positive int; received {bytes_per_pack!r}.")
    if flatten_packs not in ("auto", True, False):
        raise ValueError(
            f'flatten_packs must be "auto", True or False; received {flatten_packs!r}.'
        )
    if transport not in transports.TRANSPORTS:
        raise ValueError(
            f"Unknown transport {transport!r}. Allowed: {', '.join(transports.TRANSPORTS)}."
        )
    if timeout_seconds is not None and not timeout_seconds >= 0:
        raise ValueError(f"timeout_seconds must be None or >= 0; received {timeout_seconds!r}.")
    if not _is_positive_int(num_workers) or worker_index not in range(num_workers):
        raise ValueError(
            f"num_workers must be a positive int and worker_index in "
            f"range(num_workers); received {num_workers!r}, {worker_index!r}."
        )
    if transport == "local" and num_workers > 1:
        raise ValueError(
            f'transport="local" cannot reduce across {num_workers} '
            'workers; use "collective" or "auto".'
        )


def _static_axis(axis):
    value = tf.get_static_value(axis)
    if value is None:
        raise ValueError(f"gather needs an axis known while tracing; received {axis!r}.")
    return int(value)


def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _parse_implementation(implementation):
    if isinstance(implementation, CommunicationImplementation):
        return implementation
    if isinstance(implementation, str):
        key = implementation.strip().upper()
        if key in CommunicationImplementation.__members__:
            return CommunicationImplementation[key]
    raise ValueError(
        f"Unknown implementation {implementation!r}. Allowed: auto, ring, nccl, "
        "or a tf.distribute.experimental.CommunicationImplementation."
    )


def tf_agn_ops(strategy):
    """`strategy`'s `AggregatingAllReduce`, or None."""
    ops = _compat.cross_device_ops(strategy.extended, required=False)
    return ops if isinstance(ops, AggregatingAllReduce) else None


def default_aggregation(strategy):
    """The `AggregatingAllReduce`'s `aggregation`, or MEAN as stock Keras."""
    ops = tf_agn_ops(strategy)
    return ops.default_aggregation if ops is not None else AggregationMethod.MEAN


def default_compression(strategy):
    """The `AggregatingAllReduce`'s compressor, or None."""
    ops = tf_agn_ops(strategy)
    return None if ops is None else ops.default_compressor
