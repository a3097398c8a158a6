"""A leader/followers thread pool: the thread that reads a request runs it.

One thread at a time is the *leader*: it waits on the sockets (``lead``, given
by the transport) and handles what must happen in arrival order. When what it
read includes work (a request to serve, a reply to complete), it passes the
leader role to an idle thread (a *follower*), or starts one, and runs the
work itself: no hand-off between the thread that read a request and the one
that runs it, and the reply goes out from that same thread. When one read
brings several pieces, every request and every reply completion (marked
``batchable``) still gets a thread of its own, as torch serves each request and
completes each reply (one may wait for something the next one does): the
reading thread runs the first completion and the first request; the rest is
queued and wakes a thread. Reply completions alone are queued for the reading
thread to take in turn, with no wake-up; if one is held up (a callback that
waits), any thread that next looks for work takes the rest.

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
import os
import threading
from collections.abc import Callable
from typing import Any

from ..intra_op import mark_distgrad_thread

log = logging.getLogger(__name__)

Work = tuple  # (fn, args)


class LeaderFollowers:
    """``submit(fn, *args)`` runs ``fn(*args)`` on a follower; ``lead()`` is called
    by whichever thread leads and returns the work it read (or None to stop)."""

    def __init__(self, lead: Callable[[], list | None], max_workers: int,
                 name: str = "distgrad", shared: Callable[[], None] | None = None) -> None:
        self._lead = lead
        # ``shared`` (a function that wakes the threads waiting in ``lead``): every
        # idle thread waits in ``lead`` at once (a poller the kernel hands each
        # ready socket to exactly one waiter, such as epoll with one-shot
        # registrations); see _run_shared
        self._shared_wake = shared
        self._local = threading.local()
        self._waiting = 0   # threads inside ``lead`` (shared mode)
        self._starting = 0  # threads started, not yet running
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
        # DISTGRAD_BATCH_WAKES=1: the old behaviour (wake a thread for each queued piece)
        self._batch_wakes = os.environ.get("DISTGRAD_BATCH_WAKES", "0") == "1"
        self.wakes = 0  # wake-ups of waiting threads for queued work (thread hand-offs)

    def start(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:  # under the lock
        run = self._run if self._shared_wake is None else self._run_shared
        self._starting += 1
        t = threading.Thread(target=run, daemon=True, name=f"{self._name}_{len(self._threads)}")
        self._threads.append(t)
        t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the next free thread."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._tasks.append((fn, args))
            if self._shared_wake is None:
                self._wake(1)
                return
            if self._spare():
                return
            self.wakes += 1
        self._shared_wake()

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the thread that queues it to take next, waking nobody
        (shared mode): if that thread is held up meanwhile, any thread that next looks
        for work takes it (at the latest when the heartbeat wakes one). Elsewhere (no
        shared poller) it is :meth:`submit`."""
        if self._shared_wake is None:
            self.submit(fn, *args)
            return
        with self._lock:
            if self._stopping:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._tasks.append((fn, args))

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
        mark_distgrad_thread()
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
            self._execute(work)
            del work

    def _run_shared(self) -> None:
        """A thread of the shared mode: wait in ``lead`` with the other idle threads;
        run what it returns. No thread wakes another on the common path: the
        kernel wakes one waiter per ready socket. The last thread waiting never
        leaves to run user code unless another can take its place (started here),
        and with every thread busy it keeps reading and queues the work."""
        mark_distgrad_thread()
        keep_reading = False
        local = self._local
        with self._lock:
            self._starting -= 1
        while True:
            more = False
            with self._lock:
                # a queued task only while another thread reads (or one is started to):
                # with every thread blocked in a task nobody would read the sockets
                if self._tasks and not keep_reading and (
                        self._waiting or self._starting or self._grow()):
                    work = [self._tasks.popleft()]
                    # more queued: this thread takes them next (no wake-up per task);
                    # a thread is started only if nobody is left reading
                    more = bool(self._tasks) and self._wake_for(self._tasks) and not self._spare()
                elif self._stopping:
                    return
                else:
                    work = None
                    self._waiting += 1
                    # the last reader stays one: queued work waits for a busy thread
                    local.keep = keep_reading or bool(self._tasks)
            if more:
                self.wakes += 1
                self._shared_wake()
            if work is None:
                try:
                    work = self._lead()
                except BaseException:  # noqa: BLE001
                    log.exception("error while reading in %s", self._name)
                    work = []
                extra = 0
                with self._lock:
                    self._waiting -= 1
                    if work is None or self._stopping:
                        self._tasks.extend(work or ())
                        return
                    keep_reading = False
                    if not work:
                        continue
                    if not self._waiting and not self._starting:
                        if len(self._threads) < self.max_threads:
                            self._spawn()  # it waits in our place
                        else:  # every thread is busy: keep reading, the work waits
                            self._tasks.extend(work)
                            keep_reading = True
                            continue
                    if len(work) > 1:
                        # several messages from one read (see _split): this thread
                        # runs its share, the rest is queued; a queued request wakes
                        # a thread (it may block), and so do reply completions queued
                        # behind a request this thread runs
                        work, queued = self._split(work)
                        if queued:
                            self._tasks.extend(queued)
                            extra = (self._wake_for(queued) or self._wake_for(work)) \
                                and not self._spare()
                if extra:
                    self.wakes += 1
                    self._shared_wake()
            self._execute(work)
            del work

    def _execute(self, work: list) -> None:
        for fn, args in work:
            self.busy += 1
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task must not kill its thread
                log.exception("uncaught error in %s", self._name)
            finally:
                self.busy -= 1
            del fn, args

    def _split(self, work: list) -> tuple[list, list]:
        """Several pieces of work from one read: (what the thread that read them runs,
        in turn; what it queues). Every request (work not marked ``batchable``) must
        run on a thread of its own, as torch serves each request: one may wait for
        something the next one does (a flag, a reply). So must every reply
        completion, as torch completes each: completing one runs its future's
        callbacks, and one registered where distgrad cannot see it (torch's
        ``collect_all`` registers in C++) may wait for the next reply. Only reply
        completions: the first runs here, the rest are queued for this thread to
        take next, with no wake-up (if the first is held up, any thread that next
        looks for work takes them, at the latest at the heartbeat). With requests:
        the first completion, then the first request, run here; the rest is queued
        with a wake-up. DISTGRAD_BATCH_WAKES=1: one piece here, a wake-up for the rest."""
        batch = [w for w in work if getattr(w[0], "batchable", False)]
        if len(batch) == len(work):
            return work[:1], work[1:]
        requests = [w for w in work if not getattr(w[0], "batchable", False)]
        if self._batch_wakes:
            ordered = batch + requests
            return ordered[:1], ordered[1:]
        return batch[:1] + requests[:1], batch[1:] + requests[1:]

    def _wake_for(self, queued) -> bool:
        """Whether queued work needs a thread woken for it: a piece that may block
        (anything not marked ``batchable``), or DISTGRAD_BATCH_WAKES=1."""
        if self._batch_wakes:
            return True
        for fn, _ in queued:
            if not getattr(fn, "batchable", False):
                return True
        return False

    def _grow(self) -> bool:
        """(Under the lock) start one more thread if the pool may grow."""
        if len(self._threads) < self.max_threads:
            self._spawn()
            return True
        return False

    def _spare(self) -> bool:
        """(Under the lock) start a thread for queued work when none waits and the
        pool may grow; True when that suffices (no wake-up needed)."""
        return not self._waiting and not self._starting and self._grow()

    def readers(self) -> int:
        """Threads inside ``lead`` now."""
        return self._waiting + (1 if self._has_leader else 0)

    def has_tasks(self) -> bool:
        """Whether work waits for this thread (the shared mode's ``lead`` returns
        then); never for the last reader, who must stay one."""
        return bool(self._tasks) and not getattr(self._local, "keep", False)

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
                    # step down: another thread leads, this one runs its share (_split)
                    self._has_leader = False
                    mine, queued = self._split(work) if len(work) > 1 else (work, [])
                    self._tasks.extend(queued)
                    self._wake(1 + len(queued))  # the queued pieces and the leader role
                    return mine
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
        if self._shared_wake is not None:
            self._shared_wake()
        if wait:
            me = threading.current_thread()
            for t in threads:
                if t is not me:
                    t.join(30)
