"""`evaluate`: the compiled loss and metrics of the center (the model's own,
parameter-server weights), computed in the coordinator."""

import tensorflow as tf

from tf_agn import _compat


def evaluate(model, data):
    """Evaluates the center: the model's own (parameter-server) weights.

    The workers pull from and commit to the center; this measures it
    directly, batch by batch, in this process.

    Args:
        model: the compiled Keras model.
        data: a `tf.data.Dataset` of `(x, y)` batches, or an `(x, y)` tuple
            (evaluated in batches of 256).

    Returns:
        `{"loss": float, <compiled metric>: float, ...}`.

    Example:

    ```python
    history = tf_agn.strategies.fit(model, dataset_fn, steps_per_epoch=40)
    print(tf_agn.strategies.evaluate(model, (x_test, y_test))["loss"])
    ```
    """
    if isinstance(data, tuple):
        data = tf.data.Dataset.from_tensor_slices(data).batch(256)
    model.reset_metrics()
    loss, metrics = _compat.compiled_loss(model), _compat.compiled_metrics(model)
    total, count = 0.0, 0
    for batch in data:
        x, y = batch[:2]
        y_pred = model(x, training=False)
        size = int(tf.shape(y_pred)[0])
        total += float(loss(y, y_pred)) * size
        count += size
        if metrics is not None:
            metrics.update_state(y, y_pred)
    results = {"loss": total / max(count, 1)}
    results.update(_metric_results(model))
    return results


def build_compiled_metrics(model, dataset):
    """Builds the compiled loss and metrics eagerly, from one batch of
    `dataset`."""
    # Workers use the loss inside traced functions, where variables cannot
    # be created.
    x, y = next(iter(dataset))[:2]
    with model.distribute_strategy.scope():
        y_pred = model(x, training=False)
        _compat.compiled_loss(model)(y, y_pred)
        metrics = _compat.compiled_metrics(model)
        if metrics is not None:
            metrics.update_state(y, y_pred)
    model.reset_metrics()


def _metric_results(model):
    """`{name: float}` of the compiled metrics' results."""
    metrics = _compat.compiled_metrics(model)
    if metrics is None:
        return {}
    return {name: float(value) for name, value in metrics.result().items()}
