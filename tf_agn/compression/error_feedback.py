"""Compressors with error feedback: what compression drops now travels later.

A lossy compressor C that sends C(g) instead of g loses g - C(g) every
step. Error feedback (Seide et al. 2014; Karimireddy et al. 2019) keeps
that loss on each replica, in a residual e, and adds it to the next value
it sends:

    m = g + e;   send C(m);   e = m - C(m)

so nothing is lost, only delayed: after T steps, the applied updates plus
the replicas' residuals sum exactly to the true gradients. This is what
lets int8 (`tf_agn.compression.Int8`) and rank-r PowerSGD
(`tf_agn.compression.PowerSGD`) train to the accuracy of uncompressed
training.

The residuals (and PowerSGD's warm-started Q) are per-replica state; a
compressor may keep a residual as factors it is cheaper to keep than to
write out (PowerSGD does), and `residual(state)` gives it whole. They live
with the optimizer's state, as optimizer variables (`state_spec`;
`tf_agn.optimizers.compression_state`), so `.keras` files and
`tf_agn.callbacks.BackupAndRestore` save them.

A compressor is written once, for every transport: `combine` sees the
values of all local replicas and a `tf_agn.transports` transport, whose
patterns (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`)
take one tensor per local replica and return one per local replica.
Between them runs the compressor's arithmetic, in
`tf.function(jit_compile=True)` calls on each replica's device.
"""

import collections
import functools

import tensorflow as tf

from tf_agn import packing
from tf_agn.finite import all_finite

# The shape of one piece of per-replica state; its initializer: a Keras
# initializer name or a callable `(shape, dtype) -> tensor` that gives the
# same value on every replica of every worker; and whether it is `owed`:
# part of what a replica owes, linearly (the residual, or a factor of it
# that differs between replicas), which a `.keras` file keeps as the
# replicas' sum and loading shares out equally. State alike on every
# replica (PowerSGD's P^ and Q) is not owed: it is kept as it is.
StateSpec = collections.namedtuple(
    "StateSpec", ["shape", "initializer", "owed"], defaults=[False]
)


