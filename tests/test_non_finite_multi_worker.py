"""Under `tf_agn.strategies.multi_worker_mirrored()`, an overflow on one
worker skips the step on both: two worker processes on localhost
(tests/non_finite_worker.py), one CPU replica each, checked against the
same no-strategy references as test_non_finite.py."""

import os

import numpy as np
import pytest

from overflow import MULTI_WORKER_CASES
from overflow import NUM_REPLICAS
from overflow import batches
from overflow import case_key
from overflow import finite_batches
from overflow import reference_loss_scale
from overflow import reference_weights
from worker_cluster import run_workers

TIMEOUT_S = 120
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "non_finite_worker.py")
# As test_non_finite.py: float16 activations.
RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Every worker's results, in task order."""
    workdir = tmp_path_factory.mktemp("non_finite_multi_worker")
    return run_workers(WORKER_SCRIPT, [], workdir, NUM_REPLICAS, TIMEOUT_S)


def weights(result, key, stage):
    count = len([k for k in result if k.startswith(f"{key}/{stage}/")])
    return [result[f"{key}/{stage}/{i}"] for i in range(count)]


@pytest.mark.parametrize("name, accumulation_steps", MULTI_WORKER_CASES)
def test_one_workers_overflow_skips_the_step_on_every_worker(
    workers, name, accumulation_steps
):
    key = case_key(name, accumulation_steps)
    reference = reference_weights(name, *finite_batches(*batches()), accumulation_steps)
    scale, counter = reference_loss_scale()
    for index, result in enumerate(workers):
        message = f"{key}, worker {index}"
        for got, want in zip(weights(result, key, "after"), weights(result, key, "before")):
            np.testing.assert_array_equal(got, want, err_msg=message)
        assert (float(result[f"{key}/scale"]), int(result[f"{key}/counter"])) == (
            scale, counter,
        ), message
        assert int(result[f"{key}/iterations"]) == (1 if accumulation_steps else 2)
        final = weights(result, key, "final")
        assert len(final) == len(reference)
        for got, want in zip(final, reference):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=message)
