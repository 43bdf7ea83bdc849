"""`Pipeline`: the state of a decoupled training run and its tick function.

One tick is one `tf.function` call. Inside it every stage forwards one
batch and backpropagates one batch (possibly different ones, possibly
none); what stages hand each other between ticks lives in variables on the
receiving stage's device:

- `activations[k]`: stage k − 1's output of the last tick (ADL only; DDG and
  BP chain the forward inside the tick);
- `gradients[k]`: the gradient of the loss with respect to stage k's output,
  from stage k + 1's backward of the last tick (stages with D_k > 0);
- `stored_inputs[k]`: a ring of the last D_k inputs stage k forwarded, each
  with its batch id and stage k's weight version at the time; the backward
  recomputes the forward from the stored input with the current weights, as
  ADL's official code does, so only inputs are kept, not whole activation
  graphs;
- `labels`: a ring of the last f_{K−1} label batches (ADL only), for the
  last stage, which reaches batch b at tick b + K − 1.

Every buffer is read before any is written within a tick (TensorFlow orders
the operations on one variable as the program does), and reads and writes
of different stages share no variable: the K stages' computations are
independent, and TensorFlow's executor runs them concurrently.

Batch ids travel with the data (-1 marks an empty slot while the pipeline
fills or drains), so a stage accumulates a backward pass only for a real
batch, and the ids each tick reports are the trace of what really ran.
"""

import functools

import tensorflow as tf


