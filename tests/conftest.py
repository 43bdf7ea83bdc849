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


@pytest.fixture(scope="session", autouse=True)
def no_server_outlives_the_suite():
    """Every test that starts servers must stop them: none may remain."""
    yield
    from cluster_checks import wait_for_no_servers
    from tf_agn.strategies import cluster

    leaked = wait_for_no_servers(cluster._SERVER_SCRIPT)
    assert not leaked, f"Server processes outlived the tests: {leaked}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long end-to-end tests (deselect with -m 'not slow')"
    )
    config.addinivalue_line(
        "markers", "gpu: needs a GPU; skipped with the reason where none is visible"
    )

