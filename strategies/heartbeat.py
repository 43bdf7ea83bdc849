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

Once given `on_abort` (`answer_aborts`), the same thread answers a
supervisor that lost one of this worker's peers: when `<heartbeat
file>.abort` exists (`request_abort`), it calls `on_abort`
(`multi_worker_mirrored`, once connected, aborts the process's
collectives, so that a step waiting for the lost peer raises at once
rather than after TensorFlow's health check, 7 to 11 s here, and
`tf_agn.callbacks.BackupAndRestore` saves the last completed step). The
file then reads "answers abort" (`answers_abort`), so that a supervisor
waits for such a worker to save, and kills any other at once.
"""

import os
import socket
import threading
import time
import typing

# The environment variable naming the file a worker touches.
HEARTBEAT_FILE_VARIABLE = "TF_AGN_HEARTBEAT_FILE"
BEAT_INTERVAL_S = 1.0
# What the heartbeat file of a worker with `on_abort` says.
_ANSWERS_ABORT = "answers abort"
# How often the thread looks for an abort request.
_ABORT_POLL_S = 0.1
# The launcher's default: about 10 missed beats. A process descheduled for
# a few seconds on a loaded machine is not hung.
DEFAULT_HANG_TIMEOUT_S = 10.0


_started = threading.Event()
# What the thread calls on an abort request; None: requests are ignored.
_on_abort = None


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
        # The first beat before returning: a worker stopped right after
        # this call has beaten, and is found within the hang timeout.
        _beat_once(path, watchdog)
        threading.Thread(
            target=_beat, args=(path, watchdog), name="tf_agn-heartbeat", daemon=True
        ).start()
    return True


def answer_aborts(on_abort: typing.Callable[[], None]) -> None:
    """From now on, answers a supervisor's abort requests with
    `on_abort()`, called from the heartbeat thread."""
    global _on_abort
    _on_abort = on_abort
    path = os.environ.get(HEARTBEAT_FILE_VARIABLE)
    if path:
        with open(path, "w") as f:  # a write touches it too
            f.write(_ANSWERS_ABORT)


def age_s(path: str) -> float | None:
    """Seconds since the worker owning `path` last beat; None before its
    first beat."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process `pid` has used (Linux /proc), or None where
    unknown. Before a worker's first beat (a cold one imports TensorFlow
    first), CPU time that stands still is the sign of a hung process: an
    import on a loaded machine is slow, but never idle."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    # utime and stime, the 14th and 15th fields, in clock ticks.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answers_abort(path: str) -> bool:
    """Whether the worker beating on `path` answers `request_abort`."""
    try:
        with open(path) as f:
            return f.read() == _ANSWERS_ABORT
    except FileNotFoundError:
        return False


def request_abort(path: str) -> None:
    """Asks the worker beating on `path` to abort its collectives: a peer
    it waits for is lost."""
    with open(path + ".abort", "w"):
        pass


def _beat_once(path: str | None, watchdog) -> None:
    if path:
        with open(path, "a"):
            pass
        os.utime(path)
    if watchdog is not None:
        watchdog.sendto(b"WATCHDOG=1", os.environ["NOTIFY_SOCKET"].replace("@", "\0", 1))


def _beat(path: str | None, watchdog) -> None:
    next_beat = time.monotonic() + BEAT_INTERVAL_S
    while True:
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + BEAT_INTERVAL_S
            _beat_once(path, watchdog)
        if path and _on_abort is not None and os.path.exists(path + ".abort"):
            os.remove(path + ".abort")
            _on_abort()
        time.sleep(_ABORT_POLL_S)


def _systemd_watchdog() -> socket.socket | None:
    """A datagram socket to systemd's notify socket when this process is
    the watchdog's (`WatchdogSec=` sets `WATCHDOG_USEC` and, for the
    main process, `WATCHDOG_PID`), else None."""
    if not os.environ.get("WATCHDOG_USEC") or not os.environ.get("NOTIFY_SOCKET"):
        return None
    if os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid()):
        return None
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
