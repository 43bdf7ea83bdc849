"""Trains stock Keras under mixed precision through an overflow on one
replica and prints the result as JSON: after each step its weights, loss
scale and step count, and which `LossScaleOptimizer.check_finite`
decided.

Not a test module: tests/test_compat.py runs it twice, in fresh processes
(logical devices are set before TensorFlow starts), without and with
`--import_tf_agn`, and compares the two runs.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402

if "--import_tf_agn" in sys.argv:
    import tf_agn  # noqa: E402, F401  (replaces LossScaleOptimizer.check_finite)


def main():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 4, 4)) * 0.1).astype(np.float32)
    x[2, 2:] = 1e5  # replica 1's half of the last batch overflows float16
    y = (rng.normal(size=(3, 4, 1)) * 0.1).astype(np.float32)
    optimizer = model.optimizer
    check_finite = type(optimizer).check_finite
    steps = []
    for batch_x, batch_y in zip(x, y):
        model.fit(batch_x, batch_y, batch_size=4, shuffle=False, verbose=0)
        steps.append({
            "weights": [w.tolist() for w in model.get_weights()],
            "loss_scale": float(optimizer.dynamic_scale.numpy()),
            "step_counter": int(optimizer.step_counter.numpy()),
        })
    print(json.dumps({
        "check_finite": f"{check_finite.__module__}.{check_finite.__qualname__}",
        "steps": steps,
    }))


if __name__ == "__main__":
    main()
