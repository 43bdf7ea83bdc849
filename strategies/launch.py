"""`python -m tf_agn.strategies.launch`: runs a command on a local cluster.

    python -m tf_agn.strategies.launch --workers 4 --ps 1 -- python train.py
    python -m tf_agn.strategies.launch --multi_worker 2 --max_restarts 1 -- \\
        python examples/mnist_mirrored.py

The first runs the command as the coordinator ("chief") of a
parameter-server cluster of local server processes; the second runs it as
every worker of a localhost multi-worker cluster. On several machines, run
`python -m tf_agn.strategies.server` on each worker and ps instead.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading

from tf_agn.resuming.preemption import PREEMPTED_EXIT_CODE
from tf_agn.strategies import heartbeat
from tf_agn.strategies import standby
from tf_agn.strategies import worker_group
from tf_agn.strategies.cluster import LocalCluster
from tf_agn.strategies.worker_group import Outcome


def parse_args(argv):
    """Splits `argv` at the first "--" into launcher options and the command.

    Returns:
        The parsed options and the command (a non-empty list).
    """
    parser = _parser()
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the command to run after '--'")
    split = argv.index("--")
    options = parser.parse_args(argv[:split])
    _check(parser, options)
    return options, argv[split + 1 :]


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tf_agn.strategies.launch",
        description="Runs COMMAND as the coordinator of a local cluster.",
        usage=(
            "%(prog)s [--workers N] [--ps N] [--start_timeout S] -- COMMAND ...\n"
            "       %(prog)s --multi_worker N [--max_restarts K] [--min_workers M]\n"
            "           [--slot_failures F] [--hang_timeout S] -- COMMAND ..."
        ),
    )
    parser.add_argument("--workers", type=int, default=2, help="worker tasks")
    parser.add_argument("--ps", type=int, default=1, help="parameter-server tasks")
    parser.add_argument(
        "--start_timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the servers to accept connections",
    )
    parser.add_argument(
        "--multi_worker",
        type=int,
        default=None,
        help="run COMMAND as this many workers (>= 1) of a multi-worker "
        "cluster instead (--workers and --ps do not apply)",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="with --multi_worker: how many times to restart every worker "
        "when one fails (default 0: stop and exit with its code)",
    )
    parser.add_argument(
        "--min_workers",
        type=int,
        default=None,
        help="with --multi_worker: the fewest workers the job goes on with; a "
        "slot that fails --slot_failures times in a row is dropped while more "
        "remain (default N: none is dropped)",
    )
    parser.add_argument(
        "--slot_failures",
        type=int,
        default=2,
        help="with --min_workers: failures in a row that drop a slot (default 2)",
    )
    parser.add_argument(
        "--hang_timeout",
        type=float,
        default=heartbeat.DEFAULT_HANG_TIMEOUT_S,
        help="with --multi_worker: seconds without a heartbeat after which a "
        "worker is hung, killed and handled as failed (default "
        f"{heartbeat.DEFAULT_HANG_TIMEOUT_S:g}; 0: never); before its first beat, "
        "once a peer beats, as long without using CPU time",
    )
    return parser


def _check(parser, options):
    """Exits through `parser.error`, naming the value, for bad options."""
    # 0 would fall back to a parameter-server cluster, opening ports the
    # user did not ask for.
    if options.multi_worker is not None and options.multi_worker < 1:
        parser.error(f"--multi_worker must be >= 1; received {options.multi_worker}")
    if options.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0; received {options.max_restarts}")
    for name in ("max_restarts", "min_workers"):
        if getattr(options, name) and not options.multi_worker:
            parser.error(f"--{name} applies to --multi_worker clusters only")
    n = options.multi_worker
    if options.min_workers is not None and not 1 <= options.min_workers <= (n or 1):
        parser.error(
            f"--min_workers must be between 1 and --multi_worker ({n}); received "
            f"{options.min_workers}"
        )
    if options.slot_failures < 1:
        parser.error(f"--slot_failures must be >= 1; received {options.slot_failures}")
    # Below 3 beats a worker descheduled for a moment would count as hung.
    min_timeout = 3 * heartbeat.BEAT_INTERVAL_S
    if options.hang_timeout != 0 and not options.hang_timeout >= min_timeout:
        parser.error(
            f"--hang_timeout must be 0 (never) or at least {min_timeout:g} seconds; "
            f"received {options.hang_timeout:g}"
        )


def run(command, env):
    """Runs `command`, passing Ctrl-C on to it; returns its exit code.

    A command killed by signal N exits with 128 + N, as in a shell.
    """
    process = subprocess.Popen(command, env=env)
    try:
        returncode = process.wait()
    except KeyboardInterrupt:
        # A Ctrl-C in a terminal reached the command too; any other
        # interrupt (e.g. SIGTERM to the launcher) is passed on.
        process.send_signal(signal.SIGINT)
        try:
            returncode = process.wait(worker_group.INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
    return worker_group.exit_code(returncode)


def _interrupt(signum, frame):
    """A signal handler that raises `KeyboardInterrupt`, as Ctrl-C does."""
    raise KeyboardInterrupt


class _Slots:
    """The launcher's worker slots: which take part in the next group, and
    how many times in a row each has ended a group by failing."""

    def __init__(self, num_workers, min_workers, slot_failures):
        self.active = list(range(num_workers))
        self.dropped = []
        self._min_workers, self._slot_failures = min_workers, slot_failures
        self._in_a_row = [0] * num_workers

    def after(self, result):
        """Counts the ended group's `result` against its slot, drops a slot
        that failed `slot_failures` times in a row while `min_workers`
        remain, and takes back the slots dropped before; returns a line per
        change."""
        back, self.dropped = self.dropped, []
        lines = []
        for slot in self.active:
            self._in_a_row[slot] = self._in_a_row[slot] + 1 if slot == result.slot else 0
        if (
            result.slot is not None
            and self._in_a_row[result.slot] >= self._slot_failures
            and len(self.active) > self._min_workers
        ):
            self.active.remove(result.slot)
            self.dropped.append(result.slot)
            lines.append(
                f"Worker slot {result.slot} failed {self._in_a_row[result.slot]} times in a "
                f"row: dropped; the job goes on with {len(self.active)} workers "
                f"(--min_workers {self._min_workers})."
            )
        if back:
            self.active = sorted(self.active + back)
            lines.append(
                f"Worker slot(s) {back} rejoin: the job grows back to {len(self.active)} "
                "workers."
            )
        return lines


def run_workers(
    command, num_workers, max_restarts=0, min_workers=None, slot_failures=2,
    hang_timeout_s=heartbeat.DEFAULT_HANG_TIMEOUT_S, backup_grace_s=120.0,
):
    """Runs `command` as every worker of a local multi-worker cluster,
    restarting the whole group when a worker fails, hangs or is preempted.

    A failure stops every worker; then, up to `max_restarts` times, a new
    group starts on fresh ports. A worker whose heartbeat
    (`tf_agn.strategies.heartbeat`) is older than `hang_timeout_s` is
    killed and counts as failed. A group whose workers all exit with
    `PREEMPTED_EXIT_CODE` (75: every worker backed up at one step) restarts
    without counting a failure. With `min_workers` below `num_workers`, a
    slot that ends `slot_failures` groups in a row is dropped, and the
    next groups run without it (the command resumes on fewer workers,
    `tf_agn.callbacks.BackupAndRestore`); a dropped slot rejoins at the
    restart after that. SIGTERM to the launcher is passed on to every
    worker (a preemption notice); Ctrl-C stops everything, never
    restarting. Each event is printed. With `max_restarts`, a `python
    SCRIPT` or `python -m MODULE` command's restarted workers start on
    warm standbys (`tf_agn.strategies.standby`), skipping the import of
    TensorFlow.

    Args:
        command: the command line every worker runs.
        num_workers: how many workers.
        max_restarts: how many times a failed group is started again.
        min_workers: the fewest workers the job goes on with (default
            `num_workers`: no slot is dropped).
        slot_failures: how many failures in a row drop a slot.
        hang_timeout_s: seconds without a heartbeat that make a worker
            hung (before its first beat, once a peer beats, as long
            without using CPU time); None never kills one.
        backup_grace_s: once one worker exits preempted, fails or hangs,
            how long the others have to finish their backup.

    Returns:
        0 if a group succeeds; 75 if the launcher was sent SIGTERM and
        every worker backed up; else the last failure's exit code (128 + N
        for a worker killed by signal N, 128 + SIGINT when interrupted).
    """
    slots = _Slots(num_workers, min_workers or num_workers, slot_failures)
    # Restarted workers start on standbys that imported TensorFlow while the
    # group before them ran; none when no restart is allowed (a preemption's
    # restart then starts afresh).
    standbys = standby.Pool(command, num_workers if max_restarts else 0)
    try:
        return _run_groups(command, slots, max_restarts, hang_timeout_s, backup_grace_s,
                           standbys)
    finally:
        standbys.close()


def _run_groups(command, slots, max_restarts, hang_timeout_s, backup_grace_s, standbys):
    """`run_workers`'s groups, one after the other; returns its code."""
    terminated = []
    restarts = groups = 0
    while True:
        group = worker_group.WorkerGroup(
            command, slots.active, hang_timeout_s, backup_grace_s, restart_count=groups,
            standbys=standbys,
        )
        groups += 1

        def notify(signum, frame, group=group):
            terminated.append(signum)
            group.forward(signum)  # every worker's preemption notice

        in_main = threading.current_thread() is threading.main_thread()
        old_handler = signal.signal(signal.SIGTERM, notify) if in_main else None
        try:
            result = group.run()
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
        if result.outcome is Outcome.DONE:
            return 0
        if result.outcome is Outcome.PREEMPTED:
            if terminated:
                print("Every worker backed up after a preemption notice; exiting with "
                      f"{PREEMPTED_EXIT_CODE}.", flush=True)
                return PREEMPTED_EXIT_CODE
            print("Every worker backed up after a preemption notice; restarting every "
                  "worker (not counted as a failure).", flush=True)
            for line in slots.after(result):
                print(line, flush=True)
            continue
        how = ("stopped sending heartbeats and was killed" if result.outcome is Outcome.HUNG
               else worker_group.describe_exit(result.returncode))
        what = f"Worker slot {result.slot} {how}"
        if terminated or restarts == max_restarts:
            print(f"{what}; stopped every worker.", flush=True)
            return worker_group.exit_code(result.returncode or -signal.SIGKILL)
        restarts += 1
        print(f"{what}; restarting every worker (restart {restarts} of {max_restarts}).",
              flush=True)
        for line in slots.after(result):
            print(line, flush=True)


