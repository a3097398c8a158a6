"""A lean thread pool for serving requests and completing futures.

``ThreadPoolExecutor.submit`` builds a Future and a work item and takes an
idle semaphore on every call; the agent needs none of that (it never looks
at the returned future), so a task here is a tuple on a ``SimpleQueue``.
Threads start lazily, one more only when no started thread is idle.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from ..intra_op import mark_distgrad_thread

log = logging.getLogger(__name__)


class WorkerPool:
    """``submit(fn, *args)`` runs ``fn(*args)`` on one of at most ``max_workers`` threads."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "distgrad") -> None:
        self.max_workers = max(1, int(max_workers))
        self._prefix = thread_name_prefix
        self._q: SimpleQueue = SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # started threads free to take a task not yet claimed
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._q.put((fn, args))
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                return
            if len(self._threads) >= self.max_workers:
                return
            t = threading.Thread(target=self._work, daemon=True,
                                 name=f"{self._prefix}_{len(self._threads)}")
            self._threads.append(t)
        t.start()

    def submit_now(self, fn: Callable[..., Any], *args: Any) -> None:
        """Like :meth:`submit`, but never queued behind work that waits for a busy
        thread: when every thread is busy (or has work queued for it) and the pool
        is full, ``fn`` runs on a thread started for it alone (beyond
        ``max_workers``; it ends after). For a task that a thread blocks on (the
        completion of the reply a ``wait()`` read): queued behind callbacks that
        themselves wait for such a completion, it would never run."""
        if self._shutdown:
            raise RuntimeError("cannot schedule new work after shutdown")
        with self._lock:
            room = len(self._threads) < self.max_workers or (self._idle > 0 and self._q.empty())
        if room:
            self.submit(fn, *args)
            return
        threading.Thread(target=self._once, args=(fn, args), daemon=True,
                         name=f"{self._prefix}_extra").start()

    def _once(self, fn: Callable[..., Any], args: tuple) -> None:
        mark_distgrad_thread()
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - as a pool thread
            log.exception("uncaught error in %s", self._prefix)

    def _work(self) -> None:
        mark_distgrad_thread()
        q = self._q
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task must not kill its thread
                log.exception("uncaught error in %s", self._prefix)
            del item, fn, args
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` drop queued tasks; with ``wait`` join."""
        self._shutdown = True
        if cancel_futures:
            try:
                while True:
                    self._q.get_nowait()
            except Empty:
                pass
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        if wait:
            me = threading.current_thread()
            for t in threads:
                if t is not me:
                    t.join()
