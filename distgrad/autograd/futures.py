"""Small helpers for ``torch.futures.Future`` (used by the engine's discovery)
that neither block a thread nor wrap errors as ``then`` does.

Example::

    >>> all_of([done(1), done(2)]).wait()
    [1, 2]
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..rpc.future_errors import fail


def done(value: Any = None) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_result(value)
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
            fail(result, e)
            return
        result.set_result(values)

    for f in futures:
        f.add_done_callback(one)
    return result
