"""The model zoo (issue 37): everyday models, tf_agn's options as the
columns of a pairwise covering array, and references computed with stock
Keras, so that every cell's weights can be compared with what stock Keras
(or tf_agn's documented rule) gives.

A cell is a dict {column: value}. `run_tf_agn(cell, ...)` trains the cell's
model with tf_agn; `run_reference(cell, ...)` trains it with stock Keras
optimizers, as the cell's option says tf_agn should behave; both return the
trainable weights of every replica. `deviation` compares them.
"""

import itertools
import os

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import tf_agn
from conftest import DEVICES

SEED = 7
REPLICAS = 2  # the replicas every cell is compared on
PER_REPLICA = 8
GLOBAL_BATCH = REPLICAS * PER_REPLICA
STEPS = 4  # global batches of every cell
SPLIT = 2  # a checkpoint falls after this many global batches
ACCUMULATION = 2  # gradient_accumulation_steps when the column says so
LOCAL_STEPS = 2  # AGN's λ
BACKUP_REPLICAS = 4  # a backup is written on this many replicas, resumed on REPLICAS


# Models ---------------------------------------------------------------------


def _zero_dropout(model):
    # keras.applications hard-code dropout (EfficientNet's stochastic depth
    # too): rate 0 before the first trace makes every Dropout the identity,
    # so trajectories compare.
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def mobilenet():
    return _zero_dropout(keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, dropout_rate=0.0,
        include_preprocessing=False,
    ))


def efficientnet():
    return _zero_dropout(
        keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, classes=4)
    )


def transformer():
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(50, 16)(tokens)
    # No biases: the key projection's bias has a gradient of exactly zero
    # in theory (softmax ignores a constant), so rounding noise in practice,
    # whose sign Lion would follow by whole steps.
    attention = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=8, dropout=0.0, use_bias=False)(h, h)
    h = keras.layers.LayerNormalization()(h + attention)
    feed_forward = keras.layers.Dense(16)(keras.layers.Dense(32, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + feed_forward)
    h = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(3)(h)
    return keras.Model(tokens, keras.layers.Activation("softmax", dtype="float32")(logits))


def text_gru():
    return keras.Sequential([
        keras.Input((8,), dtype="int32"),
        keras.layers.Embedding(50, 8),
        keras.layers.GRU(8),
        keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
    ])


def regression():
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def two_outputs():
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(x, {
        "scored": keras.layers.Dense(3, dtype="float32", name="scored")(h),
        "unscored": keras.layers.Dense(2, dtype="float32", name="unscored")(h),
    })


def frozen_backbone():
    backbone = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(16, activation="relu"),
    ], name="backbone")
    backbone.trainable = False
    return keras.Sequential([
        keras.Input((6,)), backbone, keras.layers.Dense(3, dtype="float32"),
    ])


