"""`run_epochs`, the Keras callback skeleton of tf_agn's own training loops."""

import keras

from tf_agn.utils.training_loop import run_epochs


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, dict(logs)))


def _model():
    return keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])


def _run_epoch(epoch, callbacks):
    for step in range(2):
        callbacks.on_train_batch_begin(step)
        callbacks.on_train_batch_end(step, {"loss": 10.0 * epoch + step})
    return {"loss": 10.0 * epoch + 1}


def test_callbacks_history_validation_and_skipped_epochs():
    model, recorder = _model(), Recorder()
    history = run_epochs(
        model, 3, 2, _run_epoch, callbacks=[recorder], verbose=0,
        validate=lambda: {"loss": 0.5}, skip_epoch=lambda epoch: epoch == 0,
    )  # fmt: skip
    assert history is model.history
    assert history.epoch == [1, 2]
    assert history.history == {"loss": [11.0, 21.0], "val_loss": [0.5, 0.5]}
    assert recorder.events[:4] == [
        ("epoch_begin", 1),
        ("batch_end", 0, 10.0),
        ("batch_end", 1, 11.0),
        ("epoch_end", 1, {"loss": 11.0, "val_loss": 0.5}),
    ]


def test_early_stopping_ends_the_run():
    model = _model()
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, mode="max")
    # The loss rises every epoch, so "max" mode never stops; "min" stops
    # after the first epoch that does not improve: the second.
    history = run_epochs(model, 5, 2, _run_epoch, callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1, 2, 3, 4]
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, mode="min")
    history = run_epochs(_model(), 5, 2, _run_epoch, callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1]
