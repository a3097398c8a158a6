"""Caller-side RPC profiling: the callee's events, merged into the caller's profile.

With torch's legacy autograd profiler recording
(``torch.autograd.profiler_legacy.profile``), an RPC made by ``rpc_sync``,
``rpc_async`` or ``remote`` is recorded under torch's key
(``rpc_async#f(worker0 -> worker1)``, see :mod:`.profiling`) and, as torch
does, the callee runs the call under the same profiler configuration
(``record_shapes``, ``profile_memory``, ``with_stack``, ...) and sends its
events back with the reply. When the profile ends, they appear in its
``function_events`` as *remote* events: ``is_remote`` True, ``node_id`` the
rank they ran on, named ``<key>#remote_op: <name>`` (a nested RPC made by the
callee nests the prefixes). Local events carry this worker's rank as
``node_id`` (``torch._C._distributed_rpc._set_profiler_node_id``, while RPC
is up).

How, given that torch's profiler takes no events from Python: while distgrad's
RPC is initialized (:func:`attach` .. :func:`detach`), two pass-through
wrappers sit on ``torch.autograd.profiler_legacy``:

* ``profile._start_trace`` opens a :class:`_Session` on the profiling thread
  (the profile's options and when it started);
* ``_parse_legacy_records``, which ``profile.__exit__`` calls to turn the
  profiler's records into ``FunctionEvent`` objects, appends the remote events
  of that thread's session to its result, when the records are the session's
  (their ``__start_profile`` mark falls within the session's start).

A profile during which no distgrad RPC completed gets torch's result object
unchanged; an error while merging is logged and the profile keeps its local
events. Remote events are placed inside the caller's event of their RPC,
centred (the callee's window is shorter than the round trip): no clock is
shared between workers.

Example (on worker0)::

    >>> with torch.autograd.profiler_legacy.profile() as prof:
    ...     rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    >>> [e.name for e in prof.function_events if e.is_remote]
    ['rpc_sync#aten::add(worker0 -> worker1)#remote_op: aten::add', ...]
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler_legacy as _legacy
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, FunctionEvent

from .devices import new_future
from .future_errors import fail
from .pending import agent_or_none

log = logging.getLogger(__name__)

REMOTE_OP = "#remote_op: "  # torch's separator between an RPC's key and a remote event's name
# How far the profiler's first mark may lie from the session's start (both unix
# microseconds, from two clocks of this process) for the records to be the session's.
_SLACK_US = 1e6

_tls = threading.local()
_lock = threading.Lock()
_originals: dict[str, Callable] = {}
_node_id = [-1]


def _now_us() -> float:
    return time.time_ns() / 1000.0


# -- installing the hooks ---------------------------------------------------------
def attach(rank: int) -> None:
    """RPC is up on this process as ``rank``: local events carry ``rank`` as
    node_id and torch's legacy profile sessions merge remote events."""
    _set_node_id(rank)
    with _lock:
        if _originals or not _hookable():
            return
        _originals["start"] = _legacy.profile._start_trace
        _originals["parse"] = _legacy._parse_legacy_records
        _like(_start_trace_hook, _originals["start"])
        _like(_parse_hook, _originals["parse"])
        _legacy.profile._start_trace = _start_trace_hook
        _legacy._parse_legacy_records = _parse_hook


def detach() -> None:
    """RPC shut down: torch's profiler functions as they were (each wrapper
    removed unless someone replaced it since). As after torch's RPC, the node
    id stays (torch admits no "none" again)."""
    with _lock:
        if not _originals:
            return
        if _legacy.profile.__dict__.get("_start_trace") is _start_trace_hook:
            _legacy.profile._start_trace = _originals["start"]
        if _legacy._parse_legacy_records is _parse_hook:
            _legacy._parse_legacy_records = _originals["parse"]
        _originals.clear()


def _like(wrapper: Callable, original: Callable) -> None:
    """``wrapper`` takes ``original``'s name, docstring and signature (``__wrapped__``);
    its ``__module__`` stays distgrad's, so it never passes for torch's."""
    functools.update_wrapper(wrapper, original, ("__name__", "__qualname__", "__doc__"), ())


def _hookable() -> bool:
    return callable(_legacy.__dict__.get("_parse_legacy_records")) and \
        callable(getattr(_legacy.profile, "_start_trace", None))


def _set_node_id(rank: int) -> None:
    _node_id[0] = rank
    setter = getattr(getattr(torch._C, "_distributed_rpc", None), "_set_profiler_node_id", None)
    if setter is not None:
        setter(rank)


def parse_records(thread_records: list) -> list[FunctionEvent]:
    """torch's own record parser (never the merging wrapper)."""
    return _originals.get("parse", _legacy._parse_legacy_records)(thread_records)