@keras.saving.register_keras_serializable("model_zoo")
class GAN(keras.Model):
    """A GAN's shape: two optimizers, each applied to its own variables.

    `compile(optimizer=d_optimizer)` lets `fit` build the discriminator's
    optimizer on all the model's variables, as it does for any compiled
    optimizer: the discriminator's step then applies it to a subset.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6),
        ], name="generator")
        self.discriminator = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ], name="discriminator")

    def call(self, x):
        return self.discriminator(self.generator(x[:, 6:]) + x[:, :6])

    def compile(self, optimizer, generator_optimizer, **kwargs):
        super().compile(optimizer=optimizer, **kwargs)
        self.generator_optimizer = generator_optimizer

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        real, noise = x[:, :6], x[:, 6:]
        # As `compute_loss` does: the replicas' gradients are summed.
        per_replica = 1.0 / tf.distribute.get_strategy().num_replicas_in_sync

        def bce(label, logits):
            labels = ops.full_like(logits, label)
            return ops.mean(keras.losses.binary_crossentropy(labels, logits, from_logits=True))

        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            d_loss = (bce(1.0, self.discriminator(real)) + bce(0.0, self.discriminator(fake)))
            scaled = self.optimizer.scale_loss(d_loss * per_replica)
        weights = self.discriminator.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, weights), weights)
        with tf.GradientTape() as tape:
            g_loss = bce(1.0, self.discriminator(self.generator(noise))) * per_replica
        weights = self.generator.trainable_variables
        self.generator_optimizer.apply(tape.gradient(g_loss, weights), weights)
        return {"d_loss": d_loss, "g_loss": g_loss}


def _classes(rng, rows, n):
    return rng.randint(0, n, rows).astype("int32")


# name: (build, data(rng, rows) -> (x, y), compile keyword arguments)
MODELS = {
    "mobilenet": (
        mobilenet,
        lambda rng, rows: (rng.randn(rows, 32, 32, 3).astype("float32"), _classes(rng, rows, 4)),
        {"loss": "sparse_categorical_crossentropy"},
    ),
    "efficientnet": (
        efficientnet,
        lambda rng, rows: (rng.rand(rows, 32, 32, 3).astype("float32") * 255, _classes(rng, rows, 4)),
        {"loss": "sparse_categorical_crossentropy"},
    ),
    "transformer": (
        transformer,
        lambda rng, rows: (_classes(rng, rows * 8, 50).reshape(rows, 8), _classes(rng, rows, 3)),
        {"loss": "sparse_categorical_crossentropy"},
    ),
    "text_gru": (
        text_gru,
        lambda rng, rows: (
            _classes(rng, rows * 8, 50).reshape(rows, 8), _classes(rng, rows, 2).astype("float32")
        ),
        {"loss": "binary_crossentropy"},
    ),
    "regression": (
        regression,
        lambda rng, rows: (rng.randn(rows, 6).astype("float32"), rng.randn(rows, 1).astype("float32")),
        {"loss": "mse"},
    ),
    "two_outputs": (
        two_outputs,
        lambda rng, rows: (rng.randn(rows, 6).astype("float32"), {"scored": rng.randn(rows, 3).astype("float32")}),
        {"loss": {"scored": "mse"}},
    ),
    "frozen_backbone": (
        frozen_backbone,
        lambda rng, rows: (rng.randn(rows, 6).astype("float32"), rng.randn(rows, 3).astype("float32")),
        {"loss": "mse"},
    ),
    "gan": (
        GAN,
        lambda rng, rows: (rng.randn(rows, 10).astype("float32"), None),
        None,
    ),
}
# Models that train with batch statistics.
BATCH_NORM_TRAINING = {"mobilenet", "efficientnet"}
# The fast tier's: a cell of each takes a few seconds.
SMALL_MODELS = ["regression", "text_gru", "two_outputs", "gan"]


def data(model_name):
    _, make, _ = MODELS[model_name]
    return make(np.random.RandomState(SEED), STEPS * GLOBAL_BATCH)


def _take(value, index):
    """Rows `index` of an array, of each array of a dict, or None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: array[index] for key, array in value.items()}
    return value[index]


def rows(data_xy, start, stop):
    return tuple(_take(v, slice(start, stop)) for v in data_xy)


def shard(data_xy, replica, replicas):
    """Replica `replica`'s rows of every global batch, in order, as
    `MirroredStrategy` splits each batch into consecutive shards."""
    share = GLOBAL_BATCH // replicas
    index = np.concatenate([
        np.arange(start + replica * share, start + (replica + 1) * share)
        for start in range(0, len(data_xy[0]), GLOBAL_BATCH)
    ])
    return tuple(_take(v, index) for v in data_xy)


# Options --------------------------------------------------------------------

