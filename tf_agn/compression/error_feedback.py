"""Compressors with error feedback: what compression drops now travels later.

Each replica keeps a residual e of what compression dropped and adds it to
the next value it sends (Seide et al. 2014; Karimireddy et al. 2019):

    m = g + e;   send C(m);   e = m - C(m)

The residuals are optimizer variables (`state_spec`), so `.keras` files and
`tf_agn.callbacks.BackupAndRestore` save them.
"""

import collections
import functools

import tensorflow as tf

from tf_agn import packing
from tf_agn.finite import all_finite

# One piece of per-replica state. `initializer`: a Keras initializer name or
# `(shape, dtype) -> tensor`, alike on every replica. `owed`: a linear part of
# the residual, which a `.keras` file keeps summed and loading shares out.
StateSpec = collections.namedtuple(
    "StateSpec", ["shape", "initializer", "owed"], defaults=[False]
)


class ErrorFeedbackCompressor:
    """Base class of compressors that keep per-replica state.

    Subclasses set `name` and implement `state_spec`, `combine` and
    `wire_bytes` (`residual` and `payload_bytes` where the defaults do not
    fit); `tf_agn.compression.Int8` is a complete example. Only float32
    values (`acts_on`) travel compressed.

    Args:
        error_feedback: whether to keep each replica's residual and send it
            with the next value. Without it, what compression drops is lost.
        start_step: the number of optimizer steps (`optimizer.iterations`:
            applied steps, or commits) during which values travel
            uncompressed, as PyTorch's `start_powerSGD_iter`. 0 (the
            default) compresses from the first step.

    Attributes:
        name: a short string; every worker's compressor must have the same.
        patterns: the transport patterns `combine` uses.

    Raises:
        ValueError: for a `start_step` that is not an int >= 0.
    """

    name = None
    patterns = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

    # start_step=0, not PyTorch's 1000, which comes from DDP rebuilding its
    # buckets after the first iteration (benchmarks/README.md measures step 0).
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
        """A dict from state name (a variable name suffix) to `StateSpec`
        for a value of the fully defined `shape`."""
        raise NotImplementedError

    def residual(self, state):
        """The whole residual `state` keeps (maybe as factors), or None
        without error feedback."""
        return state.get("residual")

    def state_owing(self, state, residual):
        """`state` with `residual` (an array) as what the replica owes, for a
        resumed run on another replica count (`tf_agn.resizing`)."""
        return dict(state, residual=residual)

    def combine(self, transport, values, states, scales, bytes_per_pack, jit_compile):
        """Sums every replica's values, compressed, and updates the state.

        Args:
            transport: the `tf_agn.transports` transport to send through.
            values: for each local replica, its list of float32 tensors.
            states: for each local replica, a list with one dict per value,
                holding the tensors `state_spec` asked for.
            scales: for each local replica, a Python float its values are
                multiplied by before compression (0: contributes nothing).
            bytes_per_pack: the most bytes one buffer should hold.
            jit_compile: whether to compile the arithmetic with XLA.

        Returns:
            `(combined, new_states)`, laid out like `values` and `states`.
            It may add a third item: per local replica, a scalar bool that
            is True exactly when the combined sum is finite.
        """
        raise NotImplementedError

    def encode(self, value, state):
        """`(payload, new_state)` for one float32 value's trip to a single
        receiver (an asynchronous commit to a parameter server)."""
        raise NotImplementedError

    def decode(self, payload, shape, dtype):
        """The value `encode` made `payload` of, on the receiver."""
        raise NotImplementedError

    def wire_bytes(self, shape, dtype):
        """The bytes one replica sends for one value, without padding."""
        raise NotImplementedError

    def payload_bytes(self, shapes, num_replicas, bytes_per_pack):
        """The bytes one replica's `combine` buffers hold for float32
        values of `shapes`, padding included (`tf_agn.CommunicationCounter`)."""
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
    combined values are not finite (a mixed precision overflow must not
    make every later residual NaN)."""
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
            # A cond, not a select, which would read both states and copy.
            if tf.nest.flatten(new):
                new = tf.cond(replica_finite, lambda new=new: new, lambda old=old: old)
            guarded.append(new)
    return combined, guarded


def compiled(function, jit_compile, device):
    """`function` compiled with XLA on `device` where it can be, else a graph
    function; cached, so it traces once per distinct Python arguments."""
    return _compiled(function, packing.use_xla(jit_compile, device))


@functools.cache
def _compiled(function, jit_compile):
    return tf.function(function, jit_compile=jit_compile, autograph=False)
