"""`CollectiveTransport`: the patterns as TensorFlow's collective ops.

Every local replica packs its own values on its own device (one
XLA-compiled call where there is something to scale or cast), launches
its part of each collective (NCCL on GPUs, a ring on CPUs and between
workers: the ops `MultiWorkerMirroredStrategy` uses), and unpacks what it
receives on its device.
"""

import tensorflow as tf

from tf_agn import devices as devices_lib
from tf_agn import packing
from tf_agn import placement

_CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation


class CollectiveTransport:
    """The collective patterns among the replicas of a `CollectiveGroup`.

    Args:
        group: the `tf_agn.transports.CollectiveGroup` of every replica.
        options: `tf.distribute.experimental.CommunicationOptions`, every
            field resolved.
        jit_compile: whether packing and unpacking are XLA-compiled.
        replicas: the indices, among `group.devices`, of the local replicas
            this transport launches for; by default all of them. A
            replica that launches its own collectives in replica context
            serves just itself.
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
        as it can run now.

        Traced (inside `fit`'s step), it is `function` itself. Eagerly,
        replica 0's collective would block before replica 1's is launched:
        it is then a graph function that launches them all at once, made
        once per `key` (what `function` closes over) and per transport,
        whose outputs (one per local replica, or a tuple of such lists)
        are pinned to the replicas' devices.
        """
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

    def all_reduce(self, packs, weights=None, cast=None):
        """Every replica's pack, weighted and summed, tensor by tensor.

        Args:
            packs: for each local replica, its list of tensors of one dtype.
            weights: for each local replica, the Python number its tensors
                are multiplied by (0 for a replica that adds nothing); by
                default 1 for each.
            cast: a `tf_agn.compression.Compressor` that acts on the pack's
                dtype, or None. Its values travel, and are summed, in its
                wire dtype.

        Returns:
            For each local replica, the list of summed tensors.
        """
        results = []
        for replica, (pack, weight) in enumerate(zip(packs, weights or [1] * len(packs))):
            device = self.devices[replica]
            jit = packing.use_xla(self.jit_compile, device)
            with tf.device(device):
                if weight == 0:
                    # The others' sum travels as an all-reduce to which this
                    # replica adds zeros: TensorFlow's broadcast ops take no
                    # ordering token, and unordered collectives can deadlock
                    # NCCL. x + 0 is exact, inf and NaN included.
                    dtype = pack[0].dtype if cast is None else cast.wire_dtype(pack[0].dtype)
                    flat = tf.zeros([_num_elements(pack)], dtype)
                else:
                    flat = packing.flatten(pack, weight, cast, jit_compile=jit)
            summed = self.group.launch(
                tf.raw_ops.CollectiveReduceV2, self.replicas[replica], flat, self.options,
                merge_op="Add", final_op="Id",
            )
            with tf.device(device):
                results.append(packing.unflatten(summed, pack, cast, jit_compile=jit))
        return results

    def reduce_scatter(self, tensors, sum_parts=None):
        """Row r of every replica's tensor, summed, for replica r.

        Args:
            tensors: for each local replica, a tensor whose first dimension
                is `size`.
            sum_parts: None to sum, or a function from the `size` rows a
                replica receives (row j from replica j) to their reduction,
                for rows that cannot be summed as they travel (int8 codes).

        Returns:
            For each local replica, its reduced row.
        """
        native = sum_parts is None and self._has_native_reduce_scatter()
        op = tf.raw_ops.CollectiveReduceScatterV2 if native else tf.raw_ops.CollectiveAllToAllV2
        attributes = {"merge_op": "Add", "final_op": "Id"} if native else {}
        reduced = []
        # Loops, not comprehensions, wherever a collective is launched: a
        # comprehension is a frame of its own on the gradient's road.
        for r, (device, tensor) in enumerate(zip(self.devices, tensors)):
            received = self.group.launch(op, self.replicas[r], tensor, self.options, **attributes)
            with tf.device(device):
                if native:
                    reduced.append(tf.squeeze(received, 0))
                else:
                    # TensorFlow's CPU collectives have no reduce-scatter:
                    # each replica receives its rows by an all-to-all and
                    # reduces them itself.
                    reduced.append(
                        tf.reduce_sum(received, 0) if sum_parts is None else sum_parts(received)
                    )
        return reduced

    def all_gather(self, tensors):
        """Every replica's tensor (all of one shape), concatenated along the
        first axis in replica order."""
        gathered = []
        for r, tensor in enumerate(tensors):
            gathered.append(
                self.group.launch(tf.raw_ops.CollectiveGatherV2, self.replicas[r], tensor, self.options)
            )
        return gathered

    def all_to_all(self, tensors):
        """Row j of each tensor (whose first dimension is `size`) to replica
        j, which receives every replica's row for it, in replica order.
        TensorFlow's CPU collectives carry float and int32/int64 values."""
        received = []
        for r, tensor in enumerate(tensors):
            received.append(
                self.group.launch(tf.raw_ops.CollectiveAllToAllV2, self.replicas[r], tensor, self.options)
            )
        return received

    def all_gather_rows(self, tensors):
        """Every replica's rows of each tensor, concatenated in replica
        order, where replicas may hold different numbers of rows.

        Args:
            tensors: for each local replica, a list of tensors that share
                their first dimension.

        Returns:
            For each local replica, the list of gathered tensors.
        """
        # The counts travel first, then every replica's rows padded to the
        # longest; the padding is masked out.
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
        gathered = []
        for position in zip(*padded):
            gathered.append(self.all_gather(list(position)))
        results = []
        for replica, (device, replica_counts) in enumerate(zip(self.devices, all_counts)):
            with tf.device(device):
                longest = tf.reduce_max(replica_counts)
                keep = tf.reshape(tf.range(longest)[None, :] < replica_counts[:, None], [-1])
                results.append([tf.boolean_mask(rows[replica], keep) for rows in gathered])
        return results

    def all_gather_slices(self, slices, weights):
        """Every replica's `tf.IndexedSlices`, weighted: their rows and
        indices, concatenated in replica order.

        Args:
            slices: for each local replica, its `tf.IndexedSlices`.
            weights: for each local replica, the Python number its rows are
                multiplied by; 0 for a replica that adds nothing.

        Returns:
            For each local replica, the gathered `tf.IndexedSlices`.
        """
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

    def _pin(self, per_replica):
        """Each local replica's outputs (any structure) on its device."""
        return [
            tf.nest.map_structure(lambda t, d=device: placement.on(d, t), outputs)
            for device, outputs in zip(self.devices, per_replica)
        ]

    def _has_native_reduce_scatter(self):
        # `CollectiveReduceScatterV2` exists for NCCL only: on CPUs it fails
        # with "did not find collective implementation".
        return self.options.implementation == _CommunicationImplementation.NCCL and all(
            devices_lib.device_type(d) == "GPU" for d in self.devices
        )


def _options_key(options):
    """The fields of `CommunicationOptions` a launch depends on."""
    return (options.bytes_per_pack, options.timeout_seconds, options.implementation)


def _num_elements(tensors):
    """How many elements `tensors` hold together, as a scalar tensor."""
    return tf.add_n([tf.size(t) for t in tensors])
