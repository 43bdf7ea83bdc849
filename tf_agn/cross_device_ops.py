"""`AggregatingAllReduce`: tf_agn's transports as TensorFlow cross-device ops."""

import copy
import functools
import threading

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression as compression_lib
from tf_agn import packing
from tf_agn import placement
from tf_agn import transports
from tf_agn.aggregation import AggregationMethod
from tf_agn.combining import combine_replicas

CommunicationOptions = tf.distribute.experimental.CommunicationOptions
CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation


class AggregatingAllReduce(tf.distribute.CrossDeviceOps):
    """Cross-device ops that pack tensors and reduce them in XLA.

    Use it as `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or
    build the strategy with `tf_agn.strategies.mirrored(...)` (one process)
    or `tf_agn.strategies.multi_worker_mirrored(...)` (several).

    TensorFlow's entry points (`strategy.reduce`, `batch_reduce_to`,
    `broadcast_to`, `strategy.gather`, `replica_context.all_reduce`), which
    Keras's own optimizers, its loss and metric logs and on-read variables
    use, do exactly the SUM or MEAN asked for, uncompressed. tf_agn's
    optimizers combine through `tf_agn.aggregate`, with any
    `tf_agn.AggregationMethod` and compression; `aggregation` and
    `compression` are their defaults under a strategy with these ops.

    Dense tensors travel in packs of one dtype and at most
    `bytes_per_pack` bytes; sparse ones (`tf.IndexedSlices`) are gathered,
    not densified. A pack travels by one of two transports
    (`tf_agn.transports`): "local" sums it on one reduce device in one
    XLA-compiled call; "collective" runs TensorFlow's collective ops (NCCL
    on GPUs, a ring on CPUs and across workers). "auto" takes "collective"
    across workers and on physical GPUs, and "local" for devices of one
    process that share host memory. Integer values can be summed; their
    MEAN has no integer answer and is refused.

    `tf.distribute.experimental.CommunicationOptions` that TensorFlow's
    callers pass (`strategy.reduce(..., options=)`) take precedence over
    the constructor's `bytes_per_pack`, `timeout_seconds` and
    `implementation`, field by field, wherever they set one.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=tf_agn.AggregatingAllReduce(aggregation="sum")
    )
    ```

    Args:
        aggregation: the default `AggregationMethod` (or its name) for tf_agn
            optimizers in a strategy that uses these ops.
        bytes_per_pack: the most bytes one pack may hold; 4 MiB by default.
        compression: None, "fp16", "bf16", "int8" or a `tf_agn.compression`
            compressor: the default of the tf_agn optimizers under the
            strategy. TensorFlow's entry points never compress.
        jit_compile: whether to compile the packing and reduction with XLA.
        reduce_to_device: the device that reduces for "local"; by default
            the first replica's.
        flatten_packs: "auto", True or False, for "local": whether each
            replica's part of a pack is concatenated into one flat buffer
            before it travels.
        transport: "auto", "local" or "collective".
        timeout_seconds: for "collective": how long a collective may wait
            for its peers before it fails with `DeadlineExceededError`;
            None or 0 (the default) waits for ever. TensorFlow holds a
            thread per collective for the whole timeout, so keep it short
            (seconds to minutes) where steps are fast.
        implementation: for "collective": a
            `tf.distribute.experimental.CommunicationImplementation` or its
            name ("auto", "ring", "nccl"); AUTO is NCCL on GPUs, RING
            elsewhere.
        num_workers: how many processes run this program together;
            `tf_agn.strategies.multi_worker_mirrored` sets it.
        worker_index: this process's place among them, as
            `MultiWorkerMirroredStrategy` numbers its workers.

    Raises:
        ValueError: for an unknown aggregation, compression, transport or
            implementation, a `bytes_per_pack` that is not a positive int,
            a negative `timeout_seconds`, "local" across workers, or a
            `worker_index` outside `range(num_workers)`.
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
        self.aggregation = AggregationMethod.parse(aggregation)
        self.bytes_per_pack = bytes_per_pack
        self.compressor = compression_lib.get(compression)
        self.jit_compile = bool(jit_compile)
        self.reduce_to_device = reduce_to_device
        self.flatten_packs = flatten_packs
        self.transport = transport
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.options = CommunicationOptions(
            bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds,
            implementation=_parse_implementation(implementation),
        )
        # One graph function per kind of eager call (`_traced`).
        self._eager_functions = {}
        # Eager calls launch every replica's collectives in one function;
        # two threads' calls must not interleave, or two devices could
        # pair different collectives.
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        """A copy with the same settings, for `copy.deepcopy` of a strategy,
        which TensorFlow's own cross-device ops allow.

        Args:
            memo: `copy.deepcopy`'s memo.

        Returns:
            A new `AggregatingAllReduce` of this one's type and settings.
        """
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        # The copy launches into the same collective groups, which are the
        # process's (`tf_agn.transports.collective_group`): it shares the
        # lock, so that its calls never interleave with this object's.
        memo[id(self._lock)] = self._lock
        # Eager functions close over this object; the copy traces its own.
        state = dict(vars(self), _eager_functions={})
        vars(copied).update(copy.deepcopy(state, memo))
        return copied

    # TensorFlow's hooks: exact SUM and MEAN, never compressed.

    @property
    def _num_between_graph_workers(self):
        # TensorFlow's `CrossDeviceOps.reduce` and `batch_reduce` hand a
        # lone local replica's value back unreduced when this is 1: with one
        # replica per worker, nothing would cross workers.
        return self.num_workers

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, [per_replica_value], [destinations], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        values, destinations = zip(*value_destination_pairs)
        return self._reduce(reduce_op, values, destinations, options)

    def broadcast_implementation(self, tensor, destinations):
        return placement.mirror(tensor, self._devices(destinations))

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        devices = self._devices(destinations, per_replica_value)
        if self.num_workers == 1:
            with tf.device(self.reduce_to_device or devices[0]):
                gathered = tf.concat(per_replica_value.values, axis=axis)
            return placement.mirror(gathered, devices)
        # Across workers every replica all-gathers; each worker's result
        # holds every replica of every worker, in global replica order.
        transport = self.transport_for(per_replica_value, destinations, options)
        gather = self._traced(
            transport, ("gather", _static_axis(axis)),
            functools.partial(_gather_along, transport, _static_axis(axis)),
        )
        return self._place(gather(list(per_replica_value.values)), transport.devices, devices)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        # One replica's all-reduce, in replica context, without merge_call:
        # `MultiWorkerMirroredStrategy` calls it inside XLA-compiled steps
        # on GPUs, and TensorFlow's own tests on ops used without a
        # strategy. Each replica launches its own part of every collective,
        # which only the collective transport can do.
        flat = tf.nest.flatten(value, expand_composites=False)
        devices = self._replica_devices(flat, replica_id)
        options, name = self._options(options, devices)
        if name != "collective":
            raise NotImplementedError('Replica-context all-reduce needs transport="collective".')
        transport = transports.CollectiveTransport(
            self._group(devices), options, self.jit_compile, replicas=(replica_id,)
        )
        (reduced,), _ = combine_replicas(transport, AggregationMethod.parse(reduce_op), [flat])
        return tf.nest.pack_sequence_as(value, reduced)

    # What `tf_agn.aggregate` and the hooks above share.

    def transport_for(self, value, destinations=None, options=None):
        """The transport that combines `value`'s local replicas.

        Args:
            value: a distributed value (or a tensor, for one replica).
            destinations: where TensorFlow's caller wants the results, if
                anywhere; it names the devices of values that have none.
            options: `CommunicationOptions`, merged over the constructor's.

        Returns:
            A `tf_agn.transports.LocalTransport` or `CollectiveTransport`
            over the devices of `value`'s replicas.
        """
        devices = self._source_devices(value, destinations)
        options, name = self._options(options, devices)
        if name == "collective":
            return transports.CollectiveTransport(self._group(devices), options, self.jit_compile)
        return transports.LocalTransport(
            devices, self.reduce_to_device, self.flatten_packs, self.jit_compile,
            options.bytes_per_pack,
        )

    def combine_function(self, transport, method, value_scale=1, compressor=None):
        """`tf_agn.combining.combine_replicas` on `transport` with these
        settings, as a function of `(values, states=None, step=None)`
        (pass the last two by keyword).

        Traced (inside `fit`'s step), it is `combine_replicas` itself.
        Eagerly on the collective transport, replica 0's collective would
        block before replica 1's is launched: it is then a graph function
        that launches them all at once, made once per settings.
        """
        combine = functools.partial(
            combine_replicas, transport, method, value_scale=value_scale, compressor=compressor
        )
        return self._traced(transport, ("combine", method, value_scale, compressor), combine)

    def _traced(self, transport, key, function):
        """`function`, or eagerly on the collective transport, a graph
        function of it made once per `key` whose outputs are pinned to
        their replicas' devices."""
        if not tf.executing_eagerly() or isinstance(transport, transports.LocalTransport):
            return function
        key = (key, transport.devices, _options_key(transport.options))
        with self._lock:
            traced = self._eager_functions.get(key)
            if traced is None:
                traced = self._eager_functions[key] = tf.function(function, autograph=False)

        def run(*args, **kwargs):
            with self._lock:
                outputs = traced(*args, **kwargs)
            # A function's eager outputs report the caller's device.
            if isinstance(outputs, tuple):  # (per replica, per replica or None)
                return tuple(None if part is None else _pin(part, transport.devices) for part in outputs)
            return _pin(outputs, transport.devices)

        return run

    def _reduce(self, reduce_op, values, destinations, options):
        values = [_compat.make_tensor_into_per_replica(v) for v in values]
        transport = self.transport_for(values[0], destinations[0], options)
        combine = self.combine_function(transport, AggregationMethod.parse(reduce_op))
        per_replica = [[v.values[r] for v in values] for r in range(len(transport.devices))]
        combined, _ = combine(per_replica)
        return [
            self._place(replicas, transport.devices, self._devices(destination, value))
            for value, destination, replicas in zip(values, destinations, zip(*combined))
        ]

    def _place(self, replicas, sources, devices):
        """One value's per-replica results, on `devices`."""
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
        """The constructor's options overridden by the caller's, with AUTO
        resolved for these devices, and the transport they call for.

        Returns:
            `(options, transport name)`.
        """
        merged = self.options.merge(options)
        if merged.implementation == CommunicationImplementation.AUTO:
            merged.implementation = transports.default_implementation(devices)
        transport = self.transport
        if transport == "auto":
            transport = transports.choose_transport(devices, self.num_workers)
        if transport == "collective" and len(set(devices)) < len(devices):
            if self.num_workers > 1:
                raise ValueError(
                    f"Cannot tell which device each of {len(devices)} replicas' "
                    f"values belongs to (they are on {sorted(set(devices))}): "
                    "make them inside the strategy's scope or strategy.run."
                )
            # One process: the local transport gives the same numbers
            # without needing each replica's device.
            transport = "local"
        return merged, transport

    def _devices(self, destinations, value=None):
        """Where results go: the devices `destinations` name, or else the
        devices of `value`'s replicas."""
        if destinations is not None and _compat.check_destinations(destinations):
            devices = _compat.devices_of(destinations, self)
            if all(devices):
                return devices
        return self._source_devices(value, destinations)

    def _source_devices(self, value, destinations=None):
        """The devices of `value`'s replicas.

        A value made outside the replicas' device scopes (a function input,
        an eager dataset element) has no device: it stands for its replica,
        on the device of the same index among the destinations, or else
        among the devices of the strategy in scope.
        """
        devices = _compat.devices_of(value, self)
        # Replicas on one device (values made eagerly outside the replicas'
        # scopes, all on the default device) do not say where they belong.
        if all(devices) and len(set(devices)) == len(devices):
            return devices
        candidates = []
        if destinations is not None and _compat.check_destinations(destinations):
            candidates.append(_compat.devices_of(destinations, self))
        if tf.distribute.has_strategy():
            candidates.append(tf.distribute.get_strategy().extended.worker_devices)
        for known in candidates:
            if len(known) == len(devices) and all(known) and len(set(known)) == len(known):
                return tuple(known)
        if all(devices):
            return devices  # Where they are, though it says nothing of replicas.
        raise ValueError(
            f"{len(devices)} values without a device, and neither the "
            "destinations nor a strategy in scope name as many devices: "
            "cannot tell where they are."
        )

    def _replica_devices(self, tensors, replica_id):
        """This process's replica devices, for `_all_reduce` of replica
        `replica_id`'s `tensors`: the strategy's in scope; outside any
        strategy, the one device of `tensors` (TensorFlow's default replica
        context has one replica).

        Raises:
            ValueError: outside a strategy, for a `replica_id` other than 0
                or tensors on several devices.
        """
        if tf.distribute.has_strategy():
            return tf.distribute.get_strategy().extended.worker_devices
        # A tensor without a device resolves to the device scope it is
        # reduced in, as TensorFlow's own ops read destinations.
        devices = {device for t in tensors for device in _compat.devices_of(t, self)}
        if replica_id != 0 or len(devices) != 1:
            raise ValueError(
                "Outside a strategy, _all_reduce serves one local replica, "
                "replica_id 0, with its values on one device; received "
                f"replica_id {replica_id!r} and values on {sorted(devices)}. "
                "Call it in a strategy's replica context for several."
            )
        return (devices.pop(),)


def _gather_along(transport, axis, per_replica):
    """Every replica's tensor of `per_replica`, all-gathered along `axis`,
    for each local replica; replicas may differ in length along `axis`."""
    rank = per_replica[0].shape.rank
    axis %= rank
    perm = [axis] + [d for d in range(rank) if d != axis]
    moved = []
    for device, tensor in zip(transport.devices, per_replica):
        with tf.device(device):
            moved.append([tf.transpose(tensor, perm) if axis else tensor])
    gathered = []
    for device, (rows,) in zip(transport.devices, transport.all_gather_rows(moved)):
        with tf.device(device):
            gathered.append(tf.transpose(rows, [perm.index(d) for d in range(rank)]) if axis else rows)
    return gathered


def _pin(outputs, devices):
    """Each local replica's outputs (`outputs[r]`, any structure) on its
    device."""
    return [
        tf.nest.map_structure(lambda t, d=device: placement.on(d, t), replica_outputs)
        for device, replica_outputs in zip(devices, outputs)
    ]


def _check_arguments(
    bytes_per_pack, flatten_packs, transport, timeout_seconds, num_workers, worker_index
):
    """Raises `ValueError` for a bad constructor argument, naming it."""
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


def _options_key(options):
    """The fields of `CommunicationOptions` a launch depends on."""
    return (options.bytes_per_pack, options.timeout_seconds, options.implementation)


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
