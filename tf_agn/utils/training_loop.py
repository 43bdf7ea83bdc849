"""`run_epochs`: `fit`'s epoch loop for trainers that cannot use `fit`."""

import keras


# Keras 3's `fit` does not run under `ParameterServerStrategy`, and an ADL
# tick is not one batch of one `keras.Model`.
def run_epochs(
    model,
    epochs,
    steps_per_epoch,
    run_epoch,
    callbacks=None,
    verbose="auto",
    validate=None,
    skip_epoch=None,
):
    """Runs `epochs` epochs of `run_epoch` between Keras's callbacks and
    returns the `History`.

    Args:
        model: the callbacks' `model`; gets `stop_training` and `history`.
        epochs: the number of epochs.
        steps_per_epoch: the steps of an epoch, for the progress bar.
        run_epoch: `fn(epoch, callback_list) -> logs`, calling the batch
            callbacks around each step.
        callbacks: Keras callbacks.
        verbose: as in `keras.Model.fit`.
        validate: None, or `fn() -> dict` whose results join the logs with
            a `val_` prefix.
        skip_epoch: None, or `fn(epoch) -> bool`: whether an epoch restored
            from a checkpoint is skipped, callbacks included.
    """
    verbose = 1 if verbose == "auto" else verbose
    callback_list = keras.callbacks.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps_per_epoch,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    for epoch in range(epochs):
        if skip_epoch is not None and skip_epoch(epoch):
            continue
        callback_list.on_epoch_begin(epoch)
        logs = dict(run_epoch(epoch, callback_list))
        if validate is not None:
            logs.update({f"val_{name}": value for name, value in validate().items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history