OPTIMIZERS = {
    "adamw": (keras.optimizers.AdamW, {"learning_rate": 1e-2, "weight_decay": 0.3}),
    "lion": (keras.optimizers.Lion, {"learning_rate": 1e-3}),
    "sgd": (keras.optimizers.SGD, {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
}
DROP_INS = {
    "adamw": tf_agn.optimizers.AdamW,
    "lion": tf_agn.optimizers.aggregating_class(keras.optimizers.Lion),
    "sgd": tf_agn.optimizers.SGD,
}
COMPRESSORS = {
    None: lambda: None,
    "fp16": lambda: "fp16",
    "bf16": lambda: "bf16",
    "int8": lambda: tf_agn.compression.Int8(chunk_size=64),
    "powersgd": lambda: tf_agn.compression.PowerSGD(rank=1),
}

# The columns, in order. A new option is one more entry here (its first
# value the default, which every other value must accept), plus what
# `run_tf_agn` does with it.
COLUMNS = {
    "model": list(MODELS),
    "optimizer": list(OPTIMIZERS),
    "wrapper": ["drop_in", "distributed"],
    "aggregation": ["mean", "sum", "only_first_replica", "none"],
    "shard": [False, True],
    "accumulation": [None, ACCUMULATION],
    "compression": list(COMPRESSORS),
    "agn": [False, True],
    "steps_per_execution": [1, 2],
    "checkpoint": [None, "keras", "backup"],
    "policy": ["float32", "mixed_float16"],
}


# Pairs that tf_agn refuses: (pair, the error message's pattern). Left out
# of the array, each asserted once to raise.
REFUSED = [
    ({"shard": True, "aggregation": "only_first_replica"}, "aggregation ONLY_FIRST_REPLICA"),
    ({"shard": True, "aggregation": "none"}, "aggregation NONE"),
    ({"shard": True, "compression": "powersgd"}, r"compression='powersgd', which carries no reduce-scatter \(fp16, bf16, int8 and int4 shard"),
    ({"agn": True, "accumulation": ACCUMULATION}, "takes no gradient_accumulation_steps"),
    # AGN's inner optimizer steps locally (NONE), which does not shard.
    ({"agn": True, "shard": True}, "aggregation NONE"),
    # AGN takes the Keras optimizer and the commits' settings itself.
    ({"agn": True, "wrapper": "distributed"}, "AGN wraps a Keras optimizer, not DistributedOptimizer"),
]

# Pairs this suite has no reference for (not refusals): each says why.
NO_REFERENCE = [
    # Keras's accumulation is the reference, on one device: batch
    # statistics of a 16-row batch are not those of two 8-row shards.
    *[({"model": name, "accumulation": ACCUMULATION}, "batch statistics")
      for name in sorted(BATCH_NORM_TRAINING)],
    # A subclassed model with two optimizers has no .keras config to load.
    ({"model": "gan", "checkpoint": "keras"}, "no config"),
    ({"model": "gan", "checkpoint": "backup"}, "two optimizers"),
    # Independent replicas, or AGN's per-replica inner states, joined or
    # split on another replica count: no stock rule to compare with.
    ({"aggregation": "none", "checkpoint": "backup"}, "per-replica weights"),
    ({"agn": True, "checkpoint": "backup"}, "per-replica inner state"),
]


def _matches(pair, cell):
    return all(cell.get(column) == value for column, value in pair.items())


def excluded(cell):
    """Whether a (partial) cell holds a refused or incomparable pair."""
    return any(_matches(pair, cell) for pair, _ in REFUSED + NO_REFERENCE)


def covering_array(columns, excluded):
    """A pairwise covering array of `columns`, deterministically.

    Greedy, in the manner of AETG without its random candidates: while a
    valid pair of values (two columns) is uncovered, start a row from the
    first uncovered pair in column order, then give every other column, in
    order, the value that covers the most uncovered pairs with the values
    already chosen (the first such value on ties), among those that
    `excluded` accepts. A pair that `excluded` refuses is never required.
    So a new option is one more entry of `columns` (and of `excluded`).

    Args:
        columns: {name: [values]}, the first value of each the default.
        excluded: a function of a partial row {name: value} that says
            whether it holds a pair that must not appear.

    Returns:
        A list of rows, each a dict {name: value} over every column.
    """
    names = list(columns)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in columns[a] for vb in columns[b]
        if not excluded({a: va, b: vb})
    }
    order = {
        ((a, va), (b, vb)): (names.index(a), columns[a].index(va), names.index(b), columns[b].index(vb))
        for (a, va), (b, vb) in uncovered
    }
    rows = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=order.__getitem__)
        row = {a: va, b: vb}
        for name in names:
            if name in row:
                continue
            gains = [
                (sum(((n, v), (name, value)) in uncovered or ((name, value), (n, v)) in uncovered
                     for n, v in row.items()), -i, value)
                for i, value in enumerate(columns[name])
                if not excluded({**row, name: value})
            ]
            if not gains:
                raise ValueError(f"No value of {name!r} fits {row}.")
            row[name] = max(gains, key=lambda gain: gain[:2])[2]
        uncovered -= {
            ((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)
        }
        rows.append(row)
    return rows


def cell_id(cell):
    """The cell's name: its model, then every option off its default."""
    parts = [cell["model"], cell["optimizer"], cell["wrapper"]]
    for name in list(COLUMNS)[3:]:
        value = cell[name]
        if value != COLUMNS[name][0] or name == "aggregation":
            parts.append(name if value is True else f"{name}={value}")
    return "-".join(str(p) for p in parts)


# Training -------------------------------------------------------------------


def stock_optimizer(name, accumulation=None, keras_loss_divisor=1):
    """Keras's own optimizer `name`, its gradients multiplied by
    `keras_loss_divisor` (a power of two: exactly)."""
    base, settings = OPTIMIZERS[name]
    cls = base if keras_loss_divisor == 1 else type(base.__name__, (base,), {
        "apply": lambda self, grads, variables=None: base.apply(
            self, [_scaled(g, keras_loss_divisor) for g in grads], variables
        ),
    })
    optimizer = cls(**settings, gradient_accumulation_steps=accumulation)
    _exclude(name, optimizer)
    return optimizer


def _scaled(gradient, scale):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * scale, gradient.indices, gradient.dense_shape)
    return None if gradient is None else gradient * scale


