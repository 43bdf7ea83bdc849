"""Preemption notices: every worker finishes one agreed step, backs up there
and exits with `PREEMPTED_EXIT_CODE`, so that a supervisor restarts the job
without counting a failure."""

import os
import signal
import threading

import tensorflow as tf

from tf_agn import _compat

# sysexits.h's EX_TEMPFAIL, "temporary failure; the user is invited to
# retry": the launcher and the supervisor recipes restart on it uncounted.
PREEMPTED_EXIT_CODE = 75
# How long a worker that proposed the stop step waits for every peer's
# acknowledgement. Peers acknowledge from a thread within milliseconds; a
# peer that does not is lost, and its collectives fail the job anyway.
ACKNOWLEDGE_TIMEOUT_S = 20.0
# How often a watcher thread wakes to see whether its fit has ended.
_POLL_MS = 1000
# The notice watched now, if any: fits do not nest, so one left behind by a
# fit that raised (its `on_train_end` never ran) is stopped by the next.
_active = None


class Preempted(SystemExit):
    """Raised out of `fit` once every worker has backed up at the agreed
    step; uncaught, the process exits with `PREEMPTED_EXIT_CODE` (75).

    Catch it to do more before exiting (the backup is complete), then exit
    with its `code`, so that the supervisor restarts the job.

    Args:
        step: the agreed step, counted in `fit`'s train-function calls
            (kept as `self.step`).

    Example:

    ```python
    try:
        model.fit(x, y, callbacks=[tf_agn.callbacks.BackupAndRestore("/shared/b")])
    except tf_agn.callbacks.Preempted as preempted:
        print(preempted)
        raise
    ```
    """

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step

    def __str__(self) -> str:
        return (
            f"Preempted: backed up after step {self.step} of this fit; exiting "
            f"with {PREEMPTED_EXIT_CODE} so that the job is restarted."
        )


def check_notice(notice):
    """Returns `notice` if it is one `PreemptionNotice` accepts.

    Raises:
        ValueError: naming `notice` and what is allowed.
    """
    if isinstance(notice, str) and notice.upper() in signal.Signals.__members__:
        raise ValueError(
            f"preemption_notice {notice!r} names a signal: pass "
            f"signal.{notice.upper()} (a string is a path, watched for a file)."
        )
    if notice is None or callable(notice) or isinstance(notice, (str, os.PathLike)):
        if isinstance(notice, str) and not notice:
            raise ValueError("preemption_notice must not be an empty path.")
        return notice
    if isinstance(notice, int) and not isinstance(notice, bool):
        try:
            return signal.Signals(notice)
        except ValueError:
            pass
    raise ValueError(
        "preemption_notice must be a signal (e.g. signal.SIGTERM), a callable "
        "polled between steps that returns True once a notice came, a path "
        f"(str or os.PathLike) whose appearance is the notice, or None; received "
        f"{notice!r}."
    )


class PreemptionNotice:
    """Watches for a notice during one `fit` and agrees, across workers, on
    the step after which every worker backs up.

    The worker that sees a notice after its step c proposes step c + 1 in
    the coordination service's key-value store, and waits until every
    worker's watcher thread has acknowledged it. No peer can finish step
    c + 1 before then (its collectives need this worker), so each worker
    learns the step before it reaches it, whatever step it was in. Until a
    notice comes, a step costs a flag check: the watching is a thread's.

    A `fit` that raises never reaches `on_train_end`: a signal that comes
    once `fit` has left the stack takes the old handler's course then.

    Args:
        notice: a `signal.Signals`, a callable or a path (`check_notice`).
        task_names: every task of the cluster, this one included; one task
            agrees alone.
        task_name: this process's task.
        key_prefix: the keys of this fit, alike on every worker.
        model: the model whose `fit` this notice serves.
    """

    def __init__(
        self, notice, task_names: list[str], task_name: str, key_prefix: str, model=None
    ):
        self._notice, self._model = notice, model
        self._task_names, self._task_name = task_names, task_name
        self._key = key_prefix + "/step"
        self._ack_prefix = key_prefix + "/ack/"
        self._signalled = threading.Event()
        self._agreed = threading.Event()
        self._stop_step = None
        self._proposed = False
        self._finished = threading.Event()
        self._old_handler = None
        self._watcher = None

    @property
    def multi_worker(self) -> bool:
        return len(self._task_names) > 1

    def start(self) -> None:
        """Installs the signal handler (in the main thread) and starts the
        watcher thread of a multi-worker cluster."""
        global _active
        if _active is not None:
            _active.stop()
        _active = self
        if isinstance(self._notice, signal.Signals):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    f"BackupAndRestore watches {self._notice.name} only when fit runs "
                    "in the main thread; pass preemption_notice=None, a callable or a "
                    "path instead."
                )
            self._old_handler = signal.signal(self._notice, self._on_signal)
        if self.multi_worker:
            self._watcher = threading.Thread(
                target=self._watch, name="tf_agn-preemption-watcher", daemon=True
            )
            self._watcher.start()

    def stop(self, redeliver: bool = False) -> None:
        """Stops watching and puts the old signal handler back; with
        `redeliver`, a signal that came and was not acted on is raised
        again, to take its old course."""
        global _active
        if _active is self:
            _active = None
        self._finished.set()
        if self._old_handler is not None:
            signal.signal(self._notice, self._old_handler)
            self._old_handler = None
            if redeliver and self._signalled.is_set() and not self._agreed.is_set():
                signal.raise_signal(self._notice)

    def stop_step(self, completed: int) -> int | None:
        """Called after `completed` steps of this fit: the agreed step once
        there is one (back up when it equals `completed`), else None.

        Raises:
            RuntimeError: if a peer does not acknowledge a proposal within
                `ACKNOWLEDGE_TIMEOUT_S`.
        """
        if not self._proposed and not self._agreed.is_set() and self._noticed():
            self._proposed = True
            self._propose(completed)
        return self._stop_step if self._agreed.is_set() else None

    def _noticed(self) -> bool:
        if isinstance(self._notice, signal.Signals):
            return self._signalled.is_set()
        if callable(self._notice):
            return bool(self._notice())
        return os.path.exists(self._notice)

    def _on_signal(self, signum, frame) -> None:
        self._signalled.set()
        if not _in_fit(frame, self._model):
            self.stop(redeliver=True)  # fit raised: the old course now



    def _propose(self, completed: int) -> None:
        if not self.multi_worker:
            self._stop_step = completed
            self._agreed.set()
            return
        try:
            _compat.set_key_value(self._key, str(completed + 1))
        except tf.errors.AlreadyExistsError:
            return  # A peer proposed first: the watcher brings its step.
        for name in self._task_names:
            try:
                _compat.get_key_value(self._ack_prefix + name, int(ACKNOWLEDGE_TIMEOUT_S * 1000))
            except tf.errors.DeadlineExceededError:
                raise RuntimeError(
                    f"Preemption: {name} did not acknowledge stopping after step "
                    f"{completed + 1} within {ACKNOWLEDGE_TIMEOUT_S:g} s; it is lost."
                ) from None

    def _watch(self) -> None:
        while not self._finished.is_set():
            try:
                value = _compat.get_key_value(self._key, _POLL_MS)
            except tf.errors.DeadlineExceededError:
                continue
            except tf.errors.OpError:  # the cluster is going down
                return
            self._stop_step = int(value)
            self._agreed.set()
            _compat.set_key_value(self._ack_prefix + self._task_name, "1")
            return


def _in_fit(frame, model) -> bool:
    """Whether `model.fit` is on the stack below `frame`."""
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return True
        frame = frame.f_back
    return False
