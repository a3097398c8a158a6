"""Futures that fail with an error raise a new copy of it at every ``wait()``.

``torch.futures.Future.set_exception`` keeps the exception object and raises that
same object at every ``wait()``; each raise adds the waiting frames to its
traceback. The future is a C++ object that Python's cyclic collector cannot look
into, so a frame that holds the future (``fut = rpc.rpc_async(...); fut.wait()`` in
a function, ``self._future.wait()`` in a method) and is in the traceback of the
exception the future holds makes a cycle that is never collected: the frame, its
locals (tensors, RRefs whose owners then never free their values) stay for the
life of the process. torch's RPC futures do not have it: their ``wait()`` makes a
new exception from the stored error each time (``_handle_exception``).

:func:`fail` completes a future so: the stored error loses the traceback it had when
it was caught (its frames may hold the future), and each ``wait()`` raises a copy
of it (same type, arguments, attributes, cause and context; an exception that
cannot be rebuilt from its arguments is raised itself, as before).

Example::

    >>> fut = torch.futures.Future()
    >>> fail(fut, KeyError("k"))
    >>> try:
    ...     fut.wait()
    ... except KeyError as e:
    ...     e.args
    ('k',)
"""
from __future__ import annotations

import copy

import torch


def fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` without a traceback, or ``exc`` itself where it cannot be copied."""
    try:
        new = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an __init__ that its own args do not fit
        return exc
    if type(new) is not type(exc) or new is exc:
        return exc
    new.__cause__ = exc.__cause__
    new.__context__ = exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    return new.with_traceback(None)


def _raise_fresh(exc: BaseException):
    raise fresh(exc)


def fail(fut: torch.futures.Future, exc: BaseException) -> None:
    """Complete ``fut`` with ``exc`` (as ``set_exception``), each ``wait()`` raising a copy."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:   # (the frames of where it was caught)
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    fut._set_unwrap_func(_raise_fresh)
    fut.set_result(exc)
