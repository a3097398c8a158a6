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

import torch

log = logging.getLogger(__name__)


# torch's intra-op thread count is kept per thread: ``torch.set_num_threads(n)`` sets
# the calling thread's OpenMP and MKL counts and a global, and another thread reads
# the global only when ATen initializes it (its engine and inter-op threads at their
# start, any thread at its first large ``parallel_for``). A small matrix product
# initializes nothing: on a Python thread MKL then runs with OpenMP's default team
# (every core) where torch's threads run with the user's ``n``. On 2 cores a
# ``Linear(512, 10)`` backward on a distgrad thread took 2.5x its time on torch's
# (the team's spin-waits, next to other processes, for a 10x64 @ 64x512 product).
# So a distgrad thread takes the global before it runs a served call, a backward
# run or a future's callbacks (``at::init_num_threads``: 0.1 us), which also follows
# a later ``torch.set_num_threads`` on any thread.
follow_intra_op_threads = torch.init_num_threads


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

    def _work(self) -> None:
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