def _exclude(name, optimizer):
    if name == "adamw":
        optimizer.exclude_from_weight_decay(var_names=["bias"])


def tf_agn_optimizer(cell):
    """The cell's tf_agn optimizer: a drop-in or `DistributedOptimizer`
    around Keras's, and AGN around that where the cell says so (AGN then
    aggregates and compresses the commits; its inner optimizer steps
    locally)."""
    name = cell["optimizer"]
    base, settings = OPTIMIZERS[name]
    options = {
        "shard_optimizer_state": cell["shard"],
        "gradient_accumulation_steps": cell["accumulation"],
    }
    if not cell["agn"]:
        options["aggregation_method"] = cell["aggregation"]
        options["compression"] = COMPRESSORS[cell["compression"]]()
    if cell["wrapper"] == "drop_in":
        optimizer = DROP_INS[name](**settings, **options)
        _exclude(name, optimizer)
    else:
        optimizer = base(**settings)
        _exclude(name, optimizer)
        optimizer = tf_agn.optimizers.DistributedOptimizer(optimizer, **options)
    if not cell["agn"]:
        return optimizer
    return tf_agn.optimizers.AGN(
        optimizer, local_steps=LOCAL_STEPS, aggregation_method=cell["aggregation"],
        compression=COMPRESSORS[cell["compression"]](),
    )


def build(cell, strategy, make_optimizer, initial, steps_per_execution=1):
    """The cell's model in `strategy`'s scope, with weights `initial`,
    compiled with optimizers from `make_optimizer()`."""
    make_model, _, compile_kwargs = MODELS[cell["model"]]
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        model = make_model()
        model.set_weights(initial)
        if compile_kwargs is None:
            compile_kwargs = {"generator_optimizer": make_optimizer()}
        model.compile(
            optimizer=make_optimizer(), steps_per_execution=steps_per_execution, **compile_kwargs
        )
    return model


def initial_weights(cell):
    """The cell's model's initial weights, all and trainable ones."""
    keras.utils.set_random_seed(SEED)
    model = MODELS[cell["model"]][0]()
    weights = model.get_weights(), trainable(model)
    keras.backend.clear_session()
    return weights


def trainable(model):
    return [w.numpy() for w in model.trainable_variables]


def fit(model, data_xy, batch_size, **kwargs):
    x, y = data_xy
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, **kwargs)


def mirrored(replicas):
    return tf_agn.strategies.mirrored(devices=DEVICES[:replicas])


