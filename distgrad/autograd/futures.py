"""Small helpers for chaining ``torch.futures.Future`` without blocking a thread
and without ``then``'s habit of wrapping errors raised in callbacks.

Example::

    >>> f = chain(all_of([done(1), done(2)]), lambda f: sum(f.wait()))
    >>> f.wait()
    3
"""
from __future__ import annotations

import threading
from typing import Any

import torch


def done(value: Any = None) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_result(value)
    return f


def failed(exc: BaseException) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_exception(exc)
    return f


def all_of(futures: list) -> torch.futures.Future:
    """Completes with the list of values when all complete; fails with the first
    error, unwrapped (``then`` would wrap it in a "running the callback" error)."""
    if not futures:
        return done([])
    result = torch.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_f: torch.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        try:
            values = [f.wait() for f in futures]
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
            return
        result.set_result(values)

    for f in futures:
        f.add_done_callback(one)
    return result


def chain(fut: torch.futures.Future, fn) -> torch.futures.Future:
    """``fut.then(fn)`` without wrapping errors raised by ``fn`` or by ``fut``."""
    result = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        try:
            value = fn(f)
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
            return
        result.set_result(value)
    fut.add_done_callback(done)
    return result
