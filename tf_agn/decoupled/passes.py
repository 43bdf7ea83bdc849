"""`StagePasses`: what the K stages compute within one tick."""

import functools

import tensorflow as tf


class StagePasses:
    """The forward and backward passes of the K stages within one tick.

    A stage with D_k = 0 backpropagates the batch it forwarded in the same
    tick, from the forward's tape; a stage with D_k > 0 backpropagates a
    batch it forwarded D_k ticks earlier, recomputing that forward from the
    stored input with its current weights. Every backward pass of a real
    batch (id >= 0) goes to the `Accumulation`.

    Args:
        stages: the K built stage models.
        devices: one device name per stage.
        delays: D_k of every stage.
        loss: a Keras loss object whose call reduces to a scalar.
        metrics: the `tf_agn.decoupled.metrics.Metrics` the last stage
            updates.
        accumulation: the `tf_agn.decoupled.accumulation.Accumulation` of
            the stages.
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
        """The forward passes, k = 0 .. K−1.

        Args:
            inputs: `{k: (input, batch id)}`; a stage missing from it
                forwards stage k − 1's output of this tick (a chained
                forward), which is added to `inputs`.
            labels: the labels of the batch the last stage forwards.

        Returns:
            `{k: (output, batch id)}`, the last stage's output being
            `(loss, predictions)`; and `{k: tape}` of the stages with
            D_k = 0.
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
        """The backward passes, k = K−1 .. 0, each accumulated if its batch
        is real.

        Args:
            inputs, outputs, tapes: what `forward` took and returned.
            stored: `{k: (input, batch id, weight version, gradient of the
                output)}` of the batch each stage with D_k > 0
                backpropagates now.
            labels: the labels of the batch the last stage forwarded.
            versions: each stage's weight version before this tick's step.

        Returns:
            `{k: gradient with respect to stage k's input}` for k > 0, and
            `{k: the batch id stage k backpropagated}`.
        """
        input_gradients, backward_ids = {}, {}
        for k in reversed(range(len(self.stages))):
            with tf.device(self.devices[k]):
                if self.delays[k] == 0:
                    # The last stage starts from its loss (no gradient
                    # comes in); under BP, stage k from stage k + 1's
                    # gradient of this tick.
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
        """Stage k's backward of the batch it forwarded in this tick, from
        its tape; the last stage also updates the metrics.

        Returns:
            The gradients of stage k's trainable variables, then, for
            k > 0, of `stage_input`; and the batch id.
        """
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
    """A delayed backward: `stage`'s forward again from its stored input,
    with its current weights.

    Returns:
        The gradients of the trainable variables, then, if `wrt_input`,
        of `stage_input`.
    """
    trainable = [v.value for v in stage.trainable_variables]
    non_trainable = [v.value for v in stage.non_trainable_variables]
    sources = trainable + [stage_input] * wrt_input
    with tf.GradientTape() as tape:
        tape.watch(sources)
        # `stateless_call` leaves non-trainable state (e.g. batch-norm
        # statistics) as the first forward left it.
        output, _ = stage.stateless_call(
            trainable, non_trainable, stage_input, training=True
        )
    return tape.gradient(output, sources, output_gradients=upstream)
