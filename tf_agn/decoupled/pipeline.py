"""`Pipeline`: the state of a decoupled training run and its tick function.

One tick is one `tf.function` call. What stages hand each other between
ticks lives in variables on the receiving stage's device: `activations`
(ADL), output `gradients`, rings of `stored_inputs` (D_k > 0) and `labels`
(ADL). Batch ids travel with the data, -1 for an empty slot.
"""

import tensorflow as tf

from tf_agn.decoupled.accumulation import Accumulation
from tf_agn.decoupled.passes import StagePasses


class Pipeline:
    """The buffers and the tick function of a `DecoupledModel`'s training.

    `tick(x, y, batch_id, tick)` runs one tick. `boundary_specs` are the
    `tf.TensorSpec`s of every stage's input, then of the output, without
    the batch dimension.
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
        self.schedule = schedule
        self.metrics = metrics
        self.batch_size = batch_size
        self.num_stages = len(stages)
        delays = schedule.delays
        self.activations, self.activation_ids = {}, {}
        self.gradients = {}
        self.stored_inputs, self.stored_ids, self.stored_versions = {}, {}, {}
        for k, device in enumerate(devices):
            with tf.device(device):
                if k > 0 and not schedule.chained_forward:
                    self.activations[k] = _buffer(boundary_specs[k], batch_size)
                    self.activation_ids[k] = _ids()
                if delays[k] > 0:
                    self.gradients[k] = _buffer(boundary_specs[k + 1], batch_size)
                    self.stored_inputs[k] = _buffer(
                        boundary_specs[k], batch_size, [delays[k]]
                    )
                    self.stored_ids[k] = _ids([delays[k]])
                    self.stored_versions[k] = tf.Variable(
                        tf.zeros([delays[k]], tf.int64), trainable=False
                    )
        label_lag = schedule.forward_lags[-1]
        with tf.device(devices[-1]):
            self.labels = _buffer(label_spec, batch_size, [label_lag]) if label_lag else None
        self.accumulation = Accumulation(
            stages, devices, optimizers, delays, accumulation_steps, reduction
        )
        self.passes = StagePasses(
            stages, devices, delays, loss, metrics, self.accumulation
        )
        # Python loops over the stages unroll when traced: no autograph.
        self.tick = tf.function(self._tick, autograph=False)

    def _tick(self, x, y, batch_id, tick):
        """Runs one tick; returns the K batch ids forwarded and the K
        backpropagated, -1 where none (`batch_id` is -1 while draining)."""
        # Reads first. TensorFlow orders operations on one variable as the
        # program does, and stages share no variable, so they run concurrently.
        versions = self.accumulation.versions()
        slots = {k: tick % self.schedule.delays[k] for k in self.stored_inputs}
        stored = self._read_stored(slots)
        if self.labels is None:
            label_slot, labels = None, y
        else:
            label_slot = tick % self.schedule.forward_lags[-1]
            labels = tf.gather(self.labels, label_slot)
        inputs = self._read_inputs(x, batch_id)

        outputs, tapes = self.passes.forward(inputs, labels)
        input_gradients, backward_ids = self.passes.backward(
            inputs, outputs, tapes, stored, labels, versions
        )

        # Writes last: what the next tick reads.
        self._write(y, inputs, outputs, input_gradients, slots, versions, label_slot)
        forward_ids = tf.stack([inputs[k][1] for k in range(self.num_stages)])
        return forward_ids, tf.stack([backward_ids[k] for k in range(self.num_stages)])

    def _read_stored(self, slots):
        """`{k: (input, batch id, weight version, output gradient)}` that
        each stage with D_k > 0 backpropagates now."""
        return {
            k: (
                tf.gather(self.stored_inputs[k], slot),
                tf.gather(self.stored_ids[k], slot),
                tf.gather(self.stored_versions[k], slot),
                tf.convert_to_tensor(self.gradients[k]),
            )
            for k, slot in slots.items()
        }

    def _read_inputs(self, x, batch_id):
        """`{k: (input, batch id)}`: `x` for stage 0, then ADL's activations."""
        inputs = {0: (x, batch_id)}
        for k in self.activations:
            inputs[k] = (
                tf.convert_to_tensor(self.activations[k]),
                tf.convert_to_tensor(self.activation_ids[k]),
            )
        return inputs

    def _write(self, y, inputs, outputs, input_gradients, slots, versions, label_slot):
        """Writes what the next tick reads."""
        for k in self.activations:
            output, stage_id = outputs[k - 1]
            self.activations[k].assign(output)
            self.activation_ids[k].assign(stage_id)
        for k, slot in slots.items():
            stage_input, stage_id = inputs[k]
            self.stored_inputs[k].scatter_nd_update([[slot]], [stage_input])
            self.stored_ids[k].scatter_nd_update([[slot]], [stage_id])
            self.stored_versions[k].scatter_nd_update([[slot]], [versions[k]])
            self.gradients[k].assign(input_gradients[k + 1])
        if self.labels is not None:
            self.labels.scatter_nd_update([[label_slot]], [y])


def build_stages(stages, devices, optimizers, x_batch):
    """Builds the stages and their optimizers on one batch, in inference
    mode; returns the boundary `tf.TensorSpec`s and the output."""
    specs = [tf.TensorSpec(x_batch.shape[1:], tf.as_dtype(x_batch.dtype))]
    activation = x_batch
    for stage, device, optimizer in zip(stages, devices, optimizers):
        with tf.device(device):
            activation = stage(activation, training=False)
            optimizer.build(stage.trainable_variables)
        specs.append(tf.TensorSpec(activation.shape[1:], activation.dtype))
    return specs, activation


def _buffer(spec, batch_size, leading=()):

    shape = list(leading) + [batch_size] + list(spec.shape)
    return tf.Variable(tf.zeros(shape, spec.dtype), trainable=False)


def _ids(shape=()):
    """A variable of batch ids, all -1 (empty)."""
    return tf.Variable(tf.fill(shape, -1), trainable=False)
