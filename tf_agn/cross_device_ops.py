"""`AggregatingAllReduce`: packed, XLA-compiled cross-device reduction."""

import copy
import threading

import tensorflow as tf

from tf_agn import _compat
from tf_agn import collective
from tf_agn import collective_transport
from tf_agn import compression as compression_lib
from tf_agn import packing
from tf_agn import placement
from tf_agn.aggregation import AggregationMethod
from tf_agn.aggregation import contributes
from tf_agn.aggregation import method_scale
from tf_agn.aggregation import scale_value
from tf_agn.compression import error_feedback
from tf_agn.local_transport import LocalCommunicator
from tf_agn.local_transport import LocalTransport

CommunicationOptions = tf.distribute.experimental.CommunicationOptions
CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation


class AggregatingAllReduce(tf.distribute.CrossDeviceOps):
    """Cross-device ops that pack tensors and reduce them in XLA.

    Use it as `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or
    build the strategy with `tf_agn.strategies.mirrored(...)` (one process)
    or `tf_agn.strategies.multi_worker_mirrored(...)` (several).

    There are two ways in:

    - TensorFlow's own (`reduce`, `batch_reduce`, `broadcast`, gather, and
      `replica_context.all_reduce`), used by Keras (its loss and metric
      logs, its own optimizers), on-read variables and `strategy.reduce`.
      These always do exactly the `tf.distribute.ReduceOp` (SUM or MEAN)
      the caller asks for, uncompressed.
    - `aggregate(method, values)`, used by tf_agn's optimizers for
      gradients and commits, and the only way in that `compression`
      applies to. It also does the two methods TensorFlow has no ReduceOp
      for: ONLY_FIRST_REPLICA sends replica 0's pack to every replica, and
      NONE communicates nothing. `aggregation` is the default method
      optimizers use when they are given none.

    Dense tensors are grouped per dtype into packs of at most
    `bytes_per_pack` bytes, and each pack travels by one of two transports
    (`tf_agn.collective` explains the traffic of each):

    - "local": every pack is summed and scaled by one
      `tf.function(jit_compile=True)` call on the reduce device, and the
      result is sent to the destinations. Where devices have memory of
      their own (GPUs), each replica first concatenates its part of the
      pack into one flat buffer, so that a pack crosses devices as one
      transfer; logical CPU devices share host memory and are read in place,
      unless a pack holds many small tensors, where one buffer saves the
      per-tensor costs (`flatten_packs="auto"`; True or False forces either
      way). A flattened result is split on each destination.
    - "collective": every replica scales, compresses and concatenates its
      own part of the pack in one XLA-compiled call on its own device (a
      bare concatenation, with nothing to scale or cast, runs as
      TensorFlow's own op, and so does a bare split, which on CPU copies
      nothing); one
      TensorFlow collective all-reduce per pack (NCCL on GPUs, a ring on
      CPUs and across workers) sums the buffers of all replicas of all
      workers; every replica splits the result in one XLA-compiled call.
      ONLY_FIRST_REPLICA is an all-reduce to which only replica 0 adds its
      pack (the others add zeros), so that it is ordered like the rest.

    "auto" (the default) takes "collective" across workers and on physical
    GPUs, and "local" for devices of one process that share host memory.

    float16 and bfloat16 values are summed in float32 by "local" and in
    their own dtype by "collective", as NCCL and `MultiWorkerMirroredStrategy`
    do. `aggregate(..., compressor=...)` compresses the values its
    compressor acts on (`tf_agn.compression`): a cast (fp16, bf16) on
    their own device in the compiled packing call, which "local"
    decompresses and sums in full precision and "collective" sums
    compressed; int8 and PowerSGD run their own collectives, on either
    transport, with each replica's error-feedback state passed in and
    returned. The ops' `compression` is the default compressor of the
    tf_agn optimizers under the strategy, as `aggregation` is their
    default method. Keras's own optimizers reach these ops through
    `replica_context.all_reduce`, not `aggregate`: their gradients travel
    uncompressed (wrap one in `tf_agn.optimizers.DistributedOptimizer` to
    compress its gradients).

    `tf.distribute.experimental.CommunicationOptions` that TensorFlow's
    callers pass (`strategy.reduce(..., options=)`, a strategy's
    `communication_options`) take precedence over the constructor's
    `bytes_per_pack`, `timeout_seconds` and `implementation`, field by
    field, wherever they set a field (non-zero, non-None, not AUTO). The
    transport is the constructor's alone: `MirroredStrategy` passes NCCL
    whatever its devices, and TensorFlow's collectives run NCCL requests on
    CPUs as a ring.

    Fallback: on a device type XLA cannot compile for (anything but CPU, GPU
    and TPU), or with `jit_compile=False`, the same functions run as
    ordinary graph functions.

    Sparse gradients (`tf.IndexedSlices`, from embeddings) are gathered, not
    densified: the result holds every replica's rows and indices, scaled,
    and repeated indices add up when the optimizer applies them. This keeps
    the cost proportional to the rows touched rather than the table size.

    Integer values (metric counters) can be summed; their MEAN is refused,
    since it has no integer answer.

    Values without a device (function inputs fed to `strategy.run`) are
    taken to be on their replica's device, as their destinations or the
    strategy name it.

    Args:
        aggregation: the default `AggregationMethod` (or its name) for tf_agn
            optimizers in a strategy that uses these ops.
        bytes_per_pack: the most bytes one pack may hold. The default,
            4 MiB, is explained at `packing.DEFAULT_BYTES_PER_PACK`.
        compression: None, "fp16", "bf16", "int8" or a `tf_agn.compression`
            compressor: the default of the tf_agn optimizers under the
            strategy (only `aggregate` compresses).
        jit_compile: whether to compile the packing and reduction with XLA.
        reduce_to_device: the device that reduces for "local"; by default
            the first destination device.
        flatten_packs: "auto", True or False, for "local": whether each
            replica's part of a pack is concatenated into one flat buffer
            before it travels.
        transport: "auto", "local" or "collective".
        timeout_seconds: for "collective": how long a collective may wait
            for its peers before it fails with `DeadlineExceededError`;
            None or 0 (the default, `tf_agn.collective.
            DEFAULT_TIMEOUT_SECONDS`) waits for ever. A lost peer fails
            the step anyway (TensorFlow's health check); a timeout also
            turns collectives called in another order into an error, but
            TensorFlow holds a thread per collective for the whole timeout,
            so keep it short (seconds to minutes) where steps are fast.
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
        timeout_seconds=collective.DEFAULT_TIMEOUT_SECONDS,
        implementation="auto",
        num_workers=1,
        worker_index=0,
    ):
        super().__init__()
        if not _is_positive_int(bytes_per_pack):
            raise ValueError(
                "bytes_per_pack must be a positive int; received "
                f"{bytes_per_pack!r}."
            )
        if flatten_packs not in ("auto", True, False):
            raise ValueError(
                f'flatten_packs must be "auto", True or False; received '
                f"{flatten_packs!r}."
            )
        if transport not in collective.TRANSPORTS:
            raise ValueError(
                f"Unknown transport {transport!r}. Allowed: "
                f"{', '.join(collective.TRANSPORTS)}."
            )
        if timeout_seconds is not None and not timeout_seconds >= 0:
            raise ValueError(
                f"timeout_seconds must be None or >= 0; received {timeout_seconds!r}."
            )
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
        self.aggregation = AggregationMethod.parse(aggregation)
        self.bytes_per_pack = bytes_per_pack
        self.compressor = compression_lib.get(compression)
        self.jit_compile = bool(jit_compile)
        self.reduce_to_device = reduce_to_device
        self.flatten_packs = flatten_packs
        self._local_transport = LocalTransport(
            reduce_to_device, flatten_packs, self.jit_compile
        )
        self.transport = transport
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.options = CommunicationOptions(
            bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds,
            implementation=_parse_implementation(implementation),
        )
        # One function per kind of eager call, so that repeated eager calls
        # do not retrace (see `_run_collectives`).
        self._eager_functions = {}
        # Collectives of one batch must be launched by one thread at a time,
        # or two batches could interleave differently on two devices.
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
        # process's (`tf_agn.collective.collective_group`): it shares the
        # lock, so that its batches never interleave with this object's.
        memo[id(self._lock)] = self._lock
        # Eager functions close over this object; the copy traces its own.
        state = dict(vars(self), _eager_functions={})
        vars(copied).update(copy.deepcopy(state, memo))
        return copied

    # TensorFlow's entry points: exact, never compressed.

    @property
    def _num_between_graph_workers(self):
        # TensorFlow's `CrossDeviceOps.reduce` and `batch_reduce` hand a
        # lone local replica's value back unreduced when this is 1: with one
        # replica per worker, nothing would cross workers.
        return self.num_workers

    def reduce_implementation(
        self, reduce_op, per_replica_value, destinations, options
    ):
        return self._aggregate(
            AggregationMethod.parse(reduce_op),
            [per_replica_value],
            [destinations],
            options=options,
        )[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        values, destinations = zip(*value_destination_pairs)
        return self._aggregate(
            AggregationMethod.parse(reduce_op), values, destinations, options=options
        )

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
        sources = self._source_devices(per_replica_value, destinations)
        options, _ = self._options(options, sources)
        group = self._group(sources)
        axis = _static_axis(axis)

        def launch(per_replica_inputs):
            return [
                [
                    collective_transport.gather_along(
                        group, replica, tensor, axis, options
                    )
                ]
                for replica, (tensor,) in enumerate(per_replica_inputs)
            ]

        per_replica = self._run_collectives(
            ("gather", axis, _options_key(options)),
            launch,
            [[v] for v in per_replica_value.values],
            sources,
        )
        return self._regroup([r[0] for r in per_replica], sources, devices)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """One replica's all-reduce, in replica context, without merge_call.

        `MultiWorkerMirroredStrategy` calls this inside XLA-compiled steps
        on GPUs, and TensorFlow's own tests call it on ops used without a
        strategy. Only the collective transport can serve it: each replica
        launches its own part of every collective.
        """
        method = AggregationMethod.parse(reduce_op)
        flat = tf.nest.flatten(value, expand_composites=False)
        devices = self._replica_devices(flat, replica_id)
        options, transport = self._options(options, devices)
        if transport != "collective":
            raise NotImplementedError(
                'Replica-context all-reduce needs transport="collective".'
            )
        group = self._group(devices)
        reduced = collective_transport.combine_replica(
            method, replica_id, flat, group, 1.0, options, None, self.jit_compile
        )
        return tf.nest.pack_sequence_as(value, reduced)

    def _replica_devices(self, tensors, replica_id):
        """This process's replica devices, for `_all_reduce` of replica
        `replica_id`'s `tensors`.

        Args:
            tensors: the replica's tensors and `tf.IndexedSlices`.
            replica_id: the replica's index among this process's replicas.

        Returns:
            The devices of the strategy in scope; outside any strategy, the
            one device of `tensors`: TensorFlow's default replica context
            has one replica.

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

    # tf_agn's entry point.

    def aggregate(
        self,
        method,
        per_replica_values,
        value_scale=1.0,
        options=None,
        compressor=None,
        states=None,
        step=None,
    ):
        """Combines per-replica values with any `AggregationMethod`.

        Call it in cross-replica context, for example inside `merge_call`.

        Args:
            method: an `AggregationMethod` or its name.
            per_replica_values: a list of `tf.distribute.DistributedValues`
                (or plain tensors, for a single replica).
            value_scale: a Python float every value is multiplied by first.
                Optimizers use it to undo Keras' 1/n loss scaling inside the
                compiled reduction rather than in a separate pass.
            options: optional `CommunicationOptions`, merged over the
                constructor's.
            compressor: None (values travel exactly), or a
                `tf_agn.compression.Compressor` or `ErrorFeedbackCompressor`
                for the values it acts on. The ops' own `compressor` is
                the default of the optimizers that call this, not of this
                method.
            states: for an `ErrorFeedbackCompressor`: one dict per value,
                from each name of its `state_spec` to a `PerReplica` value
                of every replica's state.
            step: for an `ErrorFeedbackCompressor` with a `start_step`: the
                optimizer's step, a scalar integer tensor (or a `Mirrored`
                one).

        Returns:
            A list with one entry per value: `Mirrored` values for SUM, MEAN
            and ONLY_FIRST_REPLICA, `PerReplica` values for NONE. With an
            `ErrorFeedbackCompressor`, `(combined, new_states)`, where
            `new_states` is laid out like `states`, of `PerReplica` values.
        """
        method = AggregationMethod.parse(method)
        values = [_compat.make_tensor_into_per_replica(v) for v in per_replica_values]
        if not compression_lib.is_stateful(compressor):
            return self._aggregate(method, values, values, value_scale, options, compressor)
        if method is AggregationMethod.NONE:
            return self._aggregate(method, values, values, value_scale), states
        # With one local replica, `merge_call` hands plain tensors over.
        states = [
            {name: _compat.make_tensor_into_per_replica(v) for name, v in state.items()}
            for state in states
        ]
        return self._aggregate_with_state(
            method, values, value_scale, options, compressor, states, step
        )

    def _aggregate(
        self, method, values, destinations, value_scale=1.0, options=None, compressor=None
    ):
        if method is AggregationMethod.NONE:
            return [_scale_per_replica(v, value_scale) for v in values]
        sources = self._source_devices(values[0], destinations[0])
        options, transport = self._options(options, sources)
        if transport == "collective":
            return self._collective(
                method, values, destinations, value_scale, options, compressor
            )
        return self._local_transport.aggregate(
            method,
            values,
            sources,
            [self._devices(d, v) for d, v in zip(destinations, values)],
            value_scale,
            options.bytes_per_pack,
            compressor,
        )

    # The collective transport: every local replica launches its part.

    def _collective(self, method, values, destinations, value_scale, options, compressor):
        sources = self._source_devices(values[0], destinations[0])
        group = self._group(sources)

        def launch(per_replica_inputs):
            return [
                collective_transport.combine_replica(
                    method,
                    replica,
                    tensors,
                    group,
                    value_scale,
                    options,
                    compressor,
                    self.jit_compile,
                )
                for replica, tensors in enumerate(per_replica_inputs)
            ]

        per_replica = self._run_collectives(
            ("aggregate", method, value_scale, _options_key(options), compressor),
            launch,
            [[v.values[r] for v in values] for r in range(len(sources))],
            sources,
        )
        return [
            self._regroup(replicas, sources, self._devices(destination, value))
            for value, destination, replicas in zip(
                values, destinations, zip(*per_replica)
            )
        ]

    def _aggregate_with_state(
        self, method, values, value_scale, options, compressor, states, step
    ):
        """`aggregate` with an `ErrorFeedbackCompressor`: the values it acts
        on go through `compressor.combine`, on either transport; the others
        travel exactly."""
        sources = self._source_devices(values[0], values[0])
        options, transport = self._options(options, sources)
        stateful = [
            i
            for i, v in enumerate(values)
            if not isinstance(v.values[0], tf.IndexedSlices)
            and compressor.acts_on(v.values[0].dtype)
        ]
        exact = [i for i in range(len(values)) if i not in stateful]
        combined = [None] * len(values)
        new_states = list(states)
        if exact:
            exact_results = self._aggregate(
                method, [values[i] for i in exact], [values[i] for i in exact],
                value_scale, options,
            )
            for i, result in zip(exact, exact_results):
                combined[i] = result
        if not stateful:
            return combined, new_states
        if transport == "collective":
            group = self._group(sources)
            communicator = collective_transport.CollectiveCommunicator(group, options)
            first_rank = group.first_replica
        else:
            communicator = LocalCommunicator(
                sources, self.reduce_to_device or sources[0]
            )
            first_rank = 0
        scale = method_scale(method, tf.float32, communicator.size, value_scale)
        scales = [
            scale if contributes(method, first_rank + r) else 0.0
            for r in range(len(sources))
        ]
        names = [sorted(states[i]) for i in stateful]
        if step is not None:  # The same on every replica: replica 0's.
            step = _compat.make_tensor_into_per_replica(step).values[0]

        def launch(per_replica_inputs):
            replica_values = [inputs[0] for inputs in per_replica_inputs]
            replica_states = [
                [dict(zip(n, s)) for n, s in zip(names, inputs[1])]
                for inputs in per_replica_inputs
            ]
            step_value = per_replica_inputs[0][2]
            results, new = error_feedback.combine_with_state(
                compressor,
                communicator,
                replica_values,
                replica_states,
                scales,
                options.bytes_per_pack,
                self.jit_compile,
                step_value,
            )
            return [
                [r, [[s[name] for name in n] for n, s in zip(names, replica_new)]]
                for r, replica_new in zip(results, new)
            ]

        per_replica_inputs = [
            [
                [values[i].values[r] for i in stateful],
                [[states[i][name].values[r] for name in n] for i, n in zip(stateful, names)],
                step,
            ]
            for r in range(len(sources))
        ]
        if transport == "collective":
            per_replica = self._run_collectives(
                (
                    "stateful",
                    compressor,
                    tuple(scales),
                    tuple(map(tuple, names)),
                    step is None,
                    _options_key(options),
                ),
                launch,
                per_replica_inputs,
                sources,
            )
        else:
            per_replica = launch(per_replica_inputs)
        for position, i in enumerate(stateful):
            combined[i] = self._regroup(
                [replica[0][position] for replica in per_replica], sources, sources
            )
            new_states[i] = {
                name: _compat.regroup(
                    tuple(replica[1][position][k] for replica in per_replica)
                )
                for k, name in enumerate(names[position])
            }
        return combined, new_states

    def _run_collectives(self, key, launch, per_replica_inputs, sources):
        """Runs `launch(per_replica_inputs)`, which issues every local
        replica's collectives, and returns its per-replica results.

        Traced (inside `fit`'s step), `launch` becomes part of the caller's
        graph. Eagerly, replica 0's collective would block before replica
        1's is launched, so one function launches them all at once; it is
        made once per `key` (what `launch` closes over besides its
        argument), so eager calls do not retrace. A function's eager
        outputs report the caller's device, so each is then pinned to its
        replica's.
        """
        with self._lock:
            if not tf.executing_eagerly():
                return launch(per_replica_inputs)
            key = (key, tuple(sources))
            function = self._eager_functions.get(key)
            if function is None:
                function = tf.function(launch, autograph=False)
                self._eager_functions[key] = function
            outputs = function(per_replica_inputs)
        return [
            [placement.on(device, t) for t in replica_outputs]
            for device, replica_outputs in zip(sources, outputs)
        ]

    def _regroup(self, replicas, sources, devices):
        """One value's per-replica results, on `devices`."""
        if tuple(devices) == tuple(sources):
            return _compat.regroup(tuple(replicas), wrap_class=_compat.Mirrored)
        return placement.mirror(replicas[0], devices)

    def _group(self, devices):
        return collective.collective_group(
            devices,
            group_size=len(devices) * self.num_workers,
            first_replica=self.worker_index * len(devices),
        )

    # Shared helpers.

    def _options(self, options, devices):
        """The constructor's options overridden by the caller's, with AUTO
        resolved for these devices, and the transport they call for.

        Returns:
            `(options, transport)`.
        """
        merged = self.options.merge(options)
        if merged.implementation == CommunicationImplementation.AUTO:
            merged.implementation = collective.default_implementation(devices)
        transport = self.transport
        if transport == "auto":
            transport = collective.choose_transport(devices, self.num_workers)
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
            candidates.append(
                _compat.devices_of(destinations, self)
            )
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


def _scale_per_replica(value, scale):
    if scale == 1:
        return value
    scaled = []
    for local in value.values:
        with tf.device(local.device):
            scaled.append(scale_value(local, scale))
    return _compat.regroup(tuple(scaled))
