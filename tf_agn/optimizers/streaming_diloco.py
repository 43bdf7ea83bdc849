"""`StreamingDiLoCo`: DiLoCo that synchronizes one fragment at a time."""

import collections
import functools

import keras
from keras import ops
import numpy as np
import tensorflow as tf

from tf_agn import _compat
from tf_agn.collectives.routing import aggregate
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.optimizers.windowed import in_cross_replica_context


# How layers are split into fragments (`fragments_by_layer`).
FRAGMENT_SPLITS = ("balanced", "strided")


@keras.saving.register_keras_serializable(package="tf_agn")
class StreamingDiLoCo(WindowedOptimizer):
    """Streaming DiLoCo (Douillard et al., 2025).

    DiLoCo whose weights are split into F = `num_fragments` fragments, each
    synchronized at its own step of every window of H = `local_steps`, so
    that an exchange carries 1/F of the weights, and whose exchanges run
    while τ = `sync_delay` local steps compute.

    - Fragments: a variable's layer is its `path` without the last part,
      and a layer's variables travel together. "balanced" (the default)
      evens the fragments' bytes; "strided", the paper's, puts layer j, in
      the order of the layers' first variables, in fragment j mod F
      (`fragments_by_layer`).
    - Schedule (torchft's): fragment p lands after local step k with
      k ≡ (p + 1)·H/F (mod H). Its Δ_p = θ_p − θ_c,p is taken from the
      weights after step k − τ. With τ ≥ 1 its variables are cut into τ
      slices of even bytes (`slices_by_size`; a cut may fall inside a
      variable), and slice j is combined across replicas in the graph of
      step k − τ + 1 + j, beside that step's forward and backward pass: a
      step sends one slice at most (with τ = 0, the fragment after step k).
    - Landing: the outer optimizer steps θ_c,p with gradient −Δ_p (Δ_p not
      divided by H), then θ_p ← α·θ_p + (1 − α)·θ_c,p, α being
      `fragment_update_alpha`. The outer optimizer's `iterations` grows
      once a window, so each fragment's n-th step sees n − 1.

    With F = 1 and τ = 0 it is DiLoCo, `AGN(optimizer, local_steps=H,
    outer_optimizer=..., normalize=False)`. The Δ in flight are optimizer
    variables: saving and `tf_agn.callbacks.BackupAndRestore` keep them; on
    another number of replicas a backup resumes at its step from the
    centers, a slice not yet combined taking the old replicas' mean Δ
    (`tf_agn.resuming.resizing`). Unlike AGN, `fit` commits nothing
    at its end: the replicas keep their weights and the next `fit`
    continues the schedule (`tf_agn.callbacks.EvaluateAtCenter` evaluates
    the centers).

    Example:

    ```python
    with tf_agn.strategies.mirrored().scope():
        model = make_model()
        model.compile(
            optimizer=tf_agn.optimizers.StreamingDiLoCo(
                keras.optimizers.AdamW(1e-3), local_steps=8, num_fragments=2,
                sync_delay=1,
            ),
            loss="sparse_categorical_crossentropy",
        )
    ```

    Args:
        optimizer: the inner Keras optimizer, stepped locally.
        local_steps: H, the local steps per window (an int >= 1).
        num_fragments: F, an int >= 1 that divides H, at most the number of
            layers.
        sync_delay: τ, the local steps an exchange overlaps: an int with
            0 <= τ < H/F.
        fragment_update_alpha: α in [0, 1], the share of its local weights a
            replica keeps when a fragment lands.
        fragment_split: how layers are split into fragments: "balanced"
            (even bytes) or "strided" (the paper's).
        outer_optimizer: applies the combined Δ to the centers; default
            DiLoCo's `SGD(0.7, momentum=0.9, nesterov=True)` (torchft has
            none).
        aggregation_method: how the replicas' Δ are combined.
        compression: how the Δ travel: as `WindowedOptimizer`'s; "int4"
            for the paper's 4-bit exchanges (as integers, not its E3M0
            floats).
        name: the optimizer's name.

    Raises:
        TypeError: if `optimizer` or `outer_optimizer` is not a Keras 3
            optimizer.
        ValueError: for a bad argument of `WindowedOptimizer`, an F that is
            not an int >= 1 dividing H, a τ or α out of range, an unknown
            `fragment_split`; when built, for an F larger than the number
            of layers.
    """

    def __init__(
        self,
        optimizer,
        local_steps,
        num_fragments,
        sync_delay=0,
        fragment_update_alpha=0.0,
        fragment_split="balanced",
        outer_optimizer=None,
        aggregation_method="mean",
        compression=None,
        name=None,
    ):
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
        super().__init__(
            optimizer,
            local_steps,
            aggregation_method=aggregation_method,
            outer_optimizer=outer_optimizer,
            compression=compression,
            name=name,
        )
        _check_schedule(local_steps, num_fragments, sync_delay)
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1]; received {fragment_update_alpha!r}."
            )
        if fragment_split not in FRAGMENT_SPLITS:
            raise ValueError(
                f"fragment_split must be one of {', '.join(map(repr, FRAGMENT_SPLITS))}; "
                f"received {fragment_split!r}."
            )
        self.num_fragments = num_fragments
        self.fragment_split = fragment_split
        self.sync_delay = sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)

    def build(self, var_list):
        if self.built:
            return
        self._fragments = fragments_by_layer(var_list, self.num_fragments, self.fragment_split)
        self._slices = [
            slices_by_size(fragment, var_list, self.sync_delay) for fragment in self._fragments
        ]
        # The pieces in the order of the variables, each with its own
        # compressor state (a whole variable's is named as AGN's).
        self._pieces = sorted(
            (piece for slices in self._slices for pieces in slices for piece in pieces),
            key=lambda piece: (piece.index, piece.start or 0),
        )
        super().build(var_list)
        self._state_of_piece = dict(zip(self._pieces, self._compression_state))
        # Each replica's own Δ from the step that takes it to the step that
        # combines its slice, then the combined Δ until they land; with
        # τ = 0 they land where they are combined.
        self._outer_gradients = [
            self.add_variable_from_reference(v, name="outer_gradient")
            for v in (var_list if self.sync_delay else ())
        ]

    def _commit_schedule(self):
        return (
            ("num_fragments", self.num_fragments),
            ("fragment_split", FRAGMENT_SPLITS.index(self.fragment_split)),
            ("sync_delay", self.sync_delay),
        )

    def apply(self, grads, trainable_variables=None):
        self._record_applied(trainable_variables)
        if self.sync_delay:
            # Before the local step: the exchange reads the weights of the
            # step before and depends on nothing this step computes.
            in_cross_replica_context(self._send_due_slices)
        super().apply(grads, trainable_variables)

    def _compressed_values(self, var_list):
        return [
            variable if piece.start is None else _PieceSpec(variable, piece)
            for piece in self._pieces
            for variable in [var_list[piece.index]]
        ]

    def replica_state_variables(self):
        return super().replica_state_variables() + self._outer_gradients

    def _send_due_slices(self, strategy):
        for part in range(self.sync_delay):
            self._for_each_due_fragment(
                functools.partial(self._send, part=part), self.sync_delay - part, strategy
            )

    def _commit_if_window_ends(self, strategy):
        self._for_each_due_fragment(self._land, 0, strategy)

    def _for_each_due_fragment(self, action, steps_early, strategy):
        """Runs `action(p)` on every replica for the fragment p, if any,
        that lands `steps_early` steps after the steps done so far."""
        subwindow = self.local_steps // self.num_fragments
        position = self.inner_optimizer.iterations % self.local_steps
        # The same conditions in the same order everywhere: every replica
        # and worker runs the same collectives in the same order.
        for fragment in range(self.num_fragments):
            due = ((fragment + 1) * subwindow - steps_early) % self.local_steps
            ops.cond(
                ops.equal(position, due),
                functools.partial(
                    strategy.extended.call_for_each_replica, action, args=(fragment,)
                ),
                lambda: None,
            )

    def _stepped(self, indices):
        """Those of the built positions `indices` whose variables are stepped."""
        applied = self._applied or range(len(self._centers))
        return [i for i in indices if i in applied]

    def _local_delta(self, index):
        return self.commit_delta(_compat.built_variables(self)[index], self._centers[index])

    def _combined(self, pieces, values):
        """The replicas' combined `values` of `pieces`."""
        return aggregate(
            values,
            self.aggregation,
            compressor=self.compressor,
            state=[self._state_of_piece[piece] for piece in pieces],
            step=self.outer_optimizer.iterations,
            counter=self._communication,
        )

    def _send(self, fragment, part):
        """Combines slice `part` of `fragment`'s Δ into its outer gradients,
        in replica context; slice 0 also keeps the local Δ of the others."""
        applied = set(self._stepped(self._fragments[fragment]))
        slices = [
            [piece for piece in pieces if piece.index in applied]
            for pieces in self._slices[fragment]
        ]
        if part == 0:
            for i in sorted({piece.index for pieces in slices[1:] for piece in pieces}):
                self._outer_gradients[i].assign(self._local_delta(i))
            source = self._local_delta
        else:
            source = lambda i: self._outer_gradients[i].value  # noqa: E731
        pieces = slices[part]
        if not pieces:  # fewer elements than slices
            return
        values = [piece.of(source(piece.index)) for piece in pieces]
        for piece, combined in zip(pieces, self._combined(pieces, values)):
            outer_gradient = self._outer_gradients[piece.index]
            outer_gradient.assign(piece.placed(combined, outer_gradient.value))

    def _land(self, fragment):
        """Steps `fragment`'s centers and mixes them into the weights, in
        replica context."""
        indices = self._stepped(self._fragments[fragment])
        if self.sync_delay:
            combined = [self._outer_gradients[i].value for i in indices]
        else:
            combined = self._combined(
                [Piece(i) for i in indices], [self._local_delta(i) for i in indices]
            )
        centers = [self._centers[i] for i in indices]
        _compat.update_step_in_place(
            self.outer_optimizer,
            [ops.negative(delta) for delta in combined],
            centers,
            self.outer_optimizer.learning_rate,
        )
        if fragment == self.num_fragments - 1:
            self.outer_optimizer.iterations.assign_add(1)
        built = _compat.built_variables(self)
        alpha = self.fragment_update_alpha
        for i, center in zip(indices, centers):
            # As torch's lerp: exactly the center when α = 0.
            mixed = ops.add(center, ops.multiply(alpha, ops.subtract(built[i], center)))
            built[i].assign(mixed)

    def resume_from_centers(self):
        # Not back to the window's start: each fragment's center is its last
        # landing, so the schedule goes on from the backup's step and a Δ in
        # flight lands when due (rolled back, a fragment that landed since
        # would land twice, and the Δ in flight would be lost).
        return

    def finalize_variable_values(self, var_list):
        # Not WindowedOptimizer's partial commit: a fragment may be in flight.
        super(WindowedOptimizer, self).finalize_variable_values(var_list)

    def get_config(self):
        config = super().get_config()
        del config["reset_inner_state"]
        config.update(
            num_fragments=self.num_fragments,
            sync_delay=self.sync_delay,
            fragment_update_alpha=self.fragment_update_alpha,
            fragment_split=self.fragment_split,
        )
        return config


