"""`meet`: the workers of a cluster that are up agree on which of them
train, so that a job on several machines goes on without a machine that
never returns (`multi_worker_mirrored(min_workers=M)`), and takes it back
when the job next restarts.

The lowest-numbered worker up leads: every other joins it over the
workers' own cluster ports (before TensorFlow's servers take them), and
the leader answers all of them with the members once every worker has
joined, or, at its deadline, once at least `min_workers` have. A worker
that finds the job already running (its peers' ports answer, but as
TensorFlow's servers) waits, and joins when the job restarts.
"""

import json
import numbers
import os
import select
import socket
import threading
import time

import tensorflow as tf

from tf_agn.strategies import ports
from tf_agn.strategies import rendezvous
from tf_agn.strategies import tf_config

# What a supervisor sets instead of passing `min_workers`.
MIN_WORKERS_VARIABLE = "TF_AGN_MIN_WORKERS"

# How often a waiting worker looks at its peers again.
_POLL_SECONDS = 0.2
# How long a peer has to answer a question; a port that accepts and says
# nothing of ours in that time is a running job's TensorFlow server.
_ANSWER_SECONDS = 1.0


def min_workers(value, cluster_resolver, source: str, num_workers: int) -> int:
    """The fewest workers a job goes on with: `value`, else
    `TF_AGN_MIN_WORKERS`, else all `num_workers`.

    Raises:
        ValueError: naming the value and its source, if it is not an
            integer between 1 and `num_workers`, or asks for fewer than
            `num_workers` of a cluster that is not `TF_CONFIG`'s list of
            "worker" tasks (`source` says where the cluster came from).
    """
    named = "min_workers"
    text = os.environ.get(MIN_WORKERS_VARIABLE, "").strip()
    if value is None and text:
        named = MIN_WORKERS_VARIABLE
        value = int(text) if text.isdigit() else text
    if value is None:
        return num_workers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= num_workers:
        raise ValueError(
            f"{named} must be an integer between 1 and the cluster's "
            f"{num_workers} workers; received {value!r}."
        )
    if value < num_workers:
        jobs = cluster_resolver.cluster_spec().as_dict()
        workers = (tf_config.load() or {}).get("cluster", {}).get("worker")
        if source != "TF_CONFIG" or set(jobs) != {"worker"} or not isinstance(workers, list):
            raise ValueError(
                f"{named}={value} needs TF_CONFIG's cluster, a list of "
                f"\"worker\" tasks only (the workers that meet rewrite it); "
                f"received the {source}'s jobs {jobs}."
            )
    return int(value)


def meet_in_tf_config(min_workers: int, timeout_seconds: float):
    """Meets `TF_CONFIG`'s workers and, if some did not come, rewrites
    this process's `TF_CONFIG` to the cluster of those that did.

    Returns:
        A `TFConfigClusterResolver` of the cluster that trains.

    Raises:
        TimeoutError: as `meet`.
    """
    config = tf_config.load()
    addresses = config["cluster"]["worker"]
    index = int(config["task"].get("index", 0))
    members = meet(addresses, index, min_workers, timeout_seconds)
    if len(members) < len(addresses):
        # The cluster's workers are renumbered in order, so that the first
        # present hosts TensorFlow's coordination service.
        task = dict(config["task"], index=members.index(index))
        os.environ["TF_CONFIG"] = json.dumps(
            dict(config, cluster={"worker": [addresses[j] for j in members]}, task=task)
        )
        left_out = ", ".join(
            f"worker {j} ({address})" for j, address in enumerate(addresses) if j not in members
        )
        print(
            f"tf_agn: worker {index} trains as worker {task['index']} of "
            f"{len(members)} (min_workers={min_workers}); left out: "
            f"{left_out}, who rejoin when the job next restarts.",
            flush=True,
        )
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def meet(addresses: list[str], index: int, min_workers: int, timeout_seconds: float) -> list[int]:
    """Returns the indices, in order, of the workers that train together.

    Every worker of the cluster calls it with the same `addresses` and
    `min_workers`. All that are up return the same list, this worker's
    index among them; one that is not in it raises.

    Args:
        addresses: the workers' `host:port` addresses, in task order.
        index: this worker's place in `addresses`.
        min_workers: the fewest workers the job goes on with.
        timeout_seconds: how long to wait for every worker before going on
            without the missing ones.

    Returns:
        The members' indices, sorted: all of `range(len(addresses))` when
        every worker came in time.

    Raises:
        TimeoutError: if fewer than `min_workers` workers met within
            `timeout_seconds` (naming the missing ones), or the job runs
            without this worker (it rejoins at the job's next restart).
        KeyboardInterrupt: on Ctrl-C, at any time.
    """
    return _Meeting(addresses, index, min_workers, timeout_seconds).run()


