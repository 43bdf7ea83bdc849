"""StreamingDiLoCo under a real 4-replica MirroredStrategy, against a numpy
reference of its fragments, schedule, delay and mixing, and against AGN."""

import heapq

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_agn
from conftest import DEVICES
from conftest import NUM_REPLICAS
from mlp import BATCH
from mlp import LEARNING_RATE
from test_agn import RecordStates
from test_restarts import Interrupt
from tf_agn.optimizers import AGN
from tf_agn.optimizers import StreamingDiLoCo
from tf_agn.optimizers.streaming_diloco import Piece
from tf_agn.optimizers.streaming_diloco import fragments_by_layer
from tf_agn.optimizers.streaming_diloco import slices_by_size

# A tanh MLP of 4 layers: 3 -> 4 -> 4 -> 3 -> 2, the last one linear.
WIDTHS = [3, 4, 4, 3, 2]
OUTER_RATE, OUTER_MOMENTUM = 0.7, 0.9
ADAM_RATE = 0.05


def initial_weights():
    rng = np.random.RandomState(1)
    weights = []
    for fan_in, fan_out in zip(WIDTHS[:-1], WIDTHS[1:]):
        weights += [rng.randn(fan_in, fan_out) * 0.5, rng.randn(fan_out) * 0.1]
    return [w.astype("float32") for w in weights]


def mlp_data(steps):
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH * steps, WIDTHS[0]).astype("float32")
    y = np.stack([np.sin(x.sum(1)), x[:, 0] * x[:, 1]], 1).astype("float32")
    return x, y


def build_model(optimizer, devices=DEVICES, **compile_kwargs):
    with tf_agn.strategies.mirrored(devices).scope():
        model = keras.Sequential(
            [keras.Input((WIDTHS[0],))]
            + [keras.layers.Dense(width, activation="tanh") for width in WIDTHS[1:-1]]
            + [keras.layers.Dense(WIDTHS[-1])]
        )
        model.set_weights(initial_weights())
        model.compile(optimizer(), loss="mse", **compile_kwargs)
    return model


def fit_recording(optimizer, steps, devices=DEVICES):
    """Every replica's weights and the centers after each of `steps` steps."""
    model = build_model(optimizer, devices)
    x, y = mlp_data(steps)
    record = RecordStates()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[record])
    return model, record.states