def stock_mirrored(replicas):
    # Not TensorFlow's default CollectiveAllReduce on CPUs: stock strategies
    # made one after another in one process have met each other's
    # collectives (a shape mismatch), and an aborted collective fails every
    # later one in the process ("Restart your program to reset").
    return tf.distribute.MirroredStrategy(
        devices=DEVICES[:replicas], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def run_tf_agn(cell, initial, directory):
    """Trains the cell with tf_agn on REPLICAS replicas (the first half on
    BACKUP_REPLICAS with a backup); returns every replica's trainable
    weights, a list of lists of arrays."""
    all_rows = data(cell["model"])
    first = rows(all_rows, 0, SPLIT * GLOBAL_BATCH)
    second = rows(all_rows, SPLIT * GLOBAL_BATCH, None)
    strategy = mirrored(REPLICAS)

    def build_tf_agn(strategy):
        return build(cell, strategy, lambda: tf_agn_optimizer(cell), initial,
                     cell["steps_per_execution"])

    if cell["checkpoint"] is None:
        model = build_tf_agn(strategy)
        fit(model, all_rows, GLOBAL_BATCH)
    elif cell["checkpoint"] == "keras":
        model = build_tf_agn(strategy)
        fit(model, first, GLOBAL_BATCH)
        path = os.path.join(directory, "mid_run.keras")
        model.save(path)
        with strategy.scope():
            model = keras.saving.load_model(path)
        fit(model, second, GLOBAL_BATCH)
    else:
        backup_dir = os.path.join(directory, "backup")
        model = build_tf_agn(mirrored(BACKUP_REPLICAS))
        fit(model, first, GLOBAL_BATCH, epochs=1, callbacks=[
            tf_agn.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)])
        model = build_tf_agn(strategy)
        fit(model, second, GLOBAL_BATCH, epochs=2,
            callbacks=[tf_agn.callbacks.BackupAndRestore(backup_dir)])
    return tf_agn.replica_weights(model.trainable_variables)


def _parts(cell):
    """[(replicas, rows)]: how many replicas train on which rows."""
    all_rows = data(cell["model"])
    if cell["checkpoint"] != "backup":
        return [(REPLICAS, all_rows)]
    return [
        (BACKUP_REPLICAS, rows(all_rows, 0, SPLIT * GLOBAL_BATCH)),
        (REPLICAS, rows(all_rows, SPLIT * GLOBAL_BATCH, None)),
    ]


