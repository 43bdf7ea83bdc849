"""`run_epochs`: `fit`'s epoch loop, with Keras callbacks, a progress bar,
the `History`, `val_` logs and early stopping, for tf_agn's trainers that
cannot use `keras.Model.fit` (`tf_agn.strategies.fit` and
`tf_agn.decoupled.DecoupledModel.fit`).
"""

import keras


# Keras 3's `fit` cannot run either trainer: it does not run under
# `ParameterServerStrategy`, where a step is a window scheduled on a
# `ClusterCoordinator` and fetched later; and an ADL tick is not one batch
# (the pipeline fills and drains around every epoch) and its stages are K
# models with K optimizers, not one `keras.Model`.
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
    """Runs `epochs` epochs of `run_epoch` between Keras' callbacks.

    Args:
        model: what the callbacks see as their `model`; it gets a
            `stop_training` attribute and the `History` as `model.history`.
        epochs: the number of epochs.
        steps_per_epoch: the steps (batches, windows) of an epoch, for the
            progress bar.
        run_epoch: `fn(epoch, callback_list) -> logs`: runs one epoch's
            steps, calling `callback_list.on_train_batch_begin/end` around
            each, and returns the epoch's training logs (a dict).
        callbacks: Keras callbacks.
        verbose: 0 silent, 1 a progress bar, 2 one line per epoch; "auto"
            is 1, as in `keras.Model.fit`.
        validate: None, or `fn() -> dict` evaluated after every epoch; its
            results join the logs with a `val_` prefix.
        skip_epoch: None, or `fn(epoch) -> bool`: whether an epoch is
            already done (restored from a checkpoint) and is skipped,
            callbacks included.

    Returns:
        The run's `keras.callbacks.History`.
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
