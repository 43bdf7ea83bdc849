"""The training and evaluation loops of a `DecoupledModel`.

`fit` feeds a `Pipeline` one batch per tick and drains it at every epoch's
end, inside the callback, progress-bar and `History` skeleton it shares with
parameter-server training (`tf_agn.utils.training_loop.run_epochs`); `evaluate`
scores the model's predictions batch by batch. Both report a
`tf_agn.decoupled.metrics.Metrics`.
"""

import numpy as np
import tensorflow as tf

from tf_agn.utils.training_loop import run_epochs


def fit(
    model,
    pipeline,
    x,
    y,
    num_batches,
    batch_size,
    epochs,
    verbose,
    callbacks,
    validation_data,
    shuffle,
):
    """Trains `model` on `num_batches` batches of `(x, y)` per epoch, one per
    tick of `pipeline`; see `DecoupledModel.fit`.

    Sets `model.tick_trace` to the batch ids of every tick.
    """
    model.tick_trace = []
    empty_x = tf.zeros_like(x[:batch_size])
    empty_y = tf.zeros_like(y[:batch_size])
    metrics = pipeline.metrics

    def run_epoch(epoch, callbacks):
        metrics.reset()
        order = np.random.permutation(len(x)) if shuffle else np.arange(len(x))
        for tick in range(model.schedule.num_ticks(num_batches)):
            # Batch `tick` enters at tick `tick`; then the pipeline
            # drains, fed empty batches with id -1.
            feeding = tick < num_batches
            if feeding:
                callbacks.on_train_batch_begin(tick)
                batch = order[tick * batch_size : (tick + 1) * batch_size]
                x_batch, y_batch, batch_id = x[batch], y[batch], tick
            else:
                x_batch, y_batch, batch_id = empty_x, empty_y, -1
            model.tick_trace.append(
                _run_tick(pipeline, x_batch, y_batch, batch_id, tick)
            )
            if feeding:
                callbacks.on_train_batch_end(tick, metrics.logs())
        return metrics.logs()

    def validate():
        return model.evaluate(*validation_data, batch_size=batch_size, return_dict=True)

    history = run_epochs(
        model,
        epochs,
        num_batches,
        run_epoch,
        callbacks=callbacks,
        verbose=verbose,
        validate=None if validation_data is None else validate,
    )
    model.tick_trace = np.stack(model.tick_trace)
    return history


def evaluate(model, x, y, batch_size, verbose, metrics):
    """The logs of `metrics` over `model`'s predictions on `(x, y)`; see
    `DecoupledModel.evaluate`."""
    metrics.reset()
    predictions = model.predict(x, batch_size=batch_size, verbose=verbose)
    for start in range(0, len(x), batch_size):
        end = start + batch_size
        y_batch = tf.convert_to_tensor(y[start:end])
        y_pred = tf.convert_to_tensor(predictions[start:end])
        metrics.update(
            model.loss(y_batch, y_pred), y_batch, y_pred, sample_weight=len(y_batch)
        )
    return metrics.logs()


def _run_tick(pipeline, x_batch, y_batch, batch_id, tick):
    """Runs one tick of `pipeline`; returns its `[2, K]` batch ids, as
    numpy: forwarded, then backpropagated."""
    ids = pipeline.tick(
        x_batch,
        y_batch,
        tf.constant(batch_id, tf.int32),
        tf.constant(tick, tf.int64),
    )
    return np.stack([i.numpy() for i in ids])