def run_reference(cell, initial):
    """The weights that the cell's options promise, from stock Keras's
    optimizers (for AGN, `agn_reference`): every replica's, or one list
    that every replica must hold."""
    if cell["agn"]:
        return agn_reference(cell, initial)
    method, accumulation = cell["aggregation"], cell["accumulation"]
    one_device = tf.distribute.get_strategy
    if method in ("mean", "sum"):
        # SUM applies the sum of the replicas' gradients: n times the mean.
        scale = lambda n: n if method == "sum" else 1  # noqa: E731
        if accumulation:
            # Keras's accumulation fails under strategies (keras#20582).
            runs = [[(one_device(), part, GLOBAL_BATCH, scale(n)) for n, part in _parts(cell)]]
        else:
            runs = [[(stock_mirrored(n), part, GLOBAL_BATCH, scale(n)) for n, part in _parts(cell)]]
    else:
        # Replica r applies its own gradient (NONE) or replica 0's: that
        # of one device training on replica r's rows.
        replicas = range(REPLICAS) if method == "none" else [0]
        runs = [
            [(one_device(), shard(part, r, n), GLOBAL_BATCH // n, 1) for n, part in _parts(cell)]
            for r in replicas
        ]
        if method == "none" and cell["checkpoint"] == "keras":
            # A .keras file holds replica 0's weights and state, which
            # every replica resumes from, each on its own rows.
            replica_0 = _run_stock(cell, initial, [], rows_until=SPLIT)
            return [
                trainable(_run_stock(cell, initial, [], model=replica_0, rows_from=(SPLIT, r)))
                for r in replicas
            ]
    return [trainable(_run_stock(cell, initial, parts)) for parts in runs]


def _run_stock(cell, initial, parts, model=None, rows_until=None, rows_from=None):
    """Trains a stock model through `parts` [(strategy, rows, batch size,
    gradient scale)], carrying its state from one part to the next (from
    `model`, if given). With `rows_until` or `rows_from` = (step, r), the
    parts are one device's on replica r's rows before or after the global
    step."""
    if rows_until is not None:
        part = shard(rows(data(cell["model"]), 0, rows_until * GLOBAL_BATCH), 0, REPLICAS)
        parts = [(tf.distribute.get_strategy(), part, PER_REPLICA, 1)]
    if rows_from is not None:
        step, r = rows_from
        part = shard(rows(data(cell["model"]), step * GLOBAL_BATCH, None), r, REPLICAS)
        parts = [(tf.distribute.get_strategy(), part, PER_REPLICA, 1)]
    for strategy, part, batch_size, scale in parts:
        resumed = build(
            cell, strategy,
            lambda: stock_optimizer(cell["optimizer"], cell["accumulation"], scale), initial,
        )
        if model is not None:
            _copy_state(model, resumed, strategy)
        fit(resumed, part, batch_size)
        model = resumed
    return model


def _copy_state(source, target, strategy):
    """Weights and optimizer state, as a stock resume would load them."""
    weights = source.get_weights()
    state = [v.numpy() for v in source.optimizer.variables]
    with strategy.scope():
        target.set_weights(weights)
        target.optimizer.build(target.trainable_variables)
        for variable, value in zip(target.optimizer.variables, state, strict=True):
            variable.assign(value)


def agn_reference(cell, initial):
    """Every replica's center after AGN's windows, computed the documented
    way: each replica takes LOCAL_STEPS steps of the Keras optimizer from
    its center on its own rows, on one device; the center moves by the
    combination of the replicas' (θ_r − θ_c)/λ (outer SGD(1.0); with NONE
    each replica's own); every replica restarts from it and keeps its
    optimizer state. A .keras file holds replica 0's state, which every
    replica resumes with."""
    name, method = cell["optimizer"], cell["aggregation"]
    all_rows = data(cell["model"])
    models = [
        build(cell, tf.distribute.get_strategy(), lambda: stock_optimizer(name), initial)
        for _ in range(REPLICAS)
    ]
    shards = [shard(all_rows, r, REPLICAS) for r in range(REPLICAS)]
    flat = lambda arrays: np.concatenate([a.ravel() for a in arrays])  # noqa: E731
    like = trainable(models[0])
    centers = np.stack([flat(like)] * REPLICAS)
    window_rows = LOCAL_STEPS * PER_REPLICA
    for window in range(STEPS // LOCAL_STEPS):
        for model, rows_r, center in zip(models, shards, centers):
            for variable, value in zip(model.trainable_variables, _unflatten(center, like)):
                variable.assign(value)
            fit(model, rows(rows_r, window * window_rows, (window + 1) * window_rows), PER_REPLICA)
        deltas = (np.stack([flat(trainable(m)) for m in models]) - centers) / np.float32(LOCAL_STEPS)
        centers = centers + {
            "mean": deltas.mean(0), "sum": deltas.sum(0), "only_first_replica": deltas[0],
            "none": deltas,
        }[method]
        if cell["checkpoint"] == "keras" and (window + 1) * LOCAL_STEPS == SPLIT:
            centers = np.stack([centers[0]] * REPLICAS)
            for model in models[1:]:
                for to, value in zip(model.optimizer.variables, models[0].optimizer.variables):
                    to.assign(value.numpy())
    return [_unflatten(center.astype("float32"), like) for center in centers]


def _unflatten(flat, like):
    sizes = np.cumsum([0] + [a.size for a in like])
    return [flat[a:b].reshape(w.shape) for a, b, w in zip(sizes[:-1], sizes[1:], like)]


def deviation(got, want, initial):
    """‖w − w_ref‖₂ / ‖w_ref − w₀‖₂ over all trainable weights together."""
    flat = lambda arrays: np.concatenate([np.ravel(a).astype("float64") for a in arrays])  # noqa: E731
    return float(np.linalg.norm(flat(got) - flat(want)) / np.linalg.norm(flat(want) - flat(initial)))
