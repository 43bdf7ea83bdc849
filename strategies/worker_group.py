"""One run of a command as every worker of a localhost multi-worker cluster:
how it ended, and which worker ended it. `tf_agn.strategies.launch` decides
what follows (a restart, a smaller group, an exit)."""

import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing

from tf_agn.resuming.preemption import PREEMPTED_EXIT_CODE
from tf_agn.strategies import heartbeat
from tf_agn.strategies import server
from tf_agn.strategies.ports import free_ports

# How long an interrupted command gets to exit before it is killed.
INTERRUPT_GRACE_S = 10
# The environment variable that tells a worker its slot: which of the
# launcher's N workers it is, whatever its index in a smaller group.
SLOT_VARIABLE = "TF_AGN_WORKER_SLOT"
# How many groups the launcher started before this one (torchrun's
# TORCHELASTIC_RESTART_COUNT).
RESTART_COUNT_VARIABLE = "TF_AGN_RESTART_COUNT"


class Outcome(enum.Enum):
    DONE = "done"  # every worker exited with 0
    PREEMPTED = "preempted"  # every worker backed up and exited with 75
    FAILED = "failed"  # a worker exited with an error or a signal
    HUNG = "hung"  # a worker stopped beating and was killed


class GroupResult(typing.NamedTuple):
    """How a group ended; for FAILED and HUNG, the first worker that ended
    it (its slot) and its `Popen.returncode` (negative for a signal; None
    for one killed after the preemption grace)."""

    outcome: Outcome
    slot: int | None = None
    returncode: int | None = None


def exit_code(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int | None) -> str:
    """How a process ended, in words: "exited with code 5" or "was killed
    by SIGKILL"."""
    if returncode is None:
        return "did not exit within the preemption grace, and was killed"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def multi_worker_tf_configs(num_workers: int) -> list[dict]:
    """One `TF_CONFIG` per worker of a cluster on free localhost ports."""
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(num_workers)]}
    return [
        {"cluster": cluster, "task": {"type": "worker", "index": index}}
        for index in range(num_workers)
    ]


