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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long end-to-end tests (deselect with -m 'not slow')"
    )