def mlp_gradients(weights, x, y):
    """Backpropagation of the mean squared error of the tanh MLP."""
    activations = [x]
    for layer in range(0, len(weights), 2):
        out = activations[-1] @ weights[layer] + weights[layer + 1]
        activations.append(np.tanh(out) if layer + 2 < len(weights) else out)
    upstream = 2 * (activations[-1] - y) / y.size
    grads = [None] * len(weights)
    for layer in reversed(range(0, len(weights), 2)):
        if layer + 2 < len(weights):
            upstream = upstream * (1 - activations[layer // 2 + 1] ** 2)
        grads[layer] = activations[layer // 2].T @ upstream
        grads[layer + 1] = upstream.sum(0)
        upstream = upstream @ weights[layer].T
    return grads


def nesterov_step(center, delta, momentum, count):
    """Keras's SGD(0.7, momentum=0.9, nesterov=True) with gradient −delta."""
    del count
    momentum = OUTER_MOMENTUM * (0.0 if momentum is None else momentum) + OUTER_RATE * delta
    return center + OUTER_MOMENTUM * momentum + OUTER_RATE * delta, momentum


def adam_step(center, delta, moments, count):
    """Keras's Adam(ADAM_RATE) with gradient −delta, at step `count` + 1."""
    m, v = (0.0, 0.0) if moments is None else moments
    m = m + (-delta - m) * (1 - 0.9)
    v = v + (delta**2 - v) * (1 - 0.999)
    rate = ADAM_RATE * np.sqrt(1 - 0.999 ** (count + 1)) / (1 - 0.9 ** (count + 1))
    return center - m * rate / (np.sqrt(v) + 1e-7), (m, v)


def streaming_reference(
    x, y, local_steps, fragments, sync_delay, alpha, steps, outer_step,
    num_replicas=NUM_REPLICAS, resize=None,
):
    """Per-replica weights and centers after each step, in float64: inner
    SGD(LEARNING_RATE); fragment p's mean Δ taken after step k − τ and
    landed after step k ≡ (p + 1)·H/F (mod H) by `outer_step`, given how
    many times p landed before, then θ ← α·θ + (1 − α)·θ_c. With
    `resize=(step, n)`, after `step` the run goes on on n replicas, each
    starting from the centers, the Δ in flight and the outer state kept."""
    center = [w.astype("float64") for w in initial_weights()]
    replicas = [list(center) for _ in range(num_replicas)]
    outer_state = [None] * len(center)
    landed = [0] * len(fragments)
    subwindow = local_steps // len(fragments)
    sent, history = {}, []

    def mean_delta(fragment):
        return {i: np.mean([r[i] - center[i] for r in replicas], 0) for i in fragments[fragment]}

    for step in range(1, steps + 1):
        if resize and step == resize[0] + 1:
            replicas = [list(center) for _ in range(resize[1])]
        shard = BATCH // len(replicas)
        for p in range(len(fragments)):
            if sync_delay and (step - 1) % local_steps == ((p + 1) * subwindow - sync_delay) % local_steps:
                sent[p] = mean_delta(p)
        for r in range(len(replicas)):
            rows = slice((step - 1) * BATCH + r * shard, (step - 1) * BATCH + (r + 1) * shard)
            grads = mlp_gradients(replicas[r], x[rows], y[rows])
            replicas[r] = [w - LEARNING_RATE * g for w, g in zip(replicas[r], grads)]
        for p in range(len(fragments)):
            if step % local_steps != ((p + 1) * subwindow) % local_steps:
                continue
            deltas = sent.pop(p) if sync_delay else mean_delta(p)
            for i, delta in deltas.items():
                center[i], outer_state[i] = outer_step(center[i], delta, outer_state[i], landed[p])
                for weights in replicas:
                    weights[i] = center[i] + alpha * (weights[i] - center[i])
            landed[p] += 1
        history.append(([list(w) for w in replicas], list(center)))
    return history


def assert_matches_reference(
    local_steps, num_fragments, sync_delay, alpha, fragments, steps, make_outer=lambda: None,
    outer_step=nesterov_step, fragment_split="balanced",
):
    x, y = mlp_data(steps)
    _, states = fit_recording(
        lambda: StreamingDiLoCo(
            keras.optimizers.SGD(LEARNING_RATE),
            local_steps=local_steps,
            num_fragments=num_fragments,
            sync_delay=sync_delay,
            fragment_update_alpha=alpha,
            fragment_split=fragment_split,
            outer_optimizer=make_outer(),  # None: the default
        ),
        steps,
    )
    reference = streaming_reference(
        x, y, local_steps, fragments, sync_delay, alpha, steps, outer_step
    )
    assert_states_match(states, reference)
    # The replicas explored apart: every exchange mattered.
    assert not np.allclose(states[-2][0][0][0], states[-2][0][1][0])


def assert_states_match(states, reference, first_step=1):
    """`fit_recording`'s states after each step are `reference`'s."""
    for step, ((replicas, center), (want_replicas, want_center)) in enumerate(
        zip(states, reference, strict=True), first_step
    ):
        for i, (got, want) in enumerate(zip(center, want_center, strict=True)):
            np.testing.assert_allclose(
                got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {step}, center {i}"
            )
        for r, pair in enumerate(zip(replicas, want_replicas, strict=True)):
            for i, (got, want) in enumerate(zip(*pair, strict=True)):
                np.testing.assert_allclose(
                    got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {step}, replica {r}, {i}"
                )


def test_four_fragments_land_one_a_step_in_layer_order():
    # H = 4, F = 4: layer j (variables 2j, 2j + 1) lands after steps j + 1, j + 5.
    assert_matches_reference(4, 4, 0, 0.0, [[0, 1], [2, 3], [4, 5], [6, 7]], steps=8)


def test_fragments_are_strided_and_land_sync_delay_steps_after_sending():
    # H = 6, F = 2, τ = 2: layers 0 and 2 are fragment 0, sent after step 1
    # and landed after step 3; layers 1 and 3 sent after 4, landed after 6.
    assert_matches_reference(6, 2, 2, 0.0, [[0, 1, 4, 5], [2, 3, 6, 7]], steps=12)


@pytest.mark.parametrize(
    "fragment_split, fragments",
    [
        # Layers of 16, 20, 15 and 8 values. Balanced: 20, 16 and 15 start
        # a fragment each, 8 joins 15's.
        ("balanced", [[0, 1], [2, 3], [4, 5, 6, 7]]),
        ("strided", [[0, 1, 6, 7], [2, 3], [4, 5]]),
    ],
)
def test_three_fragments_split_balanced_or_strided(fragment_split, fragments):
    assert_matches_reference(6, 3, 1, 0.0, fragments, steps=12, fragment_split=fragment_split)


def test_fragment_update_alpha_mixes_local_weights_in():
    assert_matches_reference(4, 2, 1, 0.5, [[0, 1, 4, 5], [2, 3, 6, 7]], steps=8)


def test_an_outer_adam_counts_each_fragments_own_steps():
    # Its bias correction at a fragment's n-th landing uses step n.
    assert_matches_reference(
        4, 2, 1, 0.0, [[0, 1, 4, 5], [2, 3, 6, 7]], steps=12,
        make_outer=lambda: keras.optimizers.Adam(ADAM_RATE), outer_step=adam_step,
    )


def test_one_fragment_without_delay_is_agn_with_an_undivided_commit_bitwise():
    # The same ops in the same order: one packed all-reduce of θ − θ_c, the
    # outer step on θ_c, then θ ← θ_c.
    def outer():
        return keras.optimizers.SGD(OUTER_RATE, momentum=OUTER_MOMENTUM, nesterov=True)

    steps = 6
    _, streaming = fit_recording(
        lambda: StreamingDiLoCo(
            keras.optimizers.Adam(0.01), local_steps=3, num_fragments=1, outer_optimizer=outer()
        ),
        steps,
    )
    _, diloco = fit_recording(
        lambda: AGN(keras.optimizers.Adam(0.01), local_steps=3, outer_optimizer=outer(),
                    normalize=False),
        steps,
    )
    for step, ((got_replicas, got_center), (want_replicas, want_center)) in enumerate(
        zip(streaming, diloco, strict=True), 1
    ):
        for got, want in zip(got_center, want_center, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        for got, want in zip(got_replicas, want_replicas, strict=True):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"step {step}")
    assert not np.array_equal(streaming[-1][1][0], initial_weights()[0])


@pytest.mark.parametrize("sync_delay", [1, 2])
def test_an_exchange_depends_on_nothing_its_step_computes(sync_delay):
    # In the traced step, the conditional exchanges of the two fragments'
    # τ slices (created first) have no forward or backward op among their
    # inputs, so the all-reduce can run beside them; the landings come after.
    strategy = tf_agn.strategies.mirrored(DEVICES[:2])
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
        )
        optimizer = StreamingDiLoCo(
            keras.optimizers.SGD(0.1), local_steps=6, num_fragments=2, sync_delay=sync_delay
        )
        optimizer.build(model.trainable_variables)
    x, y = (tf.constant(a) for a in mlp_data(1))

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply(tape.gradient(loss, model.trainable_variables))

        strategy.run(replica)

    graph = step.get_concrete_function().graph
    conditionals = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    computes = [
        [o.name for o in ancestors(op) if o.type in ("MatMul", "Tanh", "TanhGrad")]
        for op in conditionals
    ]
    sends = 2 * sync_delay
    assert len(computes) == sends + 2
    assert computes[:sends] == [[]] * sends
    assert all(computes[sends:])


def ancestors(op):
    """Every op `op` depends on, through inputs or control inputs."""
    seen, pending = set(), [op]
    while pending:
        current = pending.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                pending.append(parent)
    return seen


def test_several_steps_per_execution_change_nothing():
    def fit_state(steps_per_execution):
        model = build_model(
            lambda: StreamingDiLoCo(
                keras.optimizers.SGD(LEARNING_RATE), local_steps=6, num_fragments=2, sync_delay=2
            ),
            steps_per_execution=steps_per_execution,
        )
        model.fit(*mlp_data(12), batch_size=BATCH, shuffle=False, verbose=0)
        return tf_agn.replica_weights(model.variables + model.optimizer.variables)

    for got, want in zip(fit_state(3), fit_state(1), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_exchanges_and_bytes_are_one_fragment_at_a_time():
    model, _ = fit_recording(
        lambda: StreamingDiLoCo(
            keras.optimizers.SGD(LEARNING_RATE), local_steps=4, num_fragments=2, sync_delay=1
        ),
        steps=8,
    )
    fragment_sizes = [3 * 4 + 4 + 4 * 3 + 3, 4 * 4 + 4 + 3 * 2 + 2]
    stats = model.optimizer.communication_stats()
    assert stats["all_reduce_calls"] == 4
    assert stats["bytes_sent"] == 2 * 4 * sum(fragment_sizes)


class StepBytes(keras.callbacks.Callback):
    """The bytes sent in each step."""

    def __init__(self):
        super().__init__()
        self.per_step, self._sent = [], 0

    def on_train_batch_end(self, batch, logs=None):
        sent = self.model.optimizer.communication_stats()["bytes_sent"]
        self.per_step.append(sent - self._sent)
        self._sent = sent


def test_a_delayed_exchange_travels_in_sync_delay_slices_one_a_step():
    # H = 6, F = 2, τ = 2. Fragment 0 (variables of 12, 4, 12 and 3 values)
    # lands after step 3, fragment 1 (16, 4, 6, 2) after step 6. Its Δ,
    # taken after step 1 (4), is combined in two slices of even bytes: in
    # step 2 (5) and step 3 (6); fragment 1's cut falls inside variable 2.
    model = build_model(
        lambda: StreamingDiLoCo(
            keras.optimizers.SGD(LEARNING_RATE), local_steps=6, num_fragments=2, sync_delay=2
        )
    )
    step_bytes = StepBytes()
    model.fit(*mlp_data(12), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[step_bytes])
    variables = model.trainable_variables
    fragments = fragments_by_layer(variables, 2, "balanced")
    assert [slices_by_size(f, variables, 2) for f in fragments] == [
        [[Piece(0), Piece(1)], [Piece(4), Piece(5)]],
        [[Piece(2, 0, 14)], [Piece(2, 14, 16), Piece(3), Piece(6), Piece(7)]],
    ]
    window = [0, 4 * (12 + 4), 4 * (12 + 3), 0, 4 * 14, 4 * (2 + 4 + 6 + 2)]
    assert step_bytes.per_step == window * 2
    assert model.optimizer.communication_stats()["all_reduce_calls"] == 8


def specs(*sizes):
    return [tf.TensorSpec((size,), tf.float32) for size in sizes]


@pytest.mark.parametrize("sizes, num_slices", [
    ((8192, 2048, 64, 6336, 64), 3), ((5, 1, 7), 4), ((3,), 3), ((10, 10, 10), 1),
])
def test_slices_cover_every_element_once_in_even_bytes(sizes, num_slices):
    variables = specs(*sizes)
    slices = slices_by_size(list(range(len(sizes))), variables, num_slices)
    covered = [
        (piece.index, element)
        for pieces in slices
        for piece in pieces
        for first in [piece.start or 0]
        for element in range(first, first + piece.num_elements(variables[piece.index]))
    ]
    assert covered == [(i, e) for i, size in enumerate(sizes) for e in range(size)]
    share = sum(sizes) / num_slices
    for pieces in slices:
        elements = sum(p.num_elements(variables[p.index]) for p in pieces)
        assert share - 1 < elements < share + 1
        assert sum(p.start is not None for p in pieces) <= 2


def test_fewer_elements_than_slices_leave_the_last_slices_empty():
    assert slices_by_size([0, 1], specs(1, 1), 3) == [[Piece(0)], [Piece(1)], []]


def transformer_ish():
    """An embedding, Dense blocks of unequal sizes and a head, built; its
    layers' values: 8192, 2112, 2080, 64, 6336, 6176, 64, 8448."""
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(256, 32),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(192, activation="relu"),
        keras.layers.Dense(32),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(256),
    ])
    return model


def balanced_reference(sizes, num_fragments):
    """The layer numbers of each fragment of the balanced split of layers
    of `sizes` (in model order), by a heap of (bytes, layers, number)."""
    heap = [(0, 0, fragment, []) for fragment in range(num_fragments)]
    for layer in sorted(range(len(sizes)), key=lambda layer: (-sizes[layer], layer)):
        size, count, fragment, members = heapq.heappop(heap)
        heapq.heappush(heap, (size + sizes[layer], count + 1, fragment, members + [layer]))
    return sorted(sorted(members) for *_, members in heap)


def test_a_balanced_split_evens_the_bytes_of_whole_layers():
    model = transformer_ish()
    variables = model.trainable_variables
    sizes = [4 * layer.count_params() for layer in model.layers]
    assert sizes == [4 * n for n in (8192, 2112, 2080, 64, 6336, 6176, 64, 8448)]
    layers = balanced_reference(sizes, 4)
    assert layers == [[0, 3, 6], [1, 5], [2, 4], [7]]
    position = {id(v): i for i, v in enumerate(variables)}
    want = [
        sorted(position[id(v)] for j in members for v in model.layers[j].trainable_variables)
        for members in layers
    ]
    assert fragments_by_layer(variables, 4, "balanced") == want

    def largest(fragments):
        return max(sum(4 * int(np.prod(variables[i].shape)) for i in f) for f in fragments)

    total = sum(sizes)
    assert largest(want) <= total / 4 + (1 - 1 / 4) * max(sizes)  # the rule's bound
    # The head alone, 25.2% of the bytes: no split of whole layers does
    # better. The strided split puts the embedding and the widest Dense
    # together, 43.4%.
    assert largest(want) == max(sizes) > total / 4
    assert largest(fragments_by_layer(variables, 4, "strided")) == 4 * (8192 + 6336)


def test_a_keras_file_keeps_the_exchange_in_flight(tmp_path):
    # H = 6, F = 2, τ = 2: after 5 steps the second fragment's Δ is in flight.
    model, _ = fit_recording(
        lambda: StreamingDiLoCo(
            keras.optimizers.SGD(LEARNING_RATE), local_steps=6, num_fragments=2, sync_delay=2
        ),
        steps=5,
    )
    path = str(tmp_path / "streaming.keras")
    model.save(path)
    with tf_agn.strategies.mirrored(DEVICES).scope():
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, StreamingDiLoCo)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()  # "balanced" too
    # Both fragments' combined Δ: the first's landed after step 3, the
    # second's, sent in step 5, is in flight (zeros before).
    outer_gradients = [v for v in model.optimizer.variables if "outer_gradient" in v.path]
    assert len(outer_gradients) == 8 and all(np.any(v.numpy()) for v in outer_gradients)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)


