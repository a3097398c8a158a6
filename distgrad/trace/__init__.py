"""One timeline of a distributed step: ``distgrad.trace``.

``distgrad.trace`` is this module, and it can be called: ``distgrad.trace(path)``
is a context manager that records, on every worker of the group, each RPC (sent,
arrived, served, reply sent and received, with bytes), each distributed backward
(the pass on each worker, its regions, the gradients sent and received),
``DistributedOptimizer.step`` on each owner, RRef forks and deletes, and user
spans (:func:`span`); on exit the recordings are gathered, put on the tracing
worker's clock and written as one Chrome trace-event JSON file (open it at
https://ui.perfetto.dev or chrome://tracing; draw it with ``distgrad trace-plot``).

Example (on worker0, with RPC initialized on every worker)::

    >>> import distgrad
    >>> with distgrad.trace("step.json"):
    ...     with distgrad.trace.span("forward"):
    ...         y = rpc.rpc_sync("worker1", torch.matmul, args=(a, b))
    >>> # or: distgrad.trace.start("step.json"); ...; distgrad.trace.stop()

For chosen steps of a long job, :func:`schedule` opens and closes traces as
``torch.profiler.schedule`` does (wait, warmup, active, repeat), with a span per step;
:func:`on_signal` lets a running job be traced on demand (``kill -USR1 <pid>``).

Nothing here costs anything while no trace is open: the recorder's wrappers sit
on the agent only while one is (:mod:`.recorder`).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

from .. import observe
from . import recorder
from .attach import on_signal
from .clock import local_ns
from .schedule import Schedule, schedule

__all__ = ["start", "stop", "span", "is_tracing", "schedule", "Schedule", "on_signal"]


def start(path: str, profile_ops: bool = False, timeout: float = 30.0,
          max_events: int = recorder.DEFAULT_MAX_EVENTS) -> None:
    """Start recording a trace on every worker of the group, to be written to ``path``
    by :func:`stop` on this worker.

    ``path`` is checked now (its directory must exist and be writable) and made
    absolute; the file is written atomically at the close. ``profile_ops=True`` also
    runs ``torch.profiler.profile`` on each worker for the window (every thread), its
    events merged on the same clock, with torch's links from each forward op to the
    backward node it made; ``profile_ops="shapes"`` adds its ``record_shapes`` (each
    op's input dims and types, at its cost); it is refused while a torch profiler is active
    here, or a ``torch.profiler.profile`` with a schedule is started and not stopped
    (in any phase: a worker whose user profiles itself records without torch's ops;
    a profiler of someone else's is never ended; one the program starts while the
    trace is open takes torch's session over: that worker's ops are then left out,
    said in the file, and the program's profiler is left whole). An exception while this waits on
    the members (Ctrl-C included) leaves none of them recording. ``rpc.shutdown()``
    with the trace still open closes it and writes the file, with a warning.
    ``timeout`` (s) bounds each worker's answer to start and stop: one that does not
    answer is left out and named in the file's metadata (``otherData.distgrad.missing``).
    Each worker keeps its last ``max_events`` events (the older ones are counted in
    ``otherData.distgrad.dropped``); a member whose tracing worker is lost stops recording.

    Example::

        >>> distgrad.trace.start("trace.json")
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        >>> distgrad.trace.stop()
        '/home/me/trace.json'
    """
    from .session import open_trace
    open_trace(path, profile_ops, timeout, max_events)


def stop() -> str:
    """Stop the trace this worker started: gather every worker's events (each within
    the start's ``timeout``), align clocks, write the file; returns its (absolute) path.

    Example::

        >>> distgrad.trace.stop()
        '/home/me/trace.json'
    """
    from .session import close_trace
    return close_trace()


@contextlib.contextmanager
def _traced(path: str, profile_ops: bool = False, timeout: float = 30.0,
            max_events: int = recorder.DEFAULT_MAX_EVENTS) -> Iterator[str]:
    start(path, profile_ops, timeout, max_events)
    try:
        yield path
    except BaseException:
        try:  # the block's own error is the one the user sees; the trace is still written
            stop()
        except Exception as e:  # noqa: BLE001 - reported, never instead of the block's error
            logging.getLogger(__name__).warning("distgrad.trace: the trace to %s was not written: "
                                                "%s: %s", path, type(e).__name__, e)
        raise
    stop()


class _NullSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


_NULL = _NullSpan()


class _Span:
    __slots__ = ("rec", "name", "args", "t0", "cpu0")

    def __init__(self, rec: Any, name: str, args: dict) -> None:
        self.rec, self.name, self.args = rec, name, args

    def __enter__(self) -> None:
        self.cpu0 = time.thread_time_ns()
        self.t0 = local_ns()

    def __exit__(self, *exc: Any) -> bool:
        # the thread's CPU time in the span: the summary counts it as computing only
        # where the thread mostly ran (a span around a sleep or an untraced wait is not)
        self.args["cpu_us"] = round((time.thread_time_ns() - self.cpu0) / 1e3, 1)
        self.rec.span(self.name, "user", self.t0, self.args)
        return False


def span(name: str, **args: Any) -> Any:
    """A span of the calling thread in the open trace (nothing when none is open);
    keyword arguments (any values) show in the span's details, with ``cpu_us``, the
    CPU time the thread spent in it.

    Example::

        >>> with distgrad.trace.span("loss", batch=3):
        ...     loss = criterion(out, target)
    """
    rec = observe.ACTIVE
    return _NULL if rec is None else _Span(rec, str(name), args)


def is_tracing() -> bool:
    """Whether this worker is recording a trace now (whoever opened it)."""
    return observe.ACTIVE is not None


class _CallableModule(types.ModuleType):
    def __call__(self, path: str, profile_ops: bool = False, timeout: float = 30.0,
                 max_events: int = recorder.DEFAULT_MAX_EVENTS) -> Any:
        """``with distgrad.trace(path, profile_ops=False):`` records one trace (see
        :func:`start`); the file is written when the block ends (also when it raised:
        its error is the one that propagates)."""
        return _traced(path, profile_ops, timeout, max_events)


sys.modules[__name__].__class__ = _CallableModule
