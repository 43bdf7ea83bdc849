"""Heartbeats: how a supervisor tells a hung worker from a busy one.

A worker whose environment names `HEARTBEAT_FILE_VARIABLE` touches that
file every `BEAT_INTERVAL_S` from a daemon thread, which beats through a
long step (TensorFlow's kernels and tracing let other Python threads run)
and stops only when the whole process does: SIGSTOP, a frozen host, a
process the scheduler never runs. `python -m tf_agn.strategies.launch
--multi_worker N` kills a worker whose file is older than `--hang_timeout`
and handles it as a lost one. Elsewhere, any supervisor can read the
file's age (a Kubernetes `livenessProbe`); under systemd, the same thread
also pings the service manager's watchdog (`WatchdogSec=`).
"""

import os
import socket
import threading
import time

# The environment variable naming the file a worker touches.
HEARTBEAT_FILE_VARIABLE = "TF_AGN_HEARTBEAT_FILE"
BEAT_INTERVAL_S = 1.0
# The launcher's default: about 10 missed beats. A process descheduled for
# a few seconds on a loaded machine is not hung.
DEFAULT_HANG_TIMEOUT_S = 10.0

_started = threading.Event()


def start_from_environment() -> bool:
    """Starts this process's heartbeat thread, once, if a supervisor asked
    for it (`HEARTBEAT_FILE_VARIABLE`, or systemd's `WATCHDOG_USEC`).

    Returns:
        Whether a heartbeat runs.
    """
    path = os.environ.get(HEARTBEAT_FILE_VARIABLE)
    watchdog = _systemd_watchdog()
    if not path and watchdog is None:
        return False
    if not _started.is_set():
        _started.set()
        threading.Thread(
            target=_beat, args=(path, watchdog), name="tf_agn-heartbeat", daemon=True
        ).start()
    return True


def age_s(path: str) -> float | None:
    """Seconds since the worker owning `path` last beat; None before its
    first beat."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _beat(path: str | None, watchdog) -> None:
    while True:
        if path:
            with open(path, "a"):
                pass
            os.utime(path)
        if watchdog is not None:
            watchdog.sendto(b"WATCHDOG=1", os.environ["NOTIFY_SOCKET"].replace("@", "\0", 1))
        time.sleep(BEAT_INTERVAL_S)


def _systemd_watchdog() -> socket.socket | None:
    """A datagram socket to systemd's notify socket when this process is
    the watchdog's (`WatchdogSec=` sets `WATCHDOG_USEC` and, for the
    main process, `WATCHDOG_PID`), else None."""
    if not os.environ.get("WATCHDOG_USEC") or not os.environ.get("NOTIFY_SOCKET"):
        return None
    if os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid()):
        return None
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