def _start_trace_hook(self) -> None:
    options = tuple(bool(getattr(self, name, False)) for name in
                    ("use_cuda", "record_shapes", "profile_memory", "with_stack", "with_flops",
                     "with_modules"))
    session = _Session(options)
    previous = getattr(_tls, "session", None)
    _tls.session = session
    try:
        _originals.get("start", _legacy.profile._start_trace)(self)
    except BaseException:
        _tls.session = previous
        raise
    session.hi_us = _now_us()


def _parse_hook(thread_records: list) -> list[FunctionEvent]:
    functions = parse_records(thread_records)
    session = getattr(_tls, "session", None)
    if session is None:
        return functions
    try:
        start_us = _start_us(thread_records)
        if not session.owns(start_us):
            return functions  # records of some other profiler on this thread
        _tls.session = None
        return session.merge(functions, start_us)
    except Exception:  # noqa: BLE001 - the profile keeps its local events
        log.exception("could not merge the remote events of RPCs into the profile")
        return functions


def _start_us(thread_records: list) -> float:
    for thread in thread_records:
        for record in thread:
            if record.name() == "__start_profile":
                return record.start_us()
    raise ValueError("no __start_profile mark in the profiler's records")


# -- caller side ------------------------------------------------------------------
class _Call:
    """One profiled RPC: its key, when it was sent and, once answered, the
    callee's events and window (microseconds)."""

    __slots__ = ("key", "t0_us", "reply")

    def __init__(self, key: str) -> None:
        self.key = key
        self.t0_us = _now_us()
        self.reply: tuple | None = None  # (t1_us, events, window_us), set once


class _Session:
    """One legacy profile on one thread (or one profiled request on a callee)."""

    def __init__(self, options: tuple) -> None:
        self.options = options
        self.lo_us = _now_us()
        self.hi_us = self.lo_us
        self.calls: list[_Call] = []

    def owns(self, start_us: float) -> bool:
        return self.lo_us - _SLACK_US <= start_us <= self.hi_us + _SLACK_US

    def merge(self, functions: list[FunctionEvent], start_us: float) -> list[FunctionEvent]:
        """``functions`` (relative to ``start_us``) with the remote events of
        every answered call; torch's result itself when there are none."""
        answered = [c for c in self.calls if c.reply is not None]
        if not answered:
            return functions
        used: set[int] = set()
        extra: list[FunctionEvent] = []
        for call in answered:
            t1_us, events, window = call.reply
            span = _own_event_span(functions, call, start_us, used)
            if span is None:
                # This RPC's own event is not in the records (it ended after they
                # were taken: a callee's async function): stand it in.
                span = (call.t0_us - start_us, t1_us - start_us)
                extra.append(FunctionEvent(
                    id=0, name=call.key, trace_name=call.key, thread=0, start_us=span[0],
                    end_us=span[1], stack=[], is_async=True, node_id=_node_id[0], is_legacy=True))
            shift = span[0] + max(0.0, (span[1] - span[0]) - window) / 2
            extra.extend(_remote_event(packed, call.key, shift) for packed in events)
        out = list(functions) + extra
        out.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
        return out


def _own_event_span(functions: list, call: _Call, start_us: float, used: set) -> tuple | None:
    """(start, end) of the caller's event of ``call``: among the local events
    named by its key and not matched yet, the one that began closest to when
    the call was sent."""
    best, best_gap = None, None
    sent = call.t0_us - start_us
    for i, e in enumerate(functions):
        if e.name != call.key or e.is_remote or i in used:
            continue
        gap = abs(e.time_range.start - sent)
        if best_gap is None or gap < best_gap:
            best, best_gap = i, gap
    if best is None:
        return None
    used.add(best)
    e = functions[best]
    return e.time_range.start, e.time_range.end


def _remote_event(packed: tuple, key: str, shift: float) -> FunctionEvent:
    (name, trace_name, start, end, thread, fwd_thread, shapes, stack, scope, cpu_mem, dev_mem,
     is_async, sequence_nr, node_id, flops, ident) = packed
    prefix = key + REMOTE_OP
    return FunctionEvent(
        id=ident, name=prefix + name, trace_name=prefix + (trace_name or name), thread=thread,
        start_us=start + shift, end_us=end + shift, fwd_thread=fwd_thread, input_shapes=shapes,
        stack=stack, scope=scope, cpu_memory_usage=cpu_mem, device_memory_usage=dev_mem,
        is_async=is_async, is_remote=True, sequence_nr=sequence_nr, node_id=node_id,
        is_legacy=True, flops=flops)


