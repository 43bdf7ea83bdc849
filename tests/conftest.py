"""Test set-up: 4 logical CPU devices, so MirroredStrategy runs 4 replicas."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tf_agn.strategies import split_cpu  # noqa: E402

NUM_REPLICAS = 4
DEVICES = split_cpu(NUM_REPLICAS)


@pytest.fixture
def devices():
    return list(DEVICES)


def stock_mirrored(devices=DEVICES):
    """A stock `MirroredStrategy` to compare against. Its all-reduce goes
    through one device: the default CPU collectives take group keys from 1,
    as tf_agn's do, and two groups of different sizes under one key abort
    whichever runs second in the same process."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())


# First: pytest-xdist's own hook ends the workers, and servers die with
# their parent, so a check after it would miss every leak.
@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Every test that starts servers must stop them: none may remain.

    Checked once all tests have run: under pytest-xdist in the controller,
    once every worker has finished (a worker that finishes first would see
    another's live servers).
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker
        return
    from cluster_checks import command_line
    from cluster_checks import wait_for_no_servers
    from tf_agn.strategies import cluster

    leaked = wait_for_no_servers(cluster._SERVER_SCRIPT)
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line("")  # The progress line has not ended yet.
        reporter.write_sep("=", "Server processes outlived the tests", red=True)
        for pid in leaked:
            reporter.write_line(f"{pid}: {command_line(pid)}")
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long end-to-end tests (deselect with -m 'not slow')"
    )
    config.addinivalue_line(
        "markers", "gpu: needs a GPU; skipped with the reason where none is visible"
    )
    config.addinivalue_line(
        "markers", "zoo_array: the model zoo's whole pairwise array (over an hour on 2 cores)"
    )