class WorkerGroup:
    """Runs `command` once as every worker of a fresh local cluster (new
    free ports, new `TF_CONFIG`s), one worker per slot of `slots`. Worker
    0's output passes through; every other line is prefixed with
    "[worker i]".

    Args:
        command: the command line every worker runs.
        slots: the launcher's slots that take part, in worker order.
        hang_timeout_s: a worker whose heartbeat is older is killed (None:
            never); before its first beat, once a peer beats, one whose
            CPU time stood still as long (`heartbeat.cpu_seconds`).
        backup_grace_s: once a worker exits preempted, fails or hangs, how
            long the others get to finish their backup and exit: after a
            failure, each worker that beats is asked to abort its
            collectives (`heartbeat.request_abort`) and saves the last step
            it completed (`tf_agn.callbacks.BackupAndRestore`).
        restart_count: how many groups ran before this one.
        standbys: where workers come from when `command` runs on warm
            standby processes (`standby.Pool`), or None.
    """

    def __init__(
        self, command, slots, hang_timeout_s=None, backup_grace_s=120.0, restart_count=0,
        standbys=None,
    ):
        self._command, self._slots = command, list(slots)
        self._restart_count = restart_count
        self._hang_timeout_s = hang_timeout_s
        self._backup_grace_s = backup_grace_s
        self._standbys = standbys
        self._processes = []
        # Reentrant: `forward` runs in a signal handler, on the main thread.
        self._lock = threading.RLock()

    def forward(self, signum: int) -> None:
        """Sends `signum` to every running worker (from a signal handler)."""
        with self._lock:
            for process in self._processes:
                if process.poll() is None:
                    process.send_signal(signum)

    def run(self) -> GroupResult:
        """Runs the group until it ends; then no worker is left running.

        Raises:
            KeyboardInterrupt: on Ctrl-C, after every worker has been given
                `INTERRUPT_GRACE_S` to exit on SIGINT and killed.
        """
        tf_configs = multi_worker_tf_configs(len(self._slots))
        addresses = tf_configs[0]["cluster"]["worker"]
        print(f"Local multi-worker cluster: {', '.join(addresses)}", flush=True)
        print(server.exposure_notice(addresses), flush=True)
        relays = []
        with tempfile.TemporaryDirectory(prefix="tf_agn-heartbeats-") as beats:
            hearts = [os.path.join(beats, f"slot-{slot}") for slot in self._slots]
            try:
                for index, (tf_config, slot) in enumerate(zip(tf_configs, self._slots)):
                    env = dict(
                        os.environ, TF_CONFIG=json.dumps(tf_config), **{
                            SLOT_VARIABLE: str(slot),
                            RESTART_COUNT_VARIABLE: str(self._restart_count),
                            heartbeat.HEARTBEAT_FILE_VARIABLE: hearts[index],
                        },
                    )
                    relays += self._start(env, index)
                if self._standbys is not None:
                    self._standbys.fill()  # for the next group, while this one runs
                result = self._watch(hearts)
                if result.outcome in (Outcome.FAILED, Outcome.HUNG):
                    self._let_survivors_save(hearts)
                return result
            except KeyboardInterrupt:
                self._interrupt()
                raise
            finally:
                for process in self._processes:
                    if process.poll() is None:
                        process.kill()
                    process.wait()
                for relay in relays:
                    relay.join(timeout=5)

    def _start(self, env, index):
        standby = self._standbys.take() if self._standbys is not None else None
        if standby is not None:
            standby.start(env, self._command[1:])
            process = standby.process
        else:
            pipe = subprocess.PIPE if index else None
            process = subprocess.Popen(
                self._command, env=env, stdout=pipe,
                stderr=subprocess.STDOUT if index else None, text=True,
            )
        with self._lock:
            self._processes.append(process)
        if process.stdout is None:  # worker 0's output passes through
            return []
        relay = threading.Thread(
            target=_relay, args=(process.stdout, f"[worker {index}] " if index else ""),
            daemon=True,
        )
        relay.start()
        return [relay]

    def _watch(self, hearts) -> GroupResult:
        preempted_at, idle = None, _CpuIdle()
        while True:
            codes = [p.poll() for p in self._processes]
            for index, code in enumerate(codes):
                # Any other failure ends the group: its peers would wait
                # for the failed worker for ever (the `finally` stops them).
                if code not in (None, 0, PREEMPTED_EXIT_CODE):
                    return GroupResult(Outcome.FAILED, self._slots[index], code)
            if all(c == 0 for c in codes):
                return GroupResult(Outcome.DONE)
            if PREEMPTED_EXIT_CODE in codes:
                # The others are backing up at the same step: wait for them.
                preempted_at = preempted_at or time.monotonic()
                if None not in codes:
                    return GroupResult(Outcome.PREEMPTED)
                if time.monotonic() - preempted_at > self._backup_grace_s:
                    # Killed by the `finally`; None: it did not end by itself.
                    return GroupResult(Outcome.FAILED, self._slots[codes.index(None)], None)
            elif self._hang_timeout_s is not None:
                ages = [heartbeat.age_s(heart) for heart in hearts]
                # Once a peer beats, the command is one that beats: a worker
                # that has not yet is hung when its CPU time stands still
                # (a command that never beats is never judged).
                beating = any(age is not None for age in ages)
                for index, age in enumerate(ages):
                    if age is None and beating:
                        age = idle.since(index, self._processes[index].pid)
                    if codes[index] is None and age is not None and age > self._hang_timeout_s:
                        self._processes[index].kill()
                        self._processes[index].wait()
                        return GroupResult(Outcome.HUNG, self._slots[index], -signal.SIGKILL)
            time.sleep(0.1)

    def _let_survivors_save(self, hearts):
        """Asks every running worker that answers to stop waiting for the
        lost one, and gives them `backup_grace_s` to save and exit (the rest are
        killed by `run`'s `finally`); one that stops beating meanwhile is
        hung, and killed at once."""
        survivors = [
            (process, heart) for process, heart in zip(self._processes, hearts)
            if process.poll() is None and heartbeat.answers_abort(heart)
        ]
        for _, heart in survivors:
            heartbeat.request_abort(heart)
        deadline = time.monotonic() + self._backup_grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in survivors):
            for process, heart in survivors:
                # A stopped worker answers no request: waiting for it held a
                # group for as long as it stayed stopped.
                age = heartbeat.age_s(heart)
                hung = None not in (self._hang_timeout_s, age) and age > self._hang_timeout_s
                if process.poll() is None and hung:
                    process.kill()
            time.sleep(0.1)

    def _interrupt(self):
        self.forward(signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self._processes):
            time.sleep(0.1)


class _CpuIdle:
    """How long each worker's CPU time has stood still, from the launcher's
    polls (0 where /proc does not tell)."""

    def __init__(self):
        self._last = {}  # index -> (CPU seconds, when they last changed)

    def since(self, index: int, pid: int) -> float:
        cpu, now = heartbeat.cpu_seconds(pid), time.monotonic()
        if cpu is None:
            return 0.0
        last = self._last.get(index)
        if last is None or cpu != last[0]:
            self._last[index] = (cpu, now)
            return 0.0
        return now - last[1]


def _relay(stream, prefix):
    """Copies `stream` to stdout, each line after `prefix`."""
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