def fragments_by_layer(variables, num_fragments, split):
    """The positions in `variables` of each fragment's variables, a layer's
    variables in one fragment, in the order of `variables`.

    - "strided" (the paper's): layer j, in the order of the layers' first
      variables, is in fragment j mod F.
    - "balanced": the layers, largest first (in bytes; ties in model
      order), go each to the fragment with the fewest bytes so far (ties:
      fewer layers, then the lower number); the fragments are then
      numbered in the order of their first layers. The largest fragment
      holds at most total/F + (1 − 1/F)·(largest layer) bytes: a layer is
      never split, so a layer larger than total/F makes its fragment that
      large.

    For example, layers of 20, 16, 15 and 8 bytes (in model order 16, 20,
    15, 8) in 3 fragments: balanced [16], [20], [15, 8]; strided [16, 8],
    [20], [15].

    Raises:
        ValueError: if there are fewer layers than `num_fragments`.
    """
    layers = list(dict.fromkeys(_layer_of(v) for v in variables))
    if len(layers) < num_fragments:
        raise ValueError(
            f"num_fragments={num_fragments} is more than the {len(layers)} layers "
            f"with variables to optimize ({', '.join(layers)}); pass at most {len(layers)}."
        )
    if split == "strided":
        fragment_of_layer = {layer: j % num_fragments for j, layer in enumerate(layers)}
    else:
        size = dict.fromkeys(layers, 0)
        for v in variables:
            size[_layer_of(v)] += _bytes(v)
        fragment_of_layer = {
            layer: f
            for f, members in enumerate(_balanced(size, num_fragments))
            for layer in members
        }
    return [
        [i for i, v in enumerate(variables) if fragment_of_layer[_layer_of(v)] == fragment]
        for fragment in range(num_fragments)
    ]


