"""benchmarks/shaped_link.py: the per-worker loopback links that
benchmarks/compression.py's `--link_mbit` times compressors through.

The traffic test changes loopback's queueing (as root), so it runs only
where `tc` may; it checks bytes, not rates (the machine is shared)."""

import importlib.util
import os
import shutil
import socket
import subprocess
import threading

import pytest

from scripts import ROOT
from scripts import run_python

SHAPED_LINK = os.path.join(ROOT, "benchmarks", "shaped_link.py")
COMPRESSION = os.path.join(ROOT, "benchmarks", "compression.py")

_spec = importlib.util.spec_from_file_location("shaped_link", SHAPED_LINK)
shaped_link = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shaped_link)


def test_parse_class_bytes_reads_every_class():
    shown = (
        "class htb 7a6e:1 root prio 0 rate 100Gbit ceil 100Gbit burst 0b cburst 0b \n"
        " Sent 372605814 bytes 10011 pkt (dropped 0, overlimits 7343 requeues 0) \n"
        " backlog 0b 0p requeues 0\n"
        "\n"
        "class htb 7a6e:10 root prio 0 rate 1Gbit ceil 1Gbit burst 262000b cburst 262000b \n"
        " Sent 263406406 bytes 4047 pkt (dropped 0, overlimits 2404 requeues 0) \n"
    )
    assert shaped_link.parse_class_bytes(shown) == {
        "7a6e:1": 372605814,
        "7a6e:10": 263406406,
    }


@pytest.fixture
def tc_allowed():
    """Skips the test unless this process may shape loopback.

    Justified skip: changing loopback's queueing needs root with
    CAP_NET_ADMIN and iproute2's `tc`, which a user's machine or a CI
    container may not give; without them `--link_mbit` raises (as the
    skip's reason shows) and there is nothing to test.
    """
    reason = _why_tc_is_not_allowed()
    if reason:
        pytest.skip(f"shaping loopback is not allowed here: {reason}")


def _why_tc_is_not_allowed():
    """None if this process may shape loopback, else why not."""
    if shutil.which("tc") is None:
        return "tc (iproute2) is not installed"
    # Permission shows only in trying: install ours, and remove it.
    try:
        shaped_link.install()
    except RuntimeError as error:
        return str(error)
    shaped_link.remove()
    return None


def _send_from(port, nbytes):
    """Sends `nbytes` from a server socket on `port` to a client; returns
    the bytes the client received."""
    server = socket.create_server(("127.0.0.1", port))
    received = []

    def serve():
        connection, _ = server.accept()
        with connection:
            connection.sendall(b"x" * nbytes)

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        while chunk := client.recv(1 << 20):
            received.append(len(chunk))
    thread.join()
    server.close()
    return sum(received)


def test_a_limited_port_sends_through_its_link_and_remove_restores_loopback(tc_allowed):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nbytes = 4 << 20
    with shaped_link.installed():
        shaped_link.limit_port(0, port, 1000)
        before = shaped_link.shaped_bytes()
        assert _send_from(port, nbytes) == nbytes
        through = shaped_link.shaped_bytes() - before
        # Every payload byte, plus its headers; the client's ACKs leave
        # from another port and are not counted.
        assert nbytes <= through < 1.1 * nbytes
    shown = subprocess.run(
        ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
    ).stdout
    assert shaped_link.HANDLE not in shown


def test_limit_port_without_install_names_what_to_do(tc_allowed):
    with pytest.raises(RuntimeError, match="without TF_CONFIG"):
        shaped_link.limit_port(0, 12345, 1000)


def test_compression_benchmark_refuses_links_for_more_than_two_workers():
    result = run_python(
        COMPRESSION, "--link_mbit=1000", "--num_workers=3", timeout=120, returncode=None
    )
    assert result.returncode != 0
    assert "--num_workers=3" in result.stdout + result.stderr
    assert "Use --num_workers=2" in result.stdout + result.stderr
