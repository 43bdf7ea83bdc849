"""`run_epochs`: Keras' `fit` plumbing for the loops Keras' `fit` cannot run.

Two of tf_agn's trainers cannot hand their steps to `keras.Model.fit`:

- parameter-server training (`tf_agn.strategies.fit`): Keras 3's `fit` does
  not run under `ParameterServerStrategy`, and a step there is a window
  scheduled on a `ClusterCoordinator`, fetched later;
- ADL (`tf_agn.decoupled.DecoupledModel.fit`): a tick is not one batch (the
  pipeline fills and drains around every epoch), and the stages are K
  models with K optimizers, not one `keras.Model`.

Both get the same user-visible behaviour from this one skeleton:
callbacks, a progress bar, the `History`, validation logs with a `val_`
prefix and early stopping through `model.stop_training`.
"""

import keras


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
