"""Parameter-server training scenarios, each run by test_parameter_server.py
in a process of its own.

It is not a test module: connecting a `ParameterServerStrategy` makes the
whole process a cluster's coordinator for good, and later tests in that
process would run against it. Each scenario prints one JSON line of
results last.

Usage: python ps_scenarios.py SCENARIO [ARGS...]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_agn  # noqa: E402
from tf_agn.strategies import LocalCluster  # noqa: E402
from tf_agn.strategies import parameter_server  # noqa: E402

LOCAL_STEPS = 3
NUM_WINDOWS = 4


def sequence_batches(input_context):
    """A fixed sequence of batches, the same for every worker."""
    del input_context
    rng = np.random.default_rng(7)
    x = rng.normal(size=(LOCAL_STEPS * NUM_WINDOWS * 2, 4, 5)).astype(np.float32)
    y = rng.normal(size=(LOCAL_STEPS * NUM_WINDOWS * 2, 4, 2)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y))


def regression_data(seed=0):
    x = np.random.default_rng(seed).normal(size=(256, 5)).astype(np.float32)
    return x, x[:, :2] * 0.5


def repeated(x, y):
    return lambda input_context: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)


def linear_model(optimizer):
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(0.1)),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def agn(compression=None):
    return tf_agn.optimizers.AGN(
        keras.optimizers.Adam(0.01), local_steps=LOCAL_STEPS, compression=compression
    )


def one_worker_against_simulator(num_ps="1", compression="none"):
    """With 2 ps, every variable is split in 2 shards (`variable_partitioner`).
    With a compression, commits travel compressed to the ps."""
    num_ps = int(num_ps)
    compression = None if compression == "none" else compression
    reference = linear_model(agn(compression))
    simulation = tf_agn.strategies.simulate(
        reference,
        sequence_batches,
        num_workers=1,
        num_windows=NUM_WINDOWS,
    )
    # Read before connecting: local variables are unreachable afterwards.
    expected = [w.tolist() for w in reference.get_weights()]
    with LocalCluster(num_workers=1, num_ps=num_ps) as cluster:
        strategy = parameter_server(cluster, variable_partitioner=num_ps)
        with strategy.scope():
            model = linear_model(agn(compression))
        shards = [
            len(getattr(v.value, "variables", [v])) for v in model.trainable_variables
        ]
        history = tf_agn.strategies.fit(
            model,
            sequence_batches,
            epochs=1,
            steps_per_epoch=LOCAL_STEPS * NUM_WINDOWS,
            verbose=0,
        )
        return {
            "expected": expected,
            "actual": [w.tolist() for w in model.get_weights()],
            "commits": int(history.server.commits.numpy()),
            "loss": history.history["loss"][0],
            "simulated_loss": float(np.mean(simulation.losses)),
            "staleness": history.staleness.values().tolist(),
            "shards": shards,
            "bytes_per_commit": history.server.bytes_per_commit,
            "bytes_received": int(history.server.bytes_received.numpy()),
        }


def callbacks_and_validation(log_dir):
    x, y = regression_data()
    epochs_seen = []

    class Recorder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epochs_seen.append((epoch, sorted(logs)))

    with LocalCluster(num_workers=2) as cluster:
        with parameter_server(cluster).scope():
            model = linear_model(agn())
        history = tf_agn.strategies.fit(
            model,
            repeated(x, y),
            epochs=3,
            steps_per_epoch=4 * LOCAL_STEPS,
            validation_data=(x, y),
            callbacks=[
                Recorder(),
                keras.callbacks.CSVLogger(os.path.join(log_dir, "log.csv")),
                keras.callbacks.TensorBoard(os.path.join(log_dir, "tb")),
                # An impossible min_delta: stops once patience runs out.
                keras.callbacks.EarlyStopping("val_loss", patience=1, min_delta=10.0),
            ],
            verbose=0,
        )
        predicted = model(x, training=False).numpy()
        return {
            "epochs": epochs_seen,
            "history": history.history,
            "mse_at_center": float(np.mean((predicted - y) ** 2)),
            "staleness_counts": history.staleness.histogram()[1].tolist(),
        }


class KillTask(keras.callbacks.Callback):
    """Kills a server of `cluster` after `at_window` windows were fetched."""

    def __init__(self, kill, at_window):
        super().__init__()
        self.kill = kill
        self.at_window = at_window
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at_window:
            self.kill()


def killed_worker():
    x, y = regression_data(1)
    epochs, windows_per_epoch = 2, 10
    with LocalCluster(num_workers=3, mode="processes") as cluster:
        killed_pid = cluster.pids["worker"][1]
        with parameter_server(cluster).scope():
            model = linear_model(agn())
        history = tf_agn.strategies.fit(
            model,
            repeated(x, y),
            epochs=epochs,
            steps_per_epoch=windows_per_epoch * LOCAL_STEPS,
            callbacks=[KillTask(lambda: cluster.kill_worker(1), at_window=4)],
            verbose=0,
        )
        server = history.server
        return {
            "scheduled": epochs * windows_per_epoch,
            "commits": int(server.commits.numpy()),
            "applied_windows": int(server.applied_windows.numpy().sum()),
            "duplicates": int(server.duplicates.numpy()),
            "rejected": int(server.rejected.numpy()),
            "killed_worker_alive": os.path.exists(f"/proc/{killed_pid}"),
        }


def checkpointed_run(checkpoint_dir, kill_ps_at):
    """Trains 24 windows, checkpointing every 4; optionally kills the ps."""
    x, y = regression_data(2)
    restored = tf.train.latest_checkpoint(checkpoint_dir)
    restored_commits = 0
    if restored:
        reader = tf.train.load_checkpoint(restored)
        (key,) = [
            k for k in reader.get_variable_to_shape_map() if k.startswith("commits/")
        ]
        restored_commits = int(reader.get_tensor(key))
    print(f"restored_commits={restored_commits}", flush=True)
    with LocalCluster(num_workers=2, mode="processes") as cluster:
        with parameter_server(cluster).scope():
            model = linear_model(agn())
        callbacks = []
        if int(kill_ps_at) >= 0:
            callbacks.append(KillTask(lambda: cluster.kill_ps(0), int(kill_ps_at)))
        history = tf_agn.strategies.fit(
            model,
            repeated(x, y),
            epochs=2,
            steps_per_epoch=12 * LOCAL_STEPS,
            callbacks=callbacks,
            verbose=0,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=4,
        )
        server = history.server
        return {
            "restored_commits": restored_commits,
            "commits": int(server.commits.numpy()),
            "applied_windows": int(server.applied_windows.numpy().sum()),
        }


def misuse():
    errors = {}
    with LocalCluster(num_workers=1) as cluster:
        with parameter_server(cluster).scope():
            plain = linear_model(keras.optimizers.SGD())
            windowed = linear_model(agn())
        attempts = {
            "plain_optimizer": lambda: tf_agn.strategies.fit(
                plain, sequence_batches, steps_per_epoch=3
            ),
            "no_steps": lambda: tf_agn.strategies.fit(
                windowed, sequence_batches, steps_per_epoch=0
            ),
            "keras_fit": lambda: windowed.fit(
                np.zeros((4, 5)), np.zeros((4, 2)), verbose=0
            ),
            "apply": lambda: windowed.optimizer.apply(
                [tf.zeros_like(v) for v in windowed.trainable_variables],
                windowed.trainable_variables,
            ),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
                errors[name] = None
            except Exception as error:  # noqa: BLE001 - reported to the test
                errors[name] = f"{type(error).__name__}: {error}"
    return errors


SCENARIOS = {
    "one_worker_against_simulator": one_worker_against_simulator,
    "callbacks_and_validation": callbacks_and_validation,
    "killed_worker": killed_worker,
    "checkpointed_run": checkpointed_run,
    "misuse": misuse,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])))
