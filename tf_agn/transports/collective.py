"""`CollectiveTransport`: the patterns as TensorFlow's collective ops."""

import tensorflow as tf

from tf_agn.collectives import packing
from tf_agn.collectives import placement
from tf_agn.collectives.aggregation_method import weighted
from tf_agn.utils import devices as devices_lib

_CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation


class CollectiveTransport:
    """The collective patterns among the replicas of a `CollectiveGroup`.

    Args:
        group: the `tf_agn.transports.CollectiveGroup` of every replica.
        options: `tf.distribute.experimental.CommunicationOptions`, every
            field resolved.
        jit_compile: whether packing and unpacking are XLA-compiled.
        replicas: the indices, among `group.devices`, of the local replicas
            this transport launches for; by default all of them.
    """

    def __init__(self, group, options, jit_compile, replicas=None):
        self.group = group
        self.options = options
        self.jit_compile = jit_compile
        self.replicas = tuple(range(len(group.devices)) if replicas is None else replicas)
        self.devices = tuple(group.devices[r] for r in self.replicas)
        self.size = group.size
        self.bytes_per_pack = options.bytes_per_pack

    def rank(self, replica):
        """Local replica `replica`'s index among all replicas."""
        return self.group.first_replica + self.replicas[replica]

    def eager(self, key, function):
        """`function`, which launches collectives for every local replica,
        as it can run now: eagerly, a graph function cached per `key`."""
        # Eagerly, replica 0's collective would block before replica 1's.
        if not tf.executing_eagerly():
            return function
        key = (key, self.replicas, self.jit_compile, _options_key(self.options))
        group = self.group
        with group.eager_lock:
            traced = group.eager_functions.get(key)
            if traced is None:
                traced = group.eager_functions[key] = tf.function(function, autograph=False)

        def run(*args, **kwargs):
            with group.eager_lock:
                outputs = traced(*args, **kwargs)
            # A function's eager outputs report the caller's device.
            if isinstance(outputs, tuple):
                return tuple(None if part is None else self._pin(part) for part in outputs)
            return self._pin(outputs)

        return run

    def all_reduce(self, tensors, weights=None, cast=None):
        """Every replica's tensors, weighted and summed, tensor by tensor.

        Args:
            tensors: for each local replica, its list of tensors of one
                dtype (one pack).
            weights: for each local replica, the Python number its tensors
                are multiplied by (0: adds nothing); by default 1.
            cast: None, or a `tf_agn.compression.Cast` whose wire dtype
                the values travel and are summed in.

        Returns:
            For each local replica, the list of summed tensors.
        """
        results = []
        weights = weights or [1] * len(tensors)
        for replica, (replica_tensors, weight) in enumerate(zip(tensors, weights)):
            device = self.devices[replica]
            jit = packing.use_xla(self.jit_compile, device)
            with tf.device(device):
                if weight == 0:
                    # Zeros, not a broadcast: broadcast ops take no ordering
                    # token, and unordered collectives can deadlock NCCL.
                    dtype = replica_tensors[0].dtype
                    dtype = dtype if cast is None else cast.wire_dtype(dtype)
                    flat = tf.zeros([_num_elements(replica_tensors)], dtype)
                else:
                    flat = packing.flatten(replica_tensors, weight, cast, jit_compile=jit)
            summed = self._launch(
                tf.raw_ops.CollectiveReduceV2, replica, flat, merge_op="Add", final_op="Id"
            )
            with tf.device(device):
                results.append(packing.unflatten(summed, replica_tensors, cast, jit_compile=jit))
        return results

    def reduce_scatter(self, tensors, weights=None, sum_parts=None):
        """Row r of every replica's tensor, weighted and summed, for replica r.

        Args:
            tensors: for each local replica, a tensor whose first dimension
                is `size`.
            weights: as `all_reduce`'s, multiplied in before sending.
            sum_parts: None to sum, or a function from the `size` rows a
                replica receives to their reduction (for int8 codes).

        Returns:
            For each local replica, its reduced row.
        """
        tensors = weighted(tensors, weights, self.devices)
        native = sum_parts is None and self._has_native_reduce_scatter()
        op = tf.raw_ops.CollectiveReduceScatterV2 if native else tf.raw_ops.CollectiveAllToAllV2
        attributes = {"merge_op": "Add", "final_op": "Id"} if native else {}
        received = [
            self._launch(op, r, tensor, **attributes)
            for r, tensor in enumerate(tensors)
        ]
        reduced = []
        for device, rows in zip(self.devices, received):
            with tf.device(device):
                if native:
                    reduced.append(tf.squeeze(rows, 0))
                else:
                    # TensorFlow's CPU collectives have no reduce-scatter.
                    reduced.append(tf.reduce_sum(rows, 0) if sum_parts is None else sum_parts(rows))
        return reduced

    def all_gather(self, tensors):
        """Every replica's tensor (all of one shape), concatenated in replica order."""
        return [
            self._launch(tf.raw_ops.CollectiveGatherV2, r, tensor)
            for r, tensor in enumerate(tensors)
        ]

    def all_to_all(self, tensors):
        """Row j of each tensor (first dimension `size`) to replica j, in
        replica order; CPU collectives carry floats and int32/int64."""
        return [
            self._launch(tf.raw_ops.CollectiveAllToAllV2, r, tensor)
            for r, tensor in enumerate(tensors)
        ]

    def all_gather_rows(self, tensors):
        """Every replica's rows of each of its tensors (a list per local
        replica, sharing the first dimension), concatenated in replica
        order; replicas may hold different numbers of rows."""
        # Counts first, then rows padded to the longest, the padding masked out.
        counts, padded = [], []
        for device, replica_tensors in zip(self.devices, tensors):
            with tf.device(device):
                counts.append(tf.shape(replica_tensors[0], out_type=tf.int32)[:1])
        all_counts = self.all_gather(counts)
        for device, replica_tensors, count, replica_counts in zip(
            self.devices, tensors, counts, all_counts
        ):
            with tf.device(device):
                longest = tf.reduce_max(replica_counts)
                padded.append([
                    tf.pad(t, [[0, longest - count[0]]] + [[0, 0]] * (t.shape.rank - 1))
                    for t in replica_tensors
                ])
        gathered = [self.all_gather(list(position)) for position in zip(*padded)]
        results = []
        for replica, (device, replica_counts) in enumerate(zip(self.devices, all_counts)):
            with tf.device(device):
                longest = tf.reduce_max(replica_counts)
                keep = tf.reshape(tf.range(longest)[None, :] < replica_counts[:, None], [-1])
                results.append([tf.boolean_mask(rows[replica], keep) for rows in gathered])
        return results

    def all_gather_slices(self, slices, weights):
        """Every replica's `tf.IndexedSlices`, rows multiplied by its Python
        number in `weights` (0: adds nothing), concatenated in replica order."""
        parts = []
        for device, value, weight in zip(self.devices, slices, weights):
            with tf.device(device):
                rows = value.values * tf.constant(weight, value.dtype)
                indices = value.indices
                if weight == 0:
                    rows, indices = rows[:0], indices[:0]
                parts.append([rows, indices])
        return [
            tf.IndexedSlices(rows, indices, value.dense_shape)
            for (rows, indices), value in zip(self.all_gather_rows(parts), slices)
        ]

    def _launch(self, op, replica, tensor, **attributes):
        """Local replica `replica`'s part of the `tf.raw_ops` collective
        `op` on `tensor`, with the op's own `attributes`."""
        arguments = self.group.next_collective(self.replicas[replica], self.options)
        with tf.device(self.devices[replica]):
            return op(input=tensor, **arguments, **attributes)

    def _pin(self, per_replica):
        """Each local replica's outputs (any structure) on its device."""
        return [
            tf.nest.map_structure(lambda t, d=device: placement.on(d, t), outputs)
            for device, outputs in zip(self.devices, per_replica)
        ]

    def _has_native_reduce_scatter(self):
        # `CollectiveReduceScatterV2` is NCCL's only: on CPUs it fails.
        return self.options.implementation == _CommunicationImplementation.NCCL and all(
            devices_lib.device_type(d) == "GPU" for d in self.devices
        )


def _options_key(options):
    """The fields of `CommunicationOptions` a launch depends on."""
    return (options.bytes_per_pack, options.timeout_seconds, options.implementation)


def _num_elements(tensors):
    return tf.add_n([tf.size(t) for t in tensors])