class Piece(collections.namedtuple("Piece", ["index", "start", "stop"], defaults=(None, None))):
    """Variable `index` of a model, or the elements `start` to `stop` of
    its flattened value (both None: all of it)."""

    def num_elements(self, variable):
        """The elements of this piece of `variable`."""
        if self.start is None:
            return int(np.prod(variable.shape))
        return self.stop - self.start

    def of(self, value):
        """This piece of `value`, a value of the variable."""
        return value if self.start is None else tf.reshape(value, [-1])[self.start:self.stop]

    def placed(self, piece_value, value):
        """`value` with this piece replaced by `piece_value`."""
        if self.start is None:
            return piece_value
        flat = tf.reshape(value, [-1])
        return tf.reshape(
            tf.concat([flat[:self.start], piece_value, flat[self.stop:]], 0), tf.shape(value)
        )


class _PieceSpec:
    """What `add_compressor_state` reads of a variable, for a piece of it."""

    def __init__(self, variable, piece):
        self.path = f"{variable.path}_{piece.start}_{piece.stop}"
        self.shape = (piece.stop - piece.start,)
        self.dtype = variable.dtype


def slices_by_size(indices, variables, num_slices):
    """The variables at positions `indices` in `variables` (a fragment's),
    cut into `num_slices` (at least 1) slices of even bytes.

    The variables are laid end to end in the order of `indices`, flattened,
    and cut where slice j starts, at byte ⌈j·total/num_slices⌉ rounded up
    to a whole element: a slice holds at most one element more than its
    share, and at most two pieces of variables (`Piece`) are not whole.

    For example, variables of 12, 4, 12 and 3 float32 values in 2 slices:
    [0, 1], [2, 3] whole; of 16, 4, 6 and 2: the first's 14 first values,
    then its last 2 and the rest.

    Returns:
        One list of `Piece`s per slice, in the order of `indices`; a slice
        is empty where the variables hold fewer elements than slices.
    """
    num_slices = max(num_slices, 1)
    sizes = [int(np.prod(variables[i].shape)) for i in indices]
    element_bytes = [tf.as_dtype(variables[i].dtype).size for i in indices]
    total = sum(n * b for n, b in zip(sizes, element_bytes))
    cuts = [-(-total * j // num_slices) for j in range(num_slices + 1)]
    slices = [[] for _ in range(num_slices)]
    offset = 0  # bytes before the variable
    for i, size, width in zip(indices, sizes, element_bytes):
        for j in range(num_slices):
            # The elements that start at or after cut j and before cut j + 1.
            start, stop = (
                min(max(-(-(cut - offset) // width), 0), size) for cut in cuts[j:j + 2]
            )
            if stop > start:
                slices[j].append(Piece(i) if stop - start == size else Piece(i, start, stop))
        offset += size * width
    return slices


def _balanced(sizes, num_groups):
    """`sizes`' keys (in their order) split into `num_groups` lists of even
    total size: largest first (ties in order), each to the group with the
    smallest total so far (ties: fewer members, then the lower number);
    the groups numbered in the order of their first members."""
    order = list(sizes)
    groups = [[] for _ in range(num_groups)]
    loads = [0] * num_groups
    for key in sorted(order, key=lambda key: -sizes[key]):  # stable: in order
        lightest = min(range(num_groups), key=lambda g: (loads[g], len(groups[g]), g))
        groups[lightest].append(key)
        loads[lightest] += sizes[key]
    return sorted(
        (sorted(members, key=order.index) for members in groups),
        key=lambda members: order.index(members[0]),
    )


def _bytes(variable):
    return tf.as_dtype(variable.dtype).size * int(np.prod(variable.shape))


def _layer_of(variable):
    """The path of the layer that owns `variable`."""
    return variable.path.rpartition("/")[0] or variable.path


def _check_schedule(local_steps, num_fragments, sync_delay):
    """Raises unless F divides H and 0 <= τ < H/F."""
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be an int >= 1; received {num_fragments!r}.")
    if local_steps % num_fragments:
        raise ValueError(
            f"num_fragments={num_fragments} must divide local_steps={local_steps}: "
            "each fragment lands once every local_steps steps, one every "
            "local_steps / num_fragments."
        )
    subwindow = local_steps // num_fragments
    if (
        isinstance(sync_delay, bool)
        or not isinstance(sync_delay, int)
        or not 0 <= sync_delay < subwindow
    ):
        raise ValueError(
            f"sync_delay must be an int in [0, local_steps / num_fragments) = "
            f"[0, {subwindow}) (local_steps={local_steps}, num_fragments="
            f"{num_fragments}); received {sync_delay!r}."
        )
