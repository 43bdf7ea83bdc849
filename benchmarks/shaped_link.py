"""Loopback links of a set speed, one per worker: a local cluster that sends
as machines on real Ethernet would, for benchmarks of compression.

On loopback, sending 24 MB more costs a memory copy, so a compressor that
spends arithmetic to send fewer bytes loses there even where it wins
between machines. This module makes loopback a network of
`mbit` Mbit/s uplinks with Linux traffic control (`tc`, from iproute2):
an HTB root qdisc on `lo` whose default class passes all other traffic at
full speed, and one class of `mbit` Mbit/s per worker, which takes every
IPv4 TCP packet whose source port is that worker's server port.

TensorFlow's collectives pull: a worker asks a peer for a tensor (RecvBuf)
and the tensor comes back in the peer's reply, from the peer's server
port. So each class carries what its worker sends, as that machine's
uplink would. Receivers are not limited: where a worker receives from one
peer at a time (any pattern between 2 workers, and rings) that is what a
switched full-duplex network gives; where it receives from several at
once (an all-to-all of 3 or more workers) it would receive faster than
through one real link. `shaped_bytes` counts what went through the
classes, so a run can show that its traffic did.

Needs root (CAP_NET_ADMIN) and `tc`; the root qdisc is ours alone (handle
`HANDLE`), and `remove` deletes it, leaving any other qdisc alone.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess

HANDLE = "7a6e"  # Marks the root qdisc as ours: remove() deletes only it.
DEVICE = "lo"
# HTB's default burst at 1 Gbit/s is smaller than one loopback packet
# (64 KiB with segmentation offload), which would cap the rate below
# `mbit`; a few packets' worth keeps it at `mbit`.
BURST = "256k"


def _tc(*args):
    """Runs `tc args`; returns its stdout.

    Raises:
        RuntimeError: if `tc` is missing or fails, with its message.
    """
    if shutil.which("tc") is None:
        raise RuntimeError(
            "Shaping loopback needs Linux traffic control: `tc` (iproute2) is not "
            "on the PATH."
        )
    result = subprocess.run(["tc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"`tc {' '.join(args)}` failed ({result.stderr.strip()}); shaping loopback "
            "needs root (CAP_NET_ADMIN)."
        )
    return result.stdout


def _ours_installed():
    return f"qdisc htb {HANDLE}: root" in _tc("qdisc", "show", "dev", DEVICE)


@contextlib.contextmanager
def installed():
    """`install` on entry, `remove` on exit (however the block ends)."""
    install()
    try:
        yield
    finally:
        remove()


def install():
    """Puts our root qdisc on loopback, with a full-speed default class.

    Raises:
        RuntimeError: if `tc` fails, or if loopback already has a root
            qdisc of its own (another run's, or the machine's), which this
            would replace.
    """
    shown = _tc("qdisc", "show", "dev", DEVICE)
    root = re.search(r"^qdisc (\S+) (\S+) root", shown, re.M)
    if root and root.group(1) != "noqueue":
        raise RuntimeError(
            f"Loopback already has a root qdisc ({root.group(0)}); remove it "
            f"(`tc qdisc del dev {DEVICE} root`) if no other run needs it."
        )
    _tc("qdisc", "add", "dev", DEVICE, "root", "handle", f"{HANDLE}:", "htb",
        "default", "1", "r2q", "1000")
    _tc("class", "add", "dev", DEVICE, "parent", f"{HANDLE}:", "classid",
        f"{HANDLE}:1", "htb", "rate", "100gbit")


def limit_this_worker(mbit):
    """`limit_port` for this process's server, as its `TF_CONFIG` gives it."""
    tf_config = json.loads(os.environ["TF_CONFIG"])
    index = tf_config["task"]["index"]
    limit_port(index, int(tf_config["cluster"]["worker"][index].rpartition(":")[2]), mbit)


def limit_port(index, port, mbit):
    """Sends every packet from source `port` through a `mbit` Mbit/s class;
    called again for the same worker, changes that class's rate.

    Args:
        index: the worker's index; its class is `HANDLE:(index + 10)`.
        port: the worker's server port.
        mbit: the rate, in Mbit/s.

    Raises:
        RuntimeError: if `install` has not run, or `tc` fails.
    """
    if not _ours_installed():
        raise RuntimeError(
            f"No shaped loopback to add port {port} to: `install` has not run (start "
            "the benchmark without TF_CONFIG, so that it shapes the link)."
        )
    classid = f"{HANDLE}:{index + 10}"
    rate = f"{mbit}mbit"
    exists = bool(_tc("class", "show", "dev", DEVICE, "classid", classid).strip())
    _tc("class", "change" if exists else "add", "dev", DEVICE, "parent", f"{HANDLE}:",
        "classid", classid, "htb", "rate", rate, "ceil", rate, "burst", BURST, "cburst", BURST)
    if exists:
        return
    _tc("filter", "add", "dev", DEVICE, "parent", f"{HANDLE}:", "protocol", "ip",
        "prio", "1", "u32", "match", "ip", "sport", str(port), "0xffff",
        "flowid", classid)


def parse_class_bytes(shown):
    """Bytes sent per class, from `tc -s class show`'s output.

    Returns:
        A dict from class id ("7a6e:10") to bytes.
    """
    return {
        classid: int(sent)
        for classid, sent in re.findall(
            r"^class htb (\S+) .*?\n\s*Sent (\d+) bytes", shown, re.M
        )
    }


def shaped_bytes():
    """Bytes that have gone through the workers' classes so far."""
    sent = parse_class_bytes(_tc("-s", "class", "show", "dev", DEVICE))
    return sum(b for classid, b in sent.items() if classid != f"{HANDLE}:1")


def pin_to_own_core():
    """In a worker process (with `TF_CONFIG`), pins it to one core, the task
    index-th of those it may use; returns the core (None elsewhere).

    TensorFlow sizes its thread pools from the cores the process may use,
    and a thread keeps the affinity it started with: call it before
    importing TensorFlow.
    """
    if "TF_CONFIG" not in os.environ:
        return None
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def remove():
    """Deletes our root qdisc (and its classes) if it is there."""
    if shutil.which("tc") is not None and _ours_installed():
        _tc("qdisc", "del", "dev", DEVICE, "root")
