"""Compressors with error feedback: what compression drops now travels later.

Each replica keeps a residual e of what compression dropped and adds it to
the next value it sends (Seide et al. 2014; Karimireddy et al. 2019):

    m = g + e;   send C(m);   e = m - C(m)

The residuals are optimizer variables (`state_spec`), so `.keras` files and
`tf_agn.callbacks.BackupAndRestore` save them.
"""

import functools

import tensorflow as tf

from tf_agn.collectives import packing
from tf_agn.compression.compressor import Compressor

class ErrorFeedbackCompressor(Compressor):
    """Base class of compressors that keep per-replica state.

    Subclasses set `name` and `patterns` and implement `state_spec`,
    `combine`, `wire_bytes` and `encode`/`decode` (`residual` and
    `state_owing` where the defaults do not fit);
    `tf_agn.compression.Int8` is a complete example.

    Args:
        error_feedback: whether to keep each replica's residual and send it
            with the next value. Without it, what compression drops is lost.
        start_step: the number of optimizer steps (`optimizer.iterations`:
            applied steps, or commits) during which values travel
            uncompressed, as PyTorch's `start_powerSGD_iter`. 0 (the
            default) compresses from the first step.

    Raises:
        ValueError: for a `start_step` that is not an int >= 0.
    """

    patterns = {"all_reduce": ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}

    # start_step=0, not PyTorch's 1000, which comes from DDP rebuilding its
    # buckets after the first iteration (benchmarks/README.md measures step 0).
    def __init__(self, error_feedback=True, start_step=0):
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(
                f"start_step must be an int >= 0; received {start_step!r}."
            )
        self.error_feedback = bool(error_feedback)
        self.start_step = start_step

    def state_spec(self, shape):
        raise NotImplementedError

    def residual(self, state):
        """The whole residual `state` keeps (maybe as factors), or None
        without error feedback."""
        return state.get("residual")

    def state_owing(self, state, residual):
        """`state` with `residual` (an array) as what the replica owes, for a
        resumed run on another replica count (`tf_agn.resuming.resizing`)."""
        return dict(state, residual=residual)

    def get_config(self):
        return {"error_feedback": self.error_feedback, "start_step": self.start_step}


def compiled(function, jit_compile, device):
    """`function` compiled with XLA on `device` where it can be, else a graph
    function; cached, so it traces once per distinct Python arguments."""
    return _compiled(function, packing.use_xla(jit_compile, device))


@functools.cache
def _compiled(function, jit_compile):
    return tf.function(function, jit_compile=jit_compile, autograph=False)