@pytest.mark.parametrize(
    "first, then, sync_delay, backup_step",
    [
        # H = 6, F = 2, τ = 2: the backup after step 5 holds the second
        # fragment's Δ, taken after step 4, landing after step 6: its first
        # slice combined, its second each replica's own (every new replica
        # takes the old replicas' mean).
        (4, 2, 2, 5),
        (2, 4, 2, 5),
        # τ = 0, mid-window: the first fragment landed after step 3.
        (4, 2, 0, 4),
    ],
)
def test_a_backup_resumes_mid_flight_on_another_number_of_replicas(
    tmp_path, first, then, sync_delay, backup_step
):
    """Every replica resumes from the centers at the backup's step: a Δ in
    flight lands as in the uninterrupted run, and each fragment's next Δ
    holds the local steps since (MEAN, the same global batch)."""

    def streaming():
        return StreamingDiLoCo(
            keras.optimizers.SGD(LEARNING_RATE), local_steps=6, num_fragments=2,
            sync_delay=sync_delay,
        )

    steps = 12
    x, y = mlp_data(steps)
    _, uninterrupted = fit_recording(streaming, steps, DEVICES[:first])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        build_model(streaming, DEVICES[:first]).fit(
            x, y, batch_size=BATCH, shuffle=False, verbose=0,
            callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=1),
                       Interrupt(0, backup_step)],
        )
    resumed = build_model(streaming, DEVICES[:then])
    record = RecordStates()
    resumed.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0,
        callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir, save_freq=1), record],
    )
    reference = streaming_reference(
        x, y, 6, [[0, 1, 4, 5], [2, 3, 6, 7]], sync_delay, 0.0, steps, nesterov_step,
        num_replicas=first, resize=(backup_step, then),
    )
    assert_states_match(uninterrupted[:backup_step], reference[:backup_step])
    # (The skipped batches' callbacks record the state restored.)
    resumed_states = record.states[backup_step:]
    assert_states_match(resumed_states, reference[backup_step:], first_step=backup_step + 1)
    # The centers after the first step resumed, a Δ in flight landed, are
    # the uninterrupted run's; the fragments' next landings differ.
    for got, want in zip(resumed_states[0][1], uninterrupted[backup_step][1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(resumed_states[-1][1][0], uninterrupted[-1][1][0])


def test_config_round_trip():
    optimizer = StreamingDiLoCo(
        keras.optimizers.AdamW(1e-3),
        local_steps=8,
        num_fragments=4,
        sync_delay=1,
        fragment_update_alpha=0.25,
        fragment_split="strided",
        aggregation_method="sum",
    )
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, StreamingDiLoCo)
    assert (restored.num_fragments, restored.sync_delay) == (4, 1)
    assert restored.fragment_update_alpha == 0.25
    assert restored.fragment_split == "strided"
    assert StreamingDiLoCo(keras.optimizers.SGD(), 2, 2).fragment_split == "balanced"
    assert restored.outer_optimizer.nesterov and restored.outer_optimizer.momentum == 0.9
    assert float(restored.outer_optimizer.learning_rate) == pytest.approx(0.7)
    assert restored.get_config() == optimizer.get_config()


def test_num_fragments_must_divide_local_steps():
    with pytest.raises(ValueError, match=r"num_fragments=4 must divide local_steps=6"):
        StreamingDiLoCo(keras.optimizers.SGD(), local_steps=6, num_fragments=4)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_fragments must be an int >= 1"):
            StreamingDiLoCo(keras.optimizers.SGD(), local_steps=6, num_fragments=bad)


@pytest.mark.parametrize("sync_delay", [-1, 2, 1.0])
def test_sync_delay_must_be_below_a_fragments_share_of_the_window(sync_delay):
    with pytest.raises(
        ValueError,
        match=rf"sync_delay must be an int in .* = \[0, 2\) .*received {sync_delay}\.",
    ):
        StreamingDiLoCo(
            keras.optimizers.SGD(), local_steps=4, num_fragments=2, sync_delay=sync_delay
        )


@pytest.mark.parametrize("fragment_split", ["even", None])
def test_an_unknown_fragment_split_is_refused_naming_the_known_ones(fragment_split):
    with pytest.raises(
        ValueError,
        match=rf"fragment_split must be one of 'balanced', 'strided'; "
        rf"received {fragment_split!r}\.",
    ):
        StreamingDiLoCo(
            keras.optimizers.SGD(), local_steps=4, num_fragments=2, fragment_split=fragment_split
        )


def test_fragment_update_alpha_must_be_in_the_unit_interval():
    with pytest.raises(ValueError, match=r"fragment_update_alpha must be in \[0, 1\]; received 1.5"):
        StreamingDiLoCo(
            keras.optimizers.SGD(), local_steps=4, num_fragments=2, fragment_update_alpha=1.5
        )


@pytest.mark.parametrize("fragment_split", ["balanced", "strided"])
def test_more_fragments_than_layers_is_refused_when_built(fragment_split):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = StreamingDiLoCo(
        keras.optimizers.SGD(), local_steps=3, num_fragments=3, fragment_split=fragment_split
    )
    with pytest.raises(ValueError, match=r"num_fragments=3 is more than the 2 layers"):
        optimizer.build(model.trainable_variables)


def test_asynchronous_training_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(
        StreamingDiLoCo(keras.optimizers.SGD(), local_steps=2, num_fragments=2), loss="mse"
    )
    with pytest.raises(ValueError, match="StreamingDiLoCo's fragments and delayed exchanges are"):
        tf_agn.strategies.simulate(model, lambda context: None, num_workers=2, num_windows=1)
