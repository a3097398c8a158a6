"""A leader/followers thread pool: the thread that reads a request runs it.

One thread at a time is the *leader*: it waits on the sockets (``lead``, given
by the transport) and handles what must happen in arrival order. When what it
read includes work (a request to serve, a reply to complete), it passes the
leader role to an idle thread (a *follower*), or starts one, and runs the first
piece of work itself: no hand-off between the thread that read a request and
the one that runs it, and the reply goes out from that same thread. Further
pieces read in the same batch are queued for the followers.

There is always a leader while the pool runs, so the sockets are always read:
when every thread is busy, the leader keeps the role and queues the work
(the pool is full, as torch's fixed-size pool would be), so a thread blocked
sending to a peer can never leave both peers with nobody reading.

Example::

    >>> pool = LeaderFollowers(transport_lead, max_workers=16, name="distgrad-w0")
    >>> pool.start()                     # the first thread becomes the leader
    >>> pool.submit(print, "queued")     # runs on a follower
    >>> pool.shutdown(wait=True)
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Work = tuple  # (fn, args)


class LeaderFollowers:
    """``submit(fn, *args)`` runs ``fn(*args)`` on a follower; ``lead()`` is called
    by whichever thread leads and returns the work it read (or None to stop)."""

    def __init__(self, lead: Callable[[], list | None], max_workers: int,
                 name: str = "distgrad") -> None:
        self._lead = lead
        # one thread more than the workers asked for: the leader never runs user
        # code while no other thread can take its role
        self.max_threads = max(1, int(max_workers)) + 1
        self._name = name
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tasks: collections.deque = collections.deque()
        self._has_leader = False
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.busy = 0

    def start(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:  # under the lock
        t = threading.Thread(target=self._run, daemon=True, name=f"{self._name}_{len(self._threads)}")
        self._threads.append(t)
        t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the next free thread."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._tasks.append((fn, args))
            self._wake(1)

    def _wake(self, n: int) -> None:  # under the lock
        # ``_idle`` counts waiting threads nobody has woken yet: the waker takes them off
        k = min(n, self._idle)
        if k:
            self._idle -= k
            self._cond.notify(k)
        for _ in range(n - k):
            if len(self._threads) >= self.max_threads:
                break
            self._spawn()

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    # a task only once someone leads: otherwise threads woken for
                    # queued work could all take tasks, and with every thread
                    # blocked in one, nobody would read the sockets any more
                    if self._tasks and (self._has_leader or self._stopping):
                        work = [self._tasks.popleft()]
                        break
                    if self._stopping:
                        return
                    if not self._has_leader:
                        self._has_leader = True
                        work = None
                        break
                    self._idle += 1
                    self._cond.wait()
            if work is None:
                work = self._leading()
                if work is None:
                    return
            for fn, args in work:
                self.busy += 1
                try:
                    fn(*args)
                except BaseException:  # noqa: BLE001 - a task must not kill its thread
                    log.exception("uncaught error in %s", self._name)
                finally:
                    self.busy -= 1
                del fn, args
            del work

    def _leading(self) -> list | None:
        """Lead until there is work this thread may run; returns it (None: stop)."""
        while True:
            try:
                work = self._lead()
            except BaseException:  # noqa: BLE001
                log.exception("error while reading in %s", self._name)
                work = []
            with self._lock:
                if work is None or self._stopping:
                    self._has_leader = False
                    self._tasks.extend(work or ())
                    self._cond.notify_all()
                    return None
                if not work:
                    continue
                if self._idle or len(self._threads) < self.max_threads:
                    # step down: another thread leads, this one runs the first piece
                    self._has_leader = False
                    self._tasks.extend(work[1:])
                    self._wake(len(work))  # the queued pieces and the leader role
                    return work[:1]
                # every thread is busy: keep reading, the work waits for one
                self._tasks.extend(work)

    def on_pool_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` drop queued tasks; with ``wait``
        join the threads (the transport must wake its leader first)."""
        with self._lock:
            self._stopping = True
            if cancel_futures:
                self._tasks.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            me = threading.current_thread()
            for t in threads:
                if t is not me:
                    t.join(30)