class Pipeline:
    """The buffers, accumulators and tick function of a `DecoupledModel`.

    Args:
        stages: the K built stage models.
        devices: one device name per stage.
        optimizers: one built Keras optimizer per stage.
        schedule: a `tf_agn.decoupled.schedule.Schedule`.
        accumulation_steps: M, backward passes per optimizer step.
        reduction: "mean" divides the M accumulated gradients by M; "sum"
            applies their sum.
        loss: a Keras loss object whose call reduces to a scalar.
        metrics: the Keras metrics the last stage updates: a loss tracker
            first, then the compiled metrics (or None).
        batch_size: the fixed batch size the buffers hold.
        boundary_specs: the `tf.TensorSpec` of every stage's input, without
            the batch dimension, then the model output's.
        label_spec: the `tf.TensorSpec` of a label batch.
    """

    def __init__(
        self,
        stages,
        devices,
        optimizers,
        schedule,
        accumulation_steps,
        reduction,
        loss,
        metrics,
        batch_size,
        boundary_specs,
        label_spec,
    ):
        self.stages = stages
        self.devices = devices
        self.optimizers = optimizers
        self.schedule = schedule
        self.accumulation_steps = accumulation_steps
        self.reduction = reduction
        self.loss = loss
        self.loss_tracker, self.compiled_metrics = metrics
        self.batch_size = batch_size
        num_stages = len(stages)
        delays = schedule.delays

        def buffer(spec, leading=(), initial=0):
            shape = list(leading) + [batch_size] + list(spec.shape)
            return tf.Variable(
                tf.fill(shape, tf.cast(initial, spec.dtype)), trainable=False
            )

        def ids(shape=()):
            return tf.Variable(tf.fill(shape, -1), trainable=False)

        self.activations, self.activation_ids = {}, {}
        self.gradients = {}
        self.stored_inputs, self.stored_ids, self.stored_versions = {}, {}, {}
        self.accumulators, self.counts, self.histograms = [], [], []
        for k, device in enumerate(devices):
            with tf.device(device):
                if k > 0 and not schedule.chained_forward:
                    self.activations[k] = buffer(boundary_specs[k])
                    self.activation_ids[k] = ids()
                if delays[k] > 0:
                    self.gradients[k] = buffer(boundary_specs[k + 1])
                    self.stored_inputs[k] = buffer(
                        boundary_specs[k], leading=[delays[k]]
                    )
                    self.stored_ids[k] = ids([delays[k]])
                    self.stored_versions[k] = tf.Variable(
                        tf.zeros([delays[k]], tf.int64), trainable=False
                    )
                self.accumulators.append(
                    [
                        tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                        for v in stages[k].trainable_variables
                    ]
                )
                self.counts.append(tf.Variable(0, trainable=False))
                # Staleness s of stage k lies in 0..D_k.
                self.histograms.append(tf.Variable(tf.zeros([delays[k] + 1], tf.int64)))
        label_lag = schedule.forward_lags[-1]
        with tf.device(devices[-1]):
            self.labels = buffer(label_spec, [label_lag]) if label_lag else None
        self.num_stages = num_stages
        # Python loops over the stages unroll when traced: no autograph.
        self.tick = tf.function(self._tick, autograph=False)

    def _tick(self, x, y, batch_id, tick):
        """Runs one tick; returns the batch ids forwarded and backpropagated.

        Args:
            x: the input batch entering stage 0 (zeros while draining).
            y: its labels.
            batch_id: its id, or -1 while draining.
            tick: the tick's number since the pipeline was empty (int64).

        Returns:
            Two int32 vectors of K batch ids, -1 where a stage had none.
        """
        schedule = self.schedule
        delays = schedule.delays
        last = self.num_stages - 1
        # Reads first: every buffer's value of the last tick, and every
        # stage's weight version before this tick's step.
        # (`tf.identity` reads now; a variable would be read where used.)
        versions = [tf.identity(opt.iterations.value) for opt in self.optimizers]
        slots, stored = {}, {}
        for k in self.stored_inputs:
            slots[k] = tick % delays[k]
            stored[k] = (
                tf.gather(self.stored_inputs[k], slots[k]),
                tf.gather(self.stored_ids[k], slots[k]),
                tf.gather(self.stored_versions[k], slots[k]),
                tf.convert_to_tensor(self.gradients[k]),
            )
        if self.labels is not None:
            label_slot = tick % schedule.forward_lags[-1]
            labels = tf.gather(self.labels, label_slot)
        else:
            labels = y
        inputs = {0: (x, batch_id)}
        for k in self.activations:
            inputs[k] = (
                tf.convert_to_tensor(self.activations[k]),
                tf.convert_to_tensor(self.activation_ids[k]),
            )

        # Forward passes, k = 0 .. K−1.
        outputs, tapes = {}, {}
        for k, stage in enumerate(self.stages):
            if k not in inputs:  # A chained forward.
                inputs[k] = outputs[k - 1]
            stage_input, stage_id = inputs[k]
            with tf.device(self.devices[k]):
                if delays[k] == 0:
                    # Backpropagated in this very tick: keep the tape.
                    tapes[k] = tf.GradientTape()
                    with tapes[k]:
                        tapes[k].watch(stage_input)
                        output = stage(stage_input, training=True)
                        if k == last:
                            output = self.loss(labels, output), output
                else:
                    output = stage(stage_input, training=True)
            outputs[k] = (output, stage_id)

        # Backward passes, k = K−1 .. 0. Stage 0's input needs no gradient.
        output_gradients, backward_ids = {}, {}
        for k in reversed(range(self.num_stages)):
            stage = self.stages[k]
            with tf.device(self.devices[k]):
                if delays[k] == 0:
                    target, batch = outputs[k]
                    if k == last:
                        (target, predictions), upstream = target, None
                        tf.cond(
                            batch >= 0,
                            functools.partial(
                                self._update_metrics, target, labels, predictions
                            ),
                            lambda: None,
                        )
                    else:  # BP: the gradient of stage k + 1, this tick.
                        upstream = output_gradients[k + 1]
                    stage_input = inputs[k][0]
                    grads = tapes[k].gradient(
                        target,
                        stage.trainable_variables + [stage_input] * (k > 0),
                        output_gradients=upstream,
                    )
                    staleness = tf.constant(0, tf.int64)
                else:
                    stage_input, batch, version, upstream = stored[k]
                    grads = self._recompute_gradients(
                        stage, stage_input, upstream, k > 0
                    )
                    staleness = versions[k] - version
                if k > 0:
                    output_gradients[k] = grads.pop()
                backward_ids[k] = batch
                tf.cond(
                    batch >= 0,
                    functools.partial(self._accumulate, k, grads, staleness),
                    lambda: None,
                )

        # Writes last: what the next tick reads.
        for k in self.activations:
            output, stage_id = outputs[k - 1]
            self.activations[k].assign(output)
            self.activation_ids[k].assign(stage_id)
        for k in self.stored_inputs:
            stage_input, stage_id = inputs[k]
            self.stored_inputs[k].scatter_nd_update([[slots[k]]], [stage_input])
            self.stored_ids[k].scatter_nd_update([[slots[k]]], [stage_id])
            self.stored_versions[k].scatter_nd_update([[slots[k]]], [versions[k]])
            self.gradients[k].assign(output_gradients[k + 1])
        if self.labels is not None:
            self.labels.scatter_nd_update([[label_slot]], [y])
        forward_ids = tf.stack([inputs[k][1] for k in range(self.num_stages)])
        return forward_ids, tf.stack([backward_ids[k] for k in range(self.num_stages)])

    def _recompute_gradients(self, stage, stage_input, upstream, wrt_input):
        """The delayed backward: the forward again, with the current weights.

        `stateless_call` leaves non-trainable state (e.g. batch-norm
        statistics) as the first forward left it.

        Returns:
            The gradients of the trainable variables, then, if `wrt_input`,
            of `stage_input`.
        """
        trainable = [v.value for v in stage.trainable_variables]
        non_trainable = [v.value for v in stage.non_trainable_variables]
        sources = trainable + [stage_input] * wrt_input
        with tf.GradientTape() as tape:
            tape.watch(sources)
            output, _ = stage.stateless_call(
                trainable, non_trainable, stage_input, training=True
            )
        return tape.gradient(output, sources, output_gradients=upstream)

    def _update_metrics(self, loss, labels, predictions):
        self.loss_tracker.update_state(loss)
        if self.compiled_metrics is not None:
            self.compiled_metrics.update_state(labels, predictions)

    def _accumulate(self, k, grads, staleness):
        """Adds one backward pass; every M of them, steps stage k."""
        self.histograms[k].assign_add(
            tf.one_hot(staleness, self.schedule.delays[k] + 1, dtype=tf.int64)
        )
        for accumulator, grad in zip(self.accumulators[k], grads):
            accumulator.assign_add(grad)
        self.counts[k].assign_add(1)
        tf.cond(
            self.counts[k] >= self.accumulation_steps,
            lambda: self._step(k),
            lambda: None,
        )

    def _step(self, k):
        scale = 1 / self.accumulation_steps if self.reduction == "mean" else 1
        self.optimizers[k].apply(
            [accumulator * scale for accumulator in self.accumulators[k]],
            self.stages[k].trainable_variables,
        )
        for accumulator in self.accumulators[k]:
            accumulator.assign(tf.zeros_like(accumulator))
        self.counts[k].assign(0)
