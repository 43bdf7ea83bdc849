"""`StagePasses`: what the K stages compute within one tick."""

import functools

import tensorflow as tf


class StagePasses:
    """The forward and backward passes of the K stages within one tick.

    A stage with D_k = 0 backpropagates from the forward's tape; one with
    D_k > 0 recomputes the forward of its stored input with its current
    weights. Backward passes of real batches (id >= 0) are accumulated.
    """

    def __init__(self, stages, devices, delays, loss, metrics, accumulation):
        self.stages = stages
        self.devices = devices
        self.delays = delays
        self.loss = loss
        self.metrics = metrics
        self.accumulation = accumulation
        self.last = len(stages) - 1

    def forward(self, inputs, labels):
        """`({k: (output, batch id)}, {k: tape})` of the forward passes.

        A stage missing from `inputs` (`{k: (input, batch id)}`) forwards
        stage k − 1's output of this tick. The last stage's output is
        `(loss, predictions)`; tapes are kept for stages with D_k = 0.
        """
        outputs, tapes = {}, {}
        for k, stage in enumerate(self.stages):
            if k not in inputs:  # A chained forward.
                inputs[k] = outputs[k - 1]
            stage_input, stage_id = inputs[k]
            with tf.device(self.devices[k]):
                if self.delays[k] == 0:
                    tapes[k] = tf.GradientTape()
                    with tapes[k]:
                        tapes[k].watch(stage_input)
                        output = stage(stage_input, training=True)
                        if k == self.last:
                            output = self.loss(labels, output), output
                else:
                    output = stage(stage_input, training=True)
            outputs[k] = (output, stage_id)
        return outputs, tapes

    def backward(self, inputs, outputs, tapes, stored, labels, versions):
        """The backward passes, k = K−1 .. 0: returns `{k: gradient of stage
        k's input}` (k > 0) and `{k: batch id backpropagated}`.

        `stored` is `{k: (input, batch id, weight version, output gradient)}`
        for stages with D_k > 0; `versions` each stage's weight version.
        """
        input_gradients, backward_ids = {}, {}
        for k in reversed(range(len(self.stages))):
            with tf.device(self.devices[k]):
                if self.delays[k] == 0:
                    grads, batch = self._backward_in_tick(
                        k, inputs[k][0], outputs[k], tapes[k], labels,
                        input_gradients.get(k + 1),
                    )
                    staleness = tf.constant(0, tf.int64)
                else:
                    stage_input, batch, version, upstream = stored[k]
                    grads = _recompute_gradients(
                        self.stages[k], stage_input, upstream, k > 0
                    )
                    staleness = versions[k] - version
                if k > 0:  # Stage 0's input needs no gradient.
                    input_gradients[k] = grads.pop()
                backward_ids[k] = batch
                tf.cond(
                    batch >= 0,
                    functools.partial(self.accumulation.add, k, grads, staleness),
                    lambda: None,
                )
        return input_gradients, backward_ids

    def _backward_in_tick(self, k, stage_input, output, tape, labels, upstream):
        """Gradients of stage k's variables (and input, for k > 0) from its
        tape, and the batch id; the last stage also updates the metrics."""
        target, batch = output
        if k == self.last:
            target, predictions = target
            tf.cond(
                batch >= 0,
                functools.partial(self.metrics.update, target, labels, predictions),
                lambda: None,
            )
        grads = tape.gradient(
            target,
            self.stages[k].trainable_variables + [stage_input] * (k > 0),
            output_gradients=upstream,
        )
        return grads, batch


def _recompute_gradients(stage, stage_input, upstream, wrt_input):
    """A delayed backward: gradients of `stage`'s variables (and of
    `stage_input` if `wrt_input`), its forward recomputed."""
    trainable = [v.value for v in stage.trainable_variables]
    non_trainable = [v.value for v in stage.non_trainable_variables]
    sources = trainable + [stage_input] * wrt_input
    with tf.GradientTape() as tape:
        tape.watch(sources)
        # `stateless_call` leaves batch-norm statistics as the forward left them.
        output, _ = stage.stateless_call(
            trainable, non_trainable, stage_input, training=True
        )
    return tape.gradient(output, sources, output_gradients=upstream)