def _pack(e: FunctionEvent) -> tuple:
    return (e.name, e.trace_name, e.time_range.start, e.time_range.end, e.thread, e.fwd_thread,
            e.input_shapes, e.stack, e.scope, e.cpu_memory_usage, e.device_memory_usage,
            e.is_async, e.sequence_nr, e.node_id, e.flops, e.id)


class Profiled:
    """What a profiled call's callee sends back: the value and its events
    (packed, times relative to the callee's window of ``window`` us)."""

    def __init__(self, value: Any, events: list, window: float) -> None:
        self.value, self.events, self.window = value, events, window

    def __reduce__(self):
        return Profiled, (self.value, self.events, self.window)


class RpcProfile:
    """One RPC made on a thread where torch's legacy profiler records.

    ``payload`` asks the callee to profile the call when this thread's profile
    is a session (a ``profile`` context opened while RPC is up); ``result`` and
    ``future`` take the callee's events off the reply."""

    def __init__(self, key: str, scope: Any) -> None:
        self.session: _Session | None = getattr(_tls, "session", None)
        self.call: _Call | None = None
        self.key, self.scope = key, scope

    def payload(self, payload: tuple) -> tuple:
        if self.session is None:
            return payload
        self.call = _Call(self.key)
        self.session.calls.append(self.call)
        func, args, kwargs = payload
        return _run_profiled, (self.session.options, func, args, kwargs), {}

    def result(self, value: Any) -> Any:
        """The reply's value (the events kept for the profile)."""
        if self.call is None or not isinstance(value, Profiled):
            return value
        self.call.reply = (_now_us(), value.events, value.window)
        return value.value

    def future(self, fut: torch.futures.Future) -> torch.futures.Future:
        """A future of the reply's value, completed after the events were kept
        (errors pass through as they are)."""
        if self.call is None:
            return fut
        out = new_future(agent_or_none())   # with the agent's devices, as the call's own

        def done(f: torch.futures.Future) -> None:
            try:
                value = self.result(f.wait())
            except BaseException as e:  # noqa: BLE001 - the future carries it
                fail(out, e)
                return
            out.set_result(value)

        fut.add_done_callback(done)
        return out


def split_remote(value: Any) -> tuple[Any, Any]:
    """For a remote() owner: (the value to keep, what the confirmation carries)."""
    if isinstance(value, Profiled):
        return value.value, Profiled(None, value.events, value.window)
    return value, None


# -- callee side ------------------------------------------------------------------
def _run_profiled(options: tuple, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a call under torch's legacy profiler with the caller's options; the
    reply is :class:`Profiled` (for an async function, once its future completes)."""
    from .agent import AsyncResult
    is_async = bool(getattr(func, "_wrapped_async_rpc_function", None))
    if torch.autograd._profiler_enabled():  # this thread records already (a server-side profile)
        result = func(*args, **kwargs)
        return _reply(result, is_async, lambda value: Profiled(value, [], 0.0), AsyncResult)
    use_cuda, record_shapes, profile_memory, with_stack, with_flops, with_modules = options
    config = _legacy.profile(use_cuda=use_cuda and torch.cuda.is_available(), record_shapes=record_shapes,
                             profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops,
                             with_modules=with_modules).config()
    session = _Session(options)
    previous = getattr(_tls, "session", None)
    _tls.session = session
    try:
        torch.autograd._enable_profiler_legacy(config)
    except BaseException:
        _tls.session = previous
        raise
    try:
        session.hi_us = _now_us()
        result = func(*args, **kwargs)
    finally:
        records = torch.autograd._disable_profiler_legacy()
        _tls.session = previous
    return _reply(result, is_async, lambda value: Profiled(value, *_collect(session, records)), AsyncResult)


def _reply(result: Any, is_async: bool, wrap: Callable[[Any], Profiled], async_type: type) -> Any:
    if isinstance(result, async_type):
        result, is_async = result.future, True
    if not is_async:
        return wrap(result)
    if not isinstance(result, torch._C.Future):
        return async_type(result)  # the agent reports the wrong return type
    out = new_future(agent_or_none())

    def done(f: torch.futures.Future) -> None:
        try:
            value = wrap(f.wait())
        except BaseException as e:  # noqa: BLE001 - the future carries it
            fail(out, e)
            return
        out.set_result(value)

    result.add_done_callback(done)
    return async_type(out)


def _collect(session: _Session, records: list) -> tuple[list, float]:
    """A callee's events (with those of its own profiled RPCs), packed, and the
    length of its window (us)."""
    start_us = _start_us(records)
    functions = session.merge(parse_records(records), start_us)
    window = _now_us() - start_us
    packed = []
    for e in functions:
        if e.name == MEMORY_EVENT_NAME:
            continue  # top-level allocations: no range to place
        window = max(window, e.time_range.end)
        packed.append(_pack(e))
    return packed, window
