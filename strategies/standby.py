"""Warm standby workers: Python processes that have imported TensorFlow and
tf_agn before a worker is needed, so that a restarted worker skips the
import (about 9 of a restart's 13 to 16 s here, two processes importing at
once on 2 cores; `benchmarks/preemption.py`).

`python -m tf_agn.strategies.launch --multi_worker N` keeps N standbys
while a group runs, for the next group. A standby waits for one line on its
standard input, a JSON request `{"env": {...}, "argv": [...]}`; it then
takes that environment and runs the command's script (`argv`: a script and
its arguments, or "-m", a module and its arguments) as `python` would run
it. A standby whose input closes exits. Only plain `python SCRIPT ...` and
`python -m MODULE ...` commands run on standbys (`runs_on_standby`); a
variable that TensorFlow reads as it is imported is the launcher's, for a
worker on a standby as for any other.

Usage, by hand (what the launcher does):

```python
standby = Standby([sys.executable])
standby.start({"TF_CONFIG": "..."}, ["train.py", "--epochs=2"])
standby.process.wait()
```
"""

import json
import os
import runpy
import subprocess
import sys


def runs_on_standby(command: list[str]) -> bool:
    """Whether `command` is `python SCRIPT ...` or `python -m MODULE ...`
    with this interpreter, which a standby can run."""
    if len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return False
    if command[1] == "-m":
        return len(command) > 2
    return not command[1].startswith("-")


class Standby:
    """One standby process of `interpreter` (the command's first word),
    started at once, its output piped (`process.stdout`)."""

    def __init__(self, interpreter: list[str]):
        self.process = subprocess.Popen(
            [*interpreter, "-m", "tf_agn.strategies.standby"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def start(self, env: dict, argv: list[str]) -> None:
        """Makes it run `argv` (the command without its interpreter) in
        `env`, the whole environment."""
        self.process.stdin.write(json.dumps({"env": env, "argv": argv}) + "\n")
        self.process.stdin.close()

    def stop(self) -> None:
        """Ends it, if it never started a worker."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Pool:
    """Up to `size` standbys for `command`'s workers, if it runs on them."""

    def __init__(self, command: list[str], size: int):
        self._interpreter = command[:1]
        self._size = size if runs_on_standby(command) else 0
        self._ready = []

    def fill(self) -> None:
        """Starts standbys until `size` wait."""
        self._ready = [s for s in self._ready if s.process.poll() is None]
        while len(self._ready) < self._size:
            self._ready.append(Standby(self._interpreter))

    def take(self) -> Standby | None:
        """A waiting standby, or None."""
        while self._ready:
            standby = self._ready.pop(0)
            if standby.process.poll() is None:
                return standby
        return None

    def close(self) -> None:
        """Ends every waiting standby."""
        for standby in self._ready:
            standby.stop()
        self._ready = []


def _serve() -> None:
    import tensorflow  # noqa: F401  (the point: imported ahead of need)

    import tf_agn  # noqa: F401
    from tf_agn.strategies import heartbeat

    line = sys.stdin.readline()
    if not line:  # the launcher is gone, or needs no more workers
        return
    request = json.loads(line)
    # The request's pipe, read to its end, is no input of the worker's:
    # /dev/null is (and tells a waiting standby, reading fd 0, from one
    # that became a worker, for tools that look at /proc).
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    # Beats from now on, as the worker it became, before its script reaches
    # `multi_worker_mirrored()`.
    heartbeat.start_from_environment()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        # As `python SCRIPT` does: the script's directory first on the path.
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _serve()
