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
import types

import torch


def _python_init(cls: type) -> bool:
    """Whether ``cls`` (an exception class) has an ``__init__`` written in Python."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            return isinstance(init, types.FunctionType)
    return False


def fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` without a traceback, or ``exc`` itself where it cannot be copied.

    An exception class with an ``__init__`` of its own is copied without running it
    again (it may rewrite the message, ``"prefix: " + msg``, or do more): a new object
    of its type with its arguments and attributes. A built-in one is copied as
    ``copy.copy`` does, through its C ``__init__``, which sets its fields (``SystemExit``'s
    ``code``, ``StopIteration``'s ``value``) from the arguments."""
    cls = type(exc)
    try:
        if _python_init(cls):
            new = cls.__new__(cls, *exc.args)
            new.args = exc.args
            new.__dict__.update(exc.__dict__)
        else:
            new = copy.copy(exc)
    except Exception:  # noqa: BLE001 - a __new__ or __init__ that its own args do not fit
        return exc
    if type(new) is not cls or new is exc:
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
