"""`Accumulation`: each stage's accumulated gradients and optimizer steps."""

import numpy as np
import tensorflow as tf


class Accumulation:
    """Sums each stage's backward passes and steps its optimizer every M.

    Every stage keeps, on its device, one accumulator per trainable weight,
    their count, and a histogram of staleness (0..D_k).
    """

    def __init__(self, stages, devices, optimizers, delays, accumulation_steps, reduction):
        self.stages = stages
        self.optimizers = optimizers
        self.delays = delays
        self.accumulation_steps = accumulation_steps
        self.reduction = reduction
        self.accumulators, self.counts, self.histograms = [], [], []
        for stage, device, delay in zip(stages, devices, delays):
            with tf.device(device):
                self.accumulators.append(
                    [
                        tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                        for v in stage.trainable_variables
                    ]
                )
                self.counts.append(tf.Variable(0, trainable=False))
                self.histograms.append(tf.Variable(tf.zeros([delay + 1], tf.int64)))

    def versions(self):
        """Each stage's weight version: its optimizer's step count."""
        # `tf.identity` reads now; a variable would be read where used.
        return [tf.identity(opt.iterations.value) for opt in self.optimizers]

    def add(self, k, grads, staleness):
        """Adds one backward pass of stage k; every M of them, steps stage k."""
        self.histograms[k].assign_add(
            tf.one_hot(staleness, self.delays[k] + 1, dtype=tf.int64)
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

    def staleness(self):
        """The staleness so far, per stage, as `DecoupledModel.staleness`."""
        report = []
        for delay, histogram in zip(self.delays, self.histograms):
            counts = histogram.numpy()
            total = counts.sum()
            report.append(
                {
                    "delay": delay,
                    "mean": (
                        float(counts @ np.arange(len(counts)) / total)
                        if total
                        else None
                    ),
                    "histogram": {s: int(c) for s, c in enumerate(counts) if c},
                }
            )
        return report
