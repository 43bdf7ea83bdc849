"""strategies/membership.py: the workers that are up agree on who trains,
go on without one that never comes, and take it back at the next meeting.

Workers here are threads meeting over real localhost ports; the 3-process
TensorFlow cluster that shrinks this way is in tests/test_restarts.py."""

import concurrent.futures
import contextlib
import socket
import time

import pytest

from tf_agn.strategies import membership
from tf_agn.strategies import ports


def addresses(count):
    return [f"localhost:{port}" for port in ports.free_ports(count)]


def meet_all(cluster, indices, min_workers, timeout_seconds, delays=None):
    """Each worker of `indices` meets (after its delay); returns
    {index: members or the exception raised}."""
    delays = delays or {}

    def one(index):
        time.sleep(delays.get(index, 0))
        try:
            return membership.meet(cluster, index, min_workers, timeout_seconds)
        except Exception as error:  # noqa: BLE001 - returned to the test
            return error

    with concurrent.futures.ThreadPoolExecutor(len(indices)) as pool:
        results = pool.map(one, indices)
        return dict(zip(indices, results))


@contextlib.contextmanager
def running_job(cluster, indices):
    """Ports held as a running job's TensorFlow servers hold them: they
    accept and never answer the meeting's questions."""
    held = []
    try:
        for index in indices:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(ports.host_and_port(cluster[index]))
            sock.listen(8)
            held.append(sock)
        yield
    finally:
        for sock in held:
            sock.close()


def test_every_worker_up_meets_at_once():
    cluster = addresses(3)
    start = time.monotonic()
    results = meet_all(cluster, [0, 1, 2], min_workers=2, timeout_seconds=60)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert time.monotonic() - start < 20  # not the deadline


def test_workers_started_apart_in_any_order_meet_whole():
    cluster = addresses(3)
    results = meet_all(
        cluster, [0, 1, 2], min_workers=3, timeout_seconds=30, delays={2: 0, 1: 0.7, 0: 1.5}
    )
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_the_others_go_on_without_a_worker_that_never_comes(missing):
    cluster = addresses(3)
    present = [j for j in range(3) if j != missing]
    start = time.monotonic()
    results = meet_all(cluster, present, min_workers=2, timeout_seconds=2)
    assert results == {j: present for j in present}
    assert time.monotonic() - start >= 2  # waited for it first


def test_too_few_workers_time_out_naming_the_missing():
    cluster = addresses(3)
    results = meet_all(cluster, [1], min_workers=2, timeout_seconds=1)
    assert isinstance(results[1], TimeoutError)
    message = str(results[1])
    assert "fewer than min_workers=2" in message
    assert f"worker 0 ({cluster[0]})" in message and f"worker 2 ({cluster[2]})" in message
    assert "worker 1 (" not in message


def test_a_late_worker_waits_for_the_running_job_and_rejoins_when_it_restarts():
    cluster = addresses(3)
    assert meet_all(cluster, [0, 1], min_workers=2, timeout_seconds=1) == {0: [0, 1], 1: [0, 1]}
    with running_job(cluster, [0, 1]):
        # Worker 2 comes back while workers 0 and 1 train without it.
        late = meet_all(cluster, [2], min_workers=2, timeout_seconds=1.5)[2]
    assert isinstance(late, TimeoutError)
    assert "the job runs without it" in str(late) and "rejoins when the job next restarts" in str(late)
    # It is back before the job restarts: the next meeting has all three,
    # without waiting for a deadline.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with running_job(cluster, [0, 1]):
            waiting = pool.submit(membership.meet, cluster, 2, 2, 30)
            time.sleep(1)
            assert not waiting.done()
        restarted = meet_all(cluster, [0, 1], min_workers=2, timeout_seconds=30)
        assert waiting.result(timeout=30) == [0, 1, 2]
    assert restarted == {0: [0, 1, 2], 1: [0, 1, 2]}


def test_a_worker_that_comes_after_the_decision_is_told_it_is_late():
    cluster = addresses(3)
    # Workers 1 and 2 decide at 1 s; worker 0 comes just after, while
    # they may not yet hold their ports as a job: it never joins them.
    results = meet_all(cluster, [0, 1, 2], min_workers=2, timeout_seconds=1, delays={0: 1.2})
    assert results[1] == results[2] == [1, 2]
    assert isinstance(results[0], TimeoutError), results[0]