def main(argv=None):
    """Runs the launcher on `argv` (default: the command line's); returns
    the exit code: the command's, or the multi-worker group's.

    Without `--multi_worker`, it starts a `LocalCluster` in "processes"
    mode and runs the command with the chief's `TF_CONFIG`, so that
    `tf_agn.strategies.parameter_server()` connects to the cluster; the
    servers are torn down however the command ends, Ctrl-C included.
    """
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    if args.multi_worker:
        # SIGTERM is passed on to every worker, as a preemption notice.
        return run_workers(
            command, args.multi_worker, args.max_restarts, args.min_workers,
            args.slot_failures, args.hang_timeout or None,
        )
    # SIGTERM takes the Ctrl-C path: the command is stopped and the
    # cluster torn down.
    signal.signal(signal.SIGTERM, _interrupt)
    with LocalCluster(
        args.workers, args.ps, mode="processes", start_timeout=args.start_timeout
    ) as cluster:
        addresses = cluster.addresses
        print(
            f"Local cluster: worker {', '.join(addresses['worker'])}; "
            f"ps {', '.join(addresses['ps'])}; "
            f"chief (the command) {addresses['chief'][0]}",
            flush=True,
        )
        env = dict(os.environ, TF_CONFIG=json.dumps(cluster.tf_config("chief", 0)))
        return run(command, env)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # While the cluster was starting.
        sys.exit(128 + signal.SIGINT)
