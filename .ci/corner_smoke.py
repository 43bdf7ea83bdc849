"""A corner's smoke run (.ci/corners): a `fit` under `mirrored()` with
sharded Adam state, int8 compression and gradient accumulation, then one
`.keras` save and load. Exits non-zero, saying why, if anything is off."""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn.optimizers import saving  # noqa: E402

tf_agn.strategies.split_cpu(4)
print(f"Python {sys.version.split()[0]}, TensorFlow {tf.__version__}, Keras {keras.__version__}")
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(1024, 16)).astype(np.float32)
y = (x @ np.linspace(-1, 1, 16).astype(np.float32) > 0).astype(np.int32)

strategy = tf_agn.strategies.mirrored()
with strategy.scope():
    model = tf_agn.models.mlp((16,), 2)
    model.compile(
        optimizer=tf_agn.optimizers.Adam(
            1e-2, shard_optimizer_state=True, compression="int8", gradient_accumulation_steps=2
        ),
        loss="sparse_categorical_crossentropy",
    )
losses = model.fit(x, y, batch_size=128, epochs=4, verbose=0).history["loss"]
print(f"losses by epoch: {np.round(losses, 4).tolist()}")
assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
copies = tf_agn.replica_weights(model)
for replica in copies[1:]:
    for mine, first in zip(replica, copies[0]):
        np.testing.assert_array_equal(mine, first, err_msg="replicas' weights differ")

path = os.path.join(tempfile.mkdtemp(), "smoke.keras")
model.save(path)
with strategy.scope():
    loaded = keras.saving.load_model(path)
np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
# The sharded moments, gathered whole as Keras saves them.
for mine, saved in zip(saving.saved_values(loaded.optimizer), saving.saved_values(model.optimizer)):
    np.testing.assert_array_equal(mine, saved)
print(f"saved and loaded {path}: the same predictions and optimizer variables")
