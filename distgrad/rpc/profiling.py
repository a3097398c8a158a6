"""Server-side profiling of the requests a worker serves.

``_server_process_global_profile`` (torch's name) profiles, with torch's
legacy autograd profiler, every request this worker's pool runs while the
block is open, whichever thread runs it: each request is one thread-local
profiling range, and on exit ``process_global_function_events`` holds one
event list per request and ``function_events`` all of them.

Example (on the server, or through an RRef to one created there)::

    >>> with rpc._server_process_global_profile() as prof:
    ...     time.sleep(1)       # meanwhile other workers call this one
    >>> print(prof.key_averages().table())

Also the caller's side of an RPC under torch's legacy profiler: the scope it is
recorded under (:func:`rpc_scope`, :func:`rpc_profile`); the callee's events
that join the caller's profile are :mod:`.remote_profiling`'s.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler_legacy import profile as _legacy_profile

from . import remote_profiling

_lock = threading.Lock()
active: list[_server_process_global_profile] = []


class _server_process_global_profile(_legacy_profile):
    """torch.autograd.profiler_legacy.profile for every request this worker serves."""

    def __enter__(self):
        if not self.enabled:
            return self
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        self._records: list = []
        with _lock:
            active.append(self)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if not self.enabled:
            return False
        with _lock:
            if self in active:
                active.remove(self)
            records, self._records = self._records, []
        per_request = []
        for thread_records in records:
            events = remote_profiling.parse_records(thread_records)
            events.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
            per_request.append(events)
        self.function_events = torch.autograd.profiler_util.EventList(
            list(itertools.chain.from_iterable(per_request)),
            use_device="cuda" if self.use_cuda else None, profile_memory=self.profile_memory)
        self.function_events._build_tree()
        self.process_global_function_events = per_request
        return False


def run(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a served request, profiled for every server-side profile open."""
    with _lock:
        profiles = list(active)
    if not profiles or torch.autograd._profiler_enabled():
        return func(*args, **kwargs)
    torch.autograd._enable_profiler_legacy(profiles[0].config())
    try:
        return func(*args, **kwargs)
    finally:
        records = torch.autograd._disable_profiler_legacy()
        with _lock:
            for prof in profiles:
                if prof in active:
                    prof._records.append(records)


def legacy_profiler_on() -> bool:
    """Whether torch's legacy autograd profiler records on this thread (as torch,
    RPCs are then recorded under their profiling key)."""
    return torch.autograd._profiler_enabled() and \
        torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY


def rpc_scope(mode: Any, func: Any, src: str, dst: str) -> Any:
    """The record_function scope an RPC is profiled under, named as torch names it
    (``rpc_async#my_fn(worker0 -> worker1)``); the caller's side only."""
    return torch.autograd.profiler.record_function(_key(mode, func, src, dst))


def rpc_profile(mode: Any, func: Any, src: str, dst: str) -> remote_profiling.RpcProfile:
    """An RPC profiled on both sides: ``.scope`` as :func:`rpc_scope`, and the
    callee's events merged into this thread's profile (see :mod:`.remote_profiling`)."""
    key = _key(mode, func, src, dst)
    return remote_profiling.RpcProfile(key, torch.autograd.profiler.record_function(key))


def _key(mode: Any, func: Any, src: str, dst: str) -> str:
    from .internal import _build_rpc_profiling_key
    return _build_rpc_profiling_key(mode, _name(func), src, dst)


def _name(func: Any) -> str:
    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    return getattr(func, "__qualname__", None) or repr(func)