class ErrorFeedbackCompressor:
    """Base class of compressors that keep per-replica state.

    Subclasses set `name` and implement `state_spec`, `combine` and
    `wire_bytes` (and `residual`, if they keep the residual other than as
    a state named "residual", and `payload_bytes`, if `combine`'s buffers
    hold more than each value's `wire_bytes`); `tf_agn.compression.Int8`
    is a complete example. Values
    travel compressed only where `acts_on` their dtype (float32); the
    others travel exactly.

    Args:
        error_feedback: whether to keep each replica's residual and add it
            to the next value it sends. Without it, what compression drops
            is lost: useful only to measure what error feedback buys.
        start_step: the number of optimizer steps (`optimizer.iterations`:
            with gradient accumulation, applied steps, not micro-steps;
            for a windowed optimizer, commits) during which values travel
            uncompressed and the state is left alone, as PyTorch's
            `start_powerSGD_iter`: early gradients change fastest, and
            compressing them costs the most accuracy. 0 (the default)
            compresses from the first step; where the first steps'
            accuracy matters, about a tenth of the training steps is
            PyTorch's advice.

    Attributes:
        name: a short string naming the compressor; every worker's
            compressor must have the same one.
        patterns: the transport patterns `combine` uses
            (`tf_agn.transports`); by default any of them. It tells the
            byte counts whether a strategy without tf_agn's ops gathers
            whole buffers for a reduce-scatter or an all-to-all.

    Raises:
        ValueError: for a `start_step` that is not an int >= 0.
    """

    name = None
    patterns = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

    # start_step=0: with error feedback nothing compression drops is lost,
    # and benchmarks/README.md measures PowerSGD rank 4 within a point of
    # uncompressed accuracy after 300 steps compressed from step 0.
    # PyTorch's default of 1000, and its need for more than 1 with error
    # feedback, come from DDP rebuilding its gradient buckets after the
    # first iteration, which has no counterpart here.
    def __init__(self, error_feedback=True, start_step=0):
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(
                f"start_step must be an int >= 0; received {start_step!r}."
            )
        self.error_feedback = bool(error_feedback)
        self.start_step = start_step

    def acts_on(self, dtype):
        """Whether values of `dtype` travel compressed."""
        return dtype == tf.float32

    def state_spec(self, shape):
        """The per-replica state kept for a value of `shape`.

        Args:
            shape: a fully defined `tf.TensorShape`.

        Returns:
            A dict from a state's name (a suffix of its variable's name) to
            its `StateSpec`; empty for values kept without state.
        """
        raise NotImplementedError

    def residual(self, state):
        """What a replica still owes: the part of what it sent that
        compression dropped, which its next step sends.

        Args:
            state: one value's state, as `state_spec` describes it.

        Returns:
            A tensor of the value's shape, or None without error feedback.
        """
        return state.get("residual")

    def state_owing(self, state, residual):
        """`state` with `residual` as what the replica owes: how a resumed
        run on another number of replicas shares out the old replicas'
        residuals (`tf_agn.resizing`).

        Args:
            state: one value's state, as `state_spec` describes it.
            residual: an array of the value's shape.

        Returns:
            The state, as a dict of arrays.
        """
        return dict(state, residual=residual)

    def combine(self, transport, values, states, scales, bytes_per_pack, jit_compile):
        """Sums every replica's values, compressed, and updates the state.

        Args:
            transport: the `tf_agn.transports` transport to send through.
            values: for each local replica, its list of float32 tensors.
            states: for each local replica, a list with one dict per value,
                holding the tensors `state_spec` asked for.
            scales: for each local replica, a Python float its values are
                multiplied by before they are compressed (0 for a replica
                that contributes nothing).
            bytes_per_pack: the most bytes one buffer should hold.
            jit_compile: whether to compile the arithmetic with XLA.

        Returns:
            `(combined, new_states)`, laid out like `values` and `states`:
            every replica's `combined` is the same sum. A compressor that
            can tell cheaply whether that sum is finite (from the small
            buffers it sent, say) may add a third item, for each local
            replica a scalar boolean tensor that is True exactly where
            every combined value is finite; else `combine_kept_finite`
            reads the combined values to find out.
        """
        raise NotImplementedError

    def encode(self, value, state):
        """Compresses one value for a trip to a single receiver (an
        asynchronous commit to a parameter server), with error feedback.

        Args:
            value: a float32 tensor.
            state: its state, as `state_spec` describes it.

        Returns:
            `(payload, new_state)`: a tuple of the tensors that travel, and
            the sender's new state.
        """
        raise NotImplementedError

    def decode(self, payload, shape, dtype):
        """The value `encode` made `payload` of, on the receiver; as
        `tf_agn.compression.Compressor.decode`."""
        raise NotImplementedError

    def wire_bytes(self, shape, dtype):
        """The bytes one replica sends for a value of `shape` and `dtype`
        that this compressor acts on, taken alone: what compression makes
        of it, before any padding `combine` adds to its buffers
        (`payload_bytes` counts that).

        Args:
            shape: a fully defined `tf.TensorShape`.
            dtype: the value's `tf.DType`.

        Returns:
            An int.
        """
        raise NotImplementedError

    def payload_bytes(self, shapes, num_replicas, bytes_per_pack):
        """The bytes one replica puts in the buffers it sends when `combine`
        combines float32 values of `shapes`: what
        `tf_agn.CommunicationCounter` counts, from `start_step` on.

        By default the sum of the values' `wire_bytes`, which is right for
        buffers that hold each value's payload and nothing else
        (PowerSGD's). A compressor that pads its buffers counts the padding
        (`tf_agn.compression.Int8`).

        Args:
            shapes: the values' fully defined `tf.TensorShape`s, in the
                order `combine` receives them.
            num_replicas: the replicas of all workers (`transport.size`).
            bytes_per_pack: as `combine` takes it.

        Returns:
            An int.
        """
        del num_replicas, bytes_per_pack  # Nothing is padded.
        return sum(self.wire_bytes(shape, tf.float32) for shape in shapes)

    def get_config(self):
        """The constructor arguments, as a dict of Python values."""
        return {"error_feedback": self.error_feedback, "start_step": self.start_step}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({arguments})"


def combine_kept_finite(compressor, transport, values, states, weights):
    """`compressor.combine`, keeping each replica's old state where the
    combined values are not finite.

    A non-finite gradient (an overflow under mixed precision, a window that
    accumulation skips) must not turn every later step's residual into
    NaN. The combined values are the same on every replica, so every
    replica decides alike.

    Args:
        compressor: an `ErrorFeedbackCompressor`.
        transport, values, states, weights: as
            `ErrorFeedbackCompressor.combine` takes them.

    Returns:
        `(combined, new_states)`, as `combine` returns them.
    """
    combined, new_states, *finite = compressor.combine(
        transport, values, states, weights, transport.bytes_per_pack, transport.jit_compile
    )
    finite = finite[0] if finite else [None] * len(combined)
    guarded = []
    for device, replica_combined, new, old, replica_finite in zip(
        transport.devices, combined, new_states, states, finite
    ):
        with tf.device(device):
            if replica_finite is None:
                replica_finite = all_finite(replica_combined)
            # A cond picks one of the two states whole, where an
            # elementwise select would read both and write a copy.
            if tf.nest.flatten(new):
                new = tf.cond(replica_finite, lambda new=new: new, lambda old=old: old)
            guarded.append(new)
    return combined, guarded


def compiled(function, jit_compile, device):
    """`function` as an XLA-compiled call on `device`, or as a graph
    function where XLA cannot compile for it (or `jit_compile` is False).
    One function per (function, compilation): it traces once per
    distinct Python arguments (shapes, scales, layouts)."""
    return _compiled(function, packing.use_xla(jit_compile, device))


@functools.cache
def _compiled(function, jit_compile):
    return tf.function(function, jit_compile=jit_compile, autograph=False)
