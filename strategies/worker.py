"""`Worker`: one worker's side of asynchronous training."""

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn.collectives.finite import all_finite
from tf_agn.optimizers.windowed import optimizer_state
from tf_agn.strategies.worker_state import per_worker_variables


class Worker:
    """A worker's weights θ, its inner optimizer, and its window program.

    A window is `pull`, `local_step` λ times, then `commit`, each traced
    into the caller's function: `tf_agn.strategies.fit` (one scheduled
    function per window) and `tf_agn.strategies.simulate` run the same
    program. Each worker keeps its own θ and optimizer state (e.g. Adam's
    moments) across windows; the model's non-trainable variables (e.g.
    batch-norm statistics) are read from the center and not updated.

    Args:
        model: the Keras model; its trainable variables are the center.
        optimizer: the `tf_agn.optimizers.WindowedOptimizer` whose rules
            apply; its inner optimizer is cloned for this worker.
        server: the `tf_agn.strategies.commit_server.CommitServer`.
        strategy: the strategy whose scope this is created in.
    """

    def __init__(self, model, optimizer, server, strategy):
        self.model = model
        self.optimizer = optimizer
        self.server = server
        centers = model.trainable_variables
        # Worker-local under `ParameterServerStrategy`, as in the paper.
        with per_worker_variables(strategy):
            self.weights = [
                tf.Variable(center.value, trainable=False, name="local")
                for center in centers
            ]
            self.pulled = [
                tf.Variable(center.value, trainable=False, name="pulled")
                for center in centers
            ]
            self.commits_at_pull = tf.Variable(0, dtype=tf.int64, trainable=False)
            # Error feedback: what compression dropped from this worker's
            # commits, sent with its next one.
            self.commit_state = [
                {
                    name: tf.Variable(_initial_value(spec), trainable=False, name=name)
                    for name, spec in _state_spec(server.compressor, center).items()
                }
                for center in centers
            ]
            # A clone, so that every worker owns its optimizer state.
            self.inner_optimizer = optimizer.plain_inner_optimizer()
            # The strategy refuses to colocate slots with worker-local weights.
            with _compat.slots_created_plainly(self.inner_optimizer):
                self.inner_optimizer.build(self.weights)

    def pull(self):
        """Reads the center; resetting algorithms start their window from it."""
        centers, commits = self.server.pull()
        for pulled, center in zip(self.pulled, centers):
            pulled.assign(center)
        self.commits_at_pull.assign(commits)
        if self.optimizer.resets_to_center:
            for weight, center in zip(self.weights, centers):
                weight.assign(center)

    def local_step(self, x, y, sample_weight=None):
        """One inner-optimizer step on this worker's weights; returns the loss."""
        values = [tf.identity(weight) for weight in self.weights]
        non_trainable = [v.value for v in self.model.non_trainable_variables]
        with tf.GradientTape() as tape:
            tape.watch(values)
            y_pred, _, losses = self.model.stateless_call(
                values, non_trainable, x, training=True, return_losses=True
            )
            loss = _compat.compiled_loss(self.model)(y, y_pred, sample_weight)
            if losses:
                loss = loss + tf.add_n(losses)
        gradients = tape.gradient(loss, values)
        inner = self.inner_optimizer
        _compat.update_step_in_place(inner, gradients, self.weights, inner.learning_rate)
        inner.iterations.assign_add(1)
        return loss

    def commit(self, window_id):
        """Commits the window; returns (staleness, outcome) from the server."""
        if not self.optimizer.resets_to_center:
            # The elastic methods exchange with the center as it is now.
            self.pull()
        weights = [tf.identity(weight) for weight in self.weights]
        deltas = [
            self.optimizer.commit_delta(weight, pulled)
            for weight, pulled in zip(weights, self.pulled)
        ]
        staleness, outcome = self.server.apply(
            self._compressed(deltas), self.commits_at_pull, window_id
        )
        with tf.control_dependencies([outcome]):
            for weight, value, delta, center in zip(
                self.weights, weights, deltas, self.server.centers
            ):
                weight.assign(self.optimizer.local_after_commit(value, delta, center))
        if self.optimizer.reset_inner_state:
            for slot in optimizer_state(self.inner_optimizer):
                slot.assign(tf.zeros_like(slot))
        return staleness, outcome


    def _compressed(self, deltas):
        """The commit's payloads (see `CommitServer.apply`), compressed on
        this worker; updates its error-feedback state."""
        compressor = self.server.compressor
        finite = all_finite(deltas)
        payloads = []
        for delta, state in zip(deltas, self.commit_state):
            if not compression.compresses(compressor, delta):
                payloads.append((delta,))
                continue
            payload, new_state = compressor.encode(delta, {k: tf.identity(v) for k, v in state.items()})
            # Kept as it was where Δ is not finite: the server rejects it.
            for name, variable in state.items():
                variable.assign(tf.where(finite, new_state[name], variable))
            payloads.append(payload)
        return payloads


def _state_spec(compressor, center):
    """The error-feedback state `compressor` keeps for `center`, by name."""
    if not compression.compresses(compressor, center):
        return {}
    return compressor.state_spec(center.shape)


def _initial_value(spec):
    """The initial value of a compressor's state variable."""
    if spec.initializer == "zeros":
        return tf.zeros(spec.shape)
    return spec.initializer(spec.shape, tf.float32)


def window_function(worker, local_steps, pull_first=True):
    """The traced program of one window: pull, λ local steps, commit.

    Args:
        worker: the `Worker`.
        local_steps: λ.
        pull_first: whether the window starts with its pull. The simulator
            pulls separately, right after the worker's previous commit.

    Returns:
        A `tf.function(iterator, window_id)` returning
        `(mean loss, staleness, outcome)`.
    """

    @tf.function
    def run_window(iterator, window_id):
        if pull_first:
            worker.pull()
        total = tf.constant(0.0)
        for _ in tf.range(local_steps):
            x, y = next(iterator)[:2]
            total += tf.cast(worker.local_step(x, y), tf.float32)
        staleness, outcome = worker.commit(window_id)
        return total / local_steps, staleness, outcome

    return run_window