class _Meeting:
    """One worker's side of the meeting: a thread answering its peers on
    its port, and the main thread looking for a leader and following it,
    or leading."""

    def __init__(self, addresses, index, min_workers, timeout_seconds):
        self._addresses = addresses
        self._index = index
        self._min_workers = min_workers
        self._timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._state = "probing"  # then "leading" or "following <j>"
        self._members = None
        self._followers = {}  # index -> the connection its answer goes on
        self._late = False

    def run(self):
        deadline = time.monotonic() + self._timeout_seconds
        with rendezvous.listening(self._addresses[self._index]) as listener:
            if listener is None:
                raise RuntimeError(
                    f"Worker {self._index} cannot listen on its cluster port "
                    f"({self._addresses[self._index]}), to meet its peers: "
                    "another process holds it."
                )
            listener.settimeout(_POLL_SECONDS)
            serving = threading.Thread(target=self._serve, args=(listener,), daemon=True)
            serving.start()
            try:
                return self._meet(deadline)
            finally:
                with self._lock:
                    self._members = self._members or ()
                serving.join()

    def _meet(self, deadline):
        while True:
            states, busy = self._peer_states()
            leader = self._leader(states, busy)
            if leader == self._index:
                members = self._lead(deadline)
            elif leader is not None:
                members = self._follow(leader, deadline)
            else:
                members = None
                time.sleep(_POLL_SECONDS)
            if members is not None:
                return members
            if time.monotonic() >= deadline:
                self._give_up(busy)

    def _leader(self, states, busy):
        """Who to join: the lowest leader there is (another yields to it),
        else the lowest worker meeting, this one included; None while
        the job runs without this worker."""
        leaders = [j for j, state in states.items() if state == "leading"]
        leaders += [int(state.split()[1]) for state in states.values() if state.startswith("following ")]
        if leaders:
            return min(leaders)
        if busy or self._late:
            return None  # wait for the running job to restart
        return min([j for j, state in states.items() if state == "probing"] + [self._index])

    def _lead(self, deadline):
        """Leads until the members are known; None if it yields to a lower
        leader."""
        with self._lock:
            self._state = "leading"
        while True:
            states, busy = self._peer_states()
            lower = [j for j, state in states.items() if state == "leading" and j < self._index]
            with self._lock:
                if lower:
                    self._answer_followers(f"following {min(lower)}")
                    self._state = f"following {min(lower)}"
                    return None
                self._drop_gone_followers()
                members = sorted([self._index, *self._followers])
                everyone = len(members) == len(self._addresses)
                if everyone or (time.monotonic() >= deadline and len(members) >= self._min_workers and not busy):
                    self._members = tuple(members)
                    self._answer_followers("members " + ",".join(map(str, members)))
                    return members
                if time.monotonic() >= deadline:
                    self._answer_followers("failed")
                    self._give_up(busy, members)
            time.sleep(_POLL_SECONDS)

    def _follow(self, leader, deadline):
        """Joins `leader` and waits for its answer: the members, or None to
        look again (it yielded, it is gone, or the job went on without
        this worker)."""
        with self._lock:
            self._state = f"following {leader}"
        # The leader answers by its own deadline, a little after ours at most.
        give_up_at = deadline + self._timeout_seconds
        try:
            with socket.create_connection(ports.host_and_port(self._addresses[leader]), timeout=_ANSWER_SECONDS) as conn:
                conn.sendall(f"join {self._index}\n".encode())
                conn.settimeout(_POLL_SECONDS)
                reply = _read_line(conn, give_up_at)
        except OSError:
            reply = None
        with self._lock:
            self._state = "probing"
        if reply is not None and reply.startswith("members "):
            members = [int(j) for j in reply.split()[1].split(",")]
            with self._lock:
                self._members = tuple(members)
            return members
        if reply == "late":
            self._late = True
        if reply in (None, "probing", "late", "failed"):
            time.sleep(_POLL_SECONDS)
        return None

    def _give_up(self, busy, members=None):
        missing = [
            f"worker {j} ({address})" for j, address in enumerate(self._addresses)
            if j not in (members or [self._index])
        ]
        if busy or self._late:
            raise TimeoutError(
                f"Worker {self._index}: the job runs without it (its peers' "
                "ports answer as TensorFlow's servers, or their leader said "
                f"so) and did not restart within {self._timeout_seconds} s. "
                "A worker that comes back rejoins when the job next restarts."
            )
        raise TimeoutError(
            f"Worker {self._index}: only {len(members or [self._index])} "
            f"worker(s) met within {self._timeout_seconds} s, fewer than "
            f"min_workers={self._min_workers}; missing: {', '.join(missing)}."
        )

    # The answering side.

    def _serve(self, listener):
        while True:
            with self._lock:
                if self._members is not None:
                    return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(_ANSWER_SECONDS)
            try:
                request = _read_line(conn, time.monotonic() + _ANSWER_SECONDS)
            except OSError:
                request = None
            with self._lock:
                reply = self._reply(request, conn)
            if reply is not None:
                _send(conn, reply)
                conn.close()

    def _reply(self, request, conn):
        """This worker's answer to `request`; None keeps `conn` open for a
        joining worker, answered when the members are known."""
        words = (request or "").split()
        if words == ["state"]:
            return "late" if self._members is not None else self._state
        if len(words) == 2 and words[0] == "join" and words[1].isdigit():
            if self._members is not None:
                return "late"
            if self._state == "leading":
                old = self._followers.pop(int(words[1]), None)
                if old is not None:
                    old.close()
                self._followers[int(words[1])] = conn
                return None
            return self._state
        return "unknown request"

    def _answer_followers(self, reply):
        for conn in self._followers.values():
            _send(conn, reply)
            conn.close()
        self._followers = {}

    def _drop_gone_followers(self):
        """Forgets followers whose connection closed (they died, or look
        for a leader again)."""
        for j, conn in list(self._followers.items()):
            # A follower sends nothing after joining: readable means closed.
            # (select, not a non-blocking recv: on a socket with a timeout,
            # Python's recv first waits that long.)
            readable, _, _ = select.select([conn], [], [], 0)
            if readable:
                conn.close()
                del self._followers[j]

    # The asking side.

    def _peer_states(self):
        """`({index: state}, busy)`: the state each meeting peer reports,
        and whether some peer's port answers as something else (a job
        running without this worker)."""
        states, busy = {}, False
        for j, address in enumerate(self._addresses):
            if j == self._index:
                continue
            try:
                with socket.create_connection(ports.host_and_port(address), timeout=_ANSWER_SECONDS) as conn:
                    conn.sendall(b"state\n")
                    reply = _read_line(conn, time.monotonic() + _ANSWER_SECONDS)
            except OSError:
                continue  # not up
            if reply in ("probing", "leading") or (reply or "").startswith("following "):
                states[j] = reply
            elif reply == "late":
                busy = True  # it has met without this worker
            else:
                busy = True
        return states, busy


def _read_line(conn, deadline):
    """One line from `conn`, without its newline; None if the peer closed
    or sent something else, or at `deadline`."""
    data = b""
    while b"\n" not in data:
        if time.monotonic() >= deadline:
            return None
        try:
            chunk = conn.recv(256)
        except TimeoutError:
            continue
        if not chunk:
            return None
        data += chunk
        if len(data) > 1024:
            return None
    try:
        return data.split(b"\n", 1)[0].decode("ascii")
    except UnicodeDecodeError:
        return None


def _send(conn, reply):
    try:
        conn.sendall(reply.encode() + b"\n")
    except OSError:
        pass  # gone: it looks again
