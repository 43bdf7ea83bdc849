"""`.keras` files of trained models whose optimizers are tf_agn's wrapping
optimizers, saved by the code as it stood before the windowed optimizers
became compositions (issue 27, point 2), so that a test can show that files
users saved then still load, with every optimizer variable restored.

Each configuration trains a small MLP for a few steps of `model.fit` under
`tf_agn.strategies.mirrored()` on 4 logical CPUs (mid-window, so that the
weights, the centers and the inner optimizer's state all differ) and saves:

    <name>.keras: the model, its optimizer's config and variables;
    <name>.npz: every optimizer variable's value as the saving process read
        it (`optimizer.variables`, in order, keyed by index and path).

Recording (once, on the code whose files must keep loading):

    python tests/saved_optimizers.py --record

tests/test_saved_optimizers.py loads them with the current code.
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_agn  # noqa: E402

DIRECTORY = pathlib.Path(__file__).parent / "data" / "saved_optimizers"
NUM_DEVICES = 4
STEPS = 7  # Past one window of 4 and into the next.


def configurations():
    """{name: a function that makes the optimizer, in a strategy's scope}."""
    return {
        "agn_adam_int8": lambda: tf_agn.optimizers.AGN(
            keras.optimizers.Adam(0.01),
            local_steps=4,
            outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
            compression="int8",
        ),
        "downpour_sgd": lambda: tf_agn.optimizers.DOWNPOUR(
            keras.optimizers.SGD(0.05, momentum=0.9), local_steps=4
        ),
        "dynsgd_default": lambda: tf_agn.optimizers.DynSGD(local_steps=4),
        "aeasgd_default": lambda: tf_agn.optimizers.AEASGD(local_steps=4),
        "eamsgd_powersgd": lambda: tf_agn.optimizers.EAMSGD(
            local_steps=4, compression=tf_agn.compression.PowerSGD(rank=1)
        ),
        "distributed_adamw_k2": lambda: tf_agn.optimizers.DistributedOptimizer(
            keras.optimizers.AdamW(0.01, weight_decay=0.1),
            aggregation_method="sum",
            gradient_accumulation_steps=2,
        ),
    }


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 16, 6)).astype("float32")
    y = rng.integers(0, 3, size=(STEPS * 16,))
    return x, y


def record(name, make_optimizer):
    strategy = tf_agn.strategies.mirrored()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = tf_agn.models.mlp((6,), 3, hidden_units=(8,))
        model.compile(make_optimizer(), loss="sparse_categorical_crossentropy")
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(DIRECTORY / f"{name}.keras")
    arrays = {
        f"{i}/{variable.path}": keras.ops.convert_to_numpy(variable)
        for i, variable in enumerate(model.optimizer.variables)
    }
    np.savez(DIRECTORY / f"{name}.npz", **arrays)


def load_expected(name):
    """[(index, path, array)] of the recorded optimizer variables, in order."""
    with np.load(DIRECTORY / f"{name}.npz") as arrays:
        entries = []
        for key in arrays.files:
            index, path = key.split("/", 1)
            entries.append((int(index), path, arrays[key]))
    return sorted(entries, key=lambda entry: entry[0])


def main(argv):
    if argv[1:] != ["--record"]:
        sys.exit(f"usage: python {argv[0]} --record")
    tf_agn.strategies.split_cpu(NUM_DEVICES)
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    for name, make_optimizer in configurations().items():
        record(name, make_optimizer)
        print("recorded", name)


if __name__ == "__main__":
    main(sys.argv)
