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
import time
import typing

from tf_agn.strategies import server
from tf_agn.strategies.cluster import LocalCluster
from tf_agn.strategies.ports import free_ports

# How long an interrupted command gets to exit before it is killed.
_INTERRUPT_GRACE_S = 10


def parse_args(argv):
    """Splits `argv` at the first "--" into launcher options and the command.

    Returns:
        The parsed options and the command (a non-empty list).
    """
    parser = argparse.ArgumentParser(
        prog="python -m tf_agn.strategies.launch",
        description="Runs COMMAND as the coordinator of a local cluster.",
        usage=(
            "%(prog)s [--workers N] [--ps N] [--start_timeout S] -- COMMAND ...\n"
            "       %(prog)s --multi_worker N [--max_restarts K] -- COMMAND ..."
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
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the command to run after '--'")
    split = argv.index("--")
    options = parser.parse_args(argv[:split])
    # 0 would fall back to a parameter-server cluster, opening ports the
    # user did not ask for.
    if options.multi_worker is not None and options.multi_worker < 1:
        parser.error(f"--multi_worker must be >= 1; received {options.multi_worker}")
    if options.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0; received {options.max_restarts}")
    if options.max_restarts and not options.multi_worker:
        parser.error("--max_restarts applies to --multi_worker clusters only")
    return options, argv[split + 1 :]


def _exit_code(returncode):
    """A `Popen.returncode` as a shell reports it: 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


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
            returncode = process.wait(_INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
    return _exit_code(returncode)


def _interrupt(signum, frame):
    """A signal handler that raises `KeyboardInterrupt`, as Ctrl-C does."""
    raise KeyboardInterrupt


def multi_worker_tf_configs(num_workers):
    """One `TF_CONFIG` per worker of a cluster on free localhost ports."""
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(num_workers)]}
    return [
        {"cluster": cluster, "task": {"type": "worker", "index": index}}
        for index in range(num_workers)
    ]


def _relay(stream, prefix):
    """Copies `stream` to stdout, each line after `prefix`."""
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _describe_exit(returncode):
    """How a process ended, in words: "exited with code 5" or "was killed
    by SIGKILL"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class WorkerFailure(typing.NamedTuple):
    """The first worker of a group that ended with an error."""

    index: int
    returncode: int  # Popen's: negative for a signal


def run_worker_group(command, num_workers):
    """Runs `command` once as every worker of a fresh local multi-worker
    cluster (new free ports, new `TF_CONFIG`s), until all succeed or one
    fails; then no worker is left running. Worker 0's output passes
    through; every other line is prefixed with "[worker i]".

    Returns:
        None if every worker exits with 0, else the `WorkerFailure` of the
        first worker seen failing.

    Raises:
        KeyboardInterrupt: on Ctrl-C or SIGTERM, after every worker has
            been given `_INTERRUPT_GRACE_S` to exit on SIGINT and killed.
    """
    tf_configs = multi_worker_tf_configs(num_workers)
    addresses = tf_configs[0]["cluster"]["worker"]
    print(f"Local multi-worker cluster: {', '.join(addresses)}", flush=True)
    print(server.exposure_notice(addresses), flush=True)
    processes, relays = [], []
    try:
        for index, tf_config in enumerate(tf_configs):
            env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
            pipe = subprocess.PIPE if index else None
            process = subprocess.Popen(
                command, env=env, stdout=pipe, stderr=subprocess.STDOUT if index else None,
                text=True,
            )
            processes.append(process)
            if index:
                relay = threading.Thread(
                    target=_relay, args=(process.stdout, f"[worker {index}] "), daemon=True
                )
                relay.start()
                relays.append(relay)
        while True:
            codes = [p.poll() for p in processes]
            for index, code in enumerate(codes):
                # The `finally` stops the others: they would wait for the
                # failed worker for ever.
                if code not in (None, 0):
                    return WorkerFailure(index, code)
            if all(c == 0 for c in codes):
                return None
            time.sleep(0.1)
    except KeyboardInterrupt:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + _INTERRUPT_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.1)
        raise
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        for relay in relays:
            relay.join(timeout=5)


def run_workers(command, num_workers, max_restarts=0):
    """Runs `command` as every worker of a local multi-worker cluster,
    restarting the whole group when a worker fails.

    A failure stops every worker; then, up to `max_restarts` times, a new
    group starts on fresh ports. Training resumes only if the command
    restores itself (`tf_agn.callbacks.BackupAndRestore`). Each failure is
    printed: which worker, how it ended, and whether a restart follows.
    Ctrl-C and SIGTERM stop everything and never restart.

    Args:
        command: the command line every worker runs.
        num_workers: how many workers.
        max_restarts: how many times a failed group is started again.

    Returns:
        0 if a group succeeds, else the last failure's exit code (128 + N
        for a worker killed by signal N, 128 + SIGINT when interrupted).
    """
    # A multi-worker cluster cannot go on without one of its workers (the
    # others' collectives fail): a failure restarts the whole group.
    for attempt in range(max_restarts + 1):
        try:
            failure = run_worker_group(command, num_workers)
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        if failure is None:
            return 0
        what = f"Worker {failure.index} {_describe_exit(failure.returncode)}"
        if attempt == max_restarts:
            print(f"{what}; stopped every worker.", flush=True)
            return _exit_code(failure.returncode)
        print(
            f"{what}; restarting every worker (restart {attempt + 1} of "
            f"{max_restarts}).",
            flush=True,
        )


def main(argv=None):
    """Runs the launcher on `argv` (default: the command line's); returns
    the exit code: the command's, or the multi-worker group's.

    Without `--multi_worker`, it starts a `LocalCluster` in "processes"
    mode and runs the command with the chief's `TF_CONFIG`, so that
    `tf_agn.strategies.parameter_server()` connects to the cluster; the
    servers are torn down however the command ends, Ctrl-C included.
    """
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM takes the Ctrl-C path: the command is stopped and the
    # cluster torn down.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.multi_worker:
        return run_workers(command, args.multi_worker, args.max_restarts)
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
