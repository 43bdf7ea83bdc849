r"""What losing a worker costs a 2-worker `multi_worker_mirrored` cluster.

Both figures come from real worker processes on localhost, each running
tests/restart_worker.py: the AGN model of tests/restart_model.py, 5 epochs
of 4 steps, `tf_agn.callbacks.BackupAndRestore` every 2 steps; worker 1
SIGKILLs itself before batch 3 of epoch 2 (0-based).

(a) Detection, `--detections` times: the two workers run without a
    supervisor; the time from worker 1's kill to worker 0 exiting with an
    error, and that error (its pending collective fails when its gRPC
    connection to the dead peer closes, or is aborted when TensorFlow's
    coordination service misses the peer's heartbeats).
(b) Restart, `--launch_pairs` times: the wall time of `python -m
    tf_agn.strategies.launch --multi_worker 2 --max_restarts 1` with the
    kill, minus that of the same command whose worker never kills itself
    (run just before it); both runs must end with the same weights (printed
    as their largest difference).

Usage (about 5 minutes on 2 CPU cores):

    python benchmarks/restart_cost.py
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

import launched

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "restart_worker.py"
TIMEOUT_S = 300

FLAGS = flags.FLAGS
flags.DEFINE_integer("detections", 3, "how many times to measure (a), which varies most")
flags.DEFINE_integer("launch_pairs", 2, "how many launches without and with the kill (b)")


def start(command, env, log):
    """Starts `command` in its own process group, output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )


def stop(processes):
    """Kills whatever of `processes`' groups still runs."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def detection_time(workdir):
    """Runs both workers unsupervised; returns (seconds from worker 1's
    kill to worker 0's exit, worker 0's exit code, its error)."""
    from tf_agn.strategies.worker_group import multi_worker_tf_configs

    processes = []
    try:
        for index, tf_config in enumerate(multi_worker_tf_configs(2)):
            env = dict(launched.cluster_env(), TF_CONFIG=json.dumps(tf_config))
            processes.append(
                start([sys.executable, str(WORKER), str(workdir), "--kill_worker", "1"],
                      env, workdir / f"worker{index}.log")
            )
        survivor, killed = processes
        deadline = time.monotonic() + TIMEOUT_S
        while survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        exited_at = time.time()
        if survivor.returncode is None:
            raise RuntimeError(f"worker 0 still runs {TIMEOUT_S} s after the start")
        if killed.wait(10) != -signal.SIGKILL:
            raise RuntimeError(f"worker 1 ended with {killed.returncode}, not SIGKILL")
    finally:
        stop(processes)
    killed_at = float((workdir / "killed").read_text())
    log = (workdir / "worker0.log").read_text(errors="replace").splitlines()
    # The exception's class, and the line of TensorFlow's message that says
    # why (the health check's verdict, or the closed connection).
    raised = [line.split(":")[0] for line in log if re.match(r"^[\w.]+Error: ", line)]
    reasons = [line.strip() for line in log
               if "aborted by" in line or "Socket closed" in line]
    return exited_at - killed_at, survivor.returncode, " ".join(raised[-1:] + reasons[-1:])


def launch_time(workdir, kill):
    """Wall seconds of the launcher running both workers, restarting once;
    the kill happens only if `kill`. Returns (seconds, worker 0's final
    variables)."""
    if not kill:
        (workdir / "killed").write_text("0")  # as if it had happened
    command = [
        sys.executable, "-m", "tf_agn.strategies.launch", "--multi_worker", "2",
        "--max_restarts", "1", "--", sys.executable, str(WORKER), str(workdir),
        "--kill_worker", "1",
    ]
    began = time.monotonic()
    launcher = start(command, launched.cluster_env(), workdir / "launch.log")
    try:
        code = launcher.wait(TIMEOUT_S)
    finally:
        stop([launcher])
    seconds = time.monotonic() - began
    output = (workdir / "launch.log").read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"the launcher exited with {code}:\n{output[-3000:]}")
    if kill != ("restart 1 of 1" in output):
        raise RuntimeError(f"expected {'a' if kill else 'no'} restart:\n{output[-3000:]}")
    with np.load(workdir / "result-worker-0.npz") as npz:
        return seconds, [npz[str(i)] for i in range(len(npz.files))]


def main(argv):
    del argv
    print(f"tf_agn restart cost: 2 workers on localhost, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        detections = []
        for attempt in range(FLAGS.detections):
            workdir = tmp / f"detect{attempt}"
            workdir.mkdir()
            seconds, code, error = detection_time(workdir)
            detections.append(seconds)
            print(f"(a) survivor exited {seconds:.1f} s after the kill, code {code}: "
                  f"{error[:200]}", flush=True)
        print(f"(a) detection: {', '.join(f'{s:.1f}' for s in detections)} s "
              f"(median {np.median(detections):.1f} s)", flush=True)
        # Alternating, so that other load on the machine hits both alike.
        costs = []
        for pair in range(FLAGS.launch_pairs):
            for name in ("plain", "restart"):
                (tmp / f"{name}{pair}").mkdir()
            plain, want = launch_time(tmp / f"plain{pair}", kill=False)
            restarted, got = launch_time(tmp / f"restart{pair}", kill=True)
            difference = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
            costs.append(restarted - plain)
            print(f"(b) launch without a kill {plain:.1f} s, with a kill and one restart "
                  f"{restarted:.1f} s: the restart cost {restarted - plain:.1f} s "
                  f"({restarted / plain:.2f}x); final weights differ by at most "
                  f"{difference:.1e}", flush=True)
        print(f"(b) restart cost: {', '.join(f'{c:.1f}' for c in costs)} s "
              f"(median {np.median(costs):.1f} s); load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    app.run(main)
