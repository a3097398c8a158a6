"""One worker's recording while a trace is open (:class:`Recorder`).

Tracing off costs the message path nothing: no flag is checked per message. While
a trace is open, the recorder puts pass-through wrappers on the running agent's
instance (``send_request``, ``notify``, ``send_control``, ``on_message``,
``_serve``, ``wait``, ``read_reply``, the control handlers) and on its transport's
``send``; :meth:`Recorder.uninstall` takes them off, and the classes' own methods
run again. The layers above (the distributed backward, the optimizer, RRef forks,
user spans) check :data:`ACTIVE` where they start a span: once per backward run,
optimizer step or fork, never per message.

Events are kept raw, on this worker's clock (:func:`.clock.local_ns`), as tuples:
``("X", name, cat, tid, start_ns, end_ns, args)`` spans, ``("s"|"f", flow_id, tid,
ns, name)`` flow ends, ``("i", name, cat, tid, ns, args)`` instants;
:mod:`.export` turns them into trace events on the tracing worker's clock.

Flows: a request ``rid`` sent by rank ``r`` has flow id :func:`flow_id`\\ ``(r, rid,
0)`` on both sides; its reply ``flow_id(r, rid, 1)``. The ``s`` end is stamped just
before the bytes leave (inside the send span), the ``f`` end inside the span of the
thread that read it.

Example (what :func:`distgrad.trace` does on each worker)::

    >>> rec = Recorder(current_agent(), session=(0, 1))
    >>> rec.install(); ...; rec.uninstall()
    >>> rec.events[0][:3]
    ('X', 'rpc_sync add → worker1', 'rpc.call')
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..wire import Kind
from ..wire.messages import peek_header
from .clock import local_ns

#: the recorder of the trace open on this worker, or None (read by the layers above RPC)
ACTIVE: Recorder | None = None

# the tracing session's own RPCs (start, stop, pings) are never recorded
_OWN = "distgrad.trace."
_REQUESTS = (Kind.CALL, Kind.REMOTE, Kind.NOTIFY)
_REPLIES = (Kind.REPLY, Kind.ERROR)
# friendlier names for distgrad's own functions in span names
_NAMES = {
    "distgrad.autograd.engine._propagate": "gradients",
    "distgrad.autograd.engine._resume": "backward resume",
    "distgrad.autograd.engine._flush": "backward DDP flush",
    "distgrad.autograd.engine._discover": "backward discovery",
}


def flow_id(rank: int, rid: int, reply: int) -> int:
    """The id both ends of a message's flow share (unique in a trace; < 2**53)."""
    return ((rank + 1) << 41) | (rid << 1) | reply


def short(what: str) -> str:
    """A function's name as spans show it (``torch.add`` -> ``add``)."""
    if what in _NAMES:
        return _NAMES[what]
    return what.rsplit(".", 1)[-1] or what


def _nbytes(frames: Any) -> int:
    n = 0
    for f in frames:
        n += memoryview(f).nbytes
    return n


class Recorder:
    """The events one worker records for one trace (see the module's docstring)."""

    def __init__(self, agent: Any, session: tuple) -> None:
        self.agent, self.session = agent, session
        self.rank, self.name = agent.rank, agent.name
        self.events: list[tuple] = []
        self.threads: dict[int, str] = {}
        self.started_ns = local_ns()
        self.stopped_ns = 0
        self._tls = threading.local()
        self._arrived: dict[tuple[int, int], tuple] = {}  # (peer, rid) -> arrival, until served
        self._calls: dict[int, tuple[str, str]] = {}      # rid -> (function, peer) awaiting a reply
        self._served: dict[tuple[int, int], str] = {}     # (peer, rid) -> function, until replied
        self._saved: dict[str, Any] = {}
        self._serving = 0  # requests being served now (their span still to come)
        self._count = threading.Lock()
        self._handlers: dict[str, tuple[Callable, Callable]] = {}

    # -- recording ------------------------------------------------------------
    def tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def span(self, name: str, cat: str, start_ns: int, args: dict | None = None) -> None:
        """A span of this thread from ``start_ns`` to now."""
        self.events.append(("X", name, cat, self.tid(), start_ns, local_ns(), args or {}))

    def instant(self, name: str, cat: str, args: dict | None = None) -> None:
        self.events.append(("i", name, cat, self.tid(), local_ns(), args or {}))

    # -- the wrappers ------------------------------------------------------------
    def install(self) -> None:
        """Put the wrappers on the agent (and its transport): recording starts."""
        agent, transport = self.agent, self.agent.transport
        wrappers = {"send_request": self._send_request, "notify": self._notify,
                    "send_control": self._send_control, "on_message": self._on_message,
                    "_serve": self._serve, "wait": self._wait, "read_reply": self._read_reply}
        for attr, wrapper in wrappers.items():
            self._saved[attr] = getattr(agent, attr)
            setattr(agent, attr, wrapper)
        self._saved["transport.send"] = transport.__dict__.get("send")
        self._send = transport.send
        transport.send = self._transport_send
        for op, fn in list(agent.control_handlers.items()):
            wrapped = self._control(op, fn)
            self._handlers[op] = (fn, wrapped)
            agent.control_handlers[op] = wrapped

    def uninstall(self) -> None:
        """Take the wrappers off: the agent's own methods run again."""
        agent, transport = self.agent, self.agent.transport
        for attr in ("send_request", "notify", "send_control", "on_message", "_serve", "wait",
                     "read_reply"):
            if attr in agent.__dict__:
                del agent.__dict__[attr]
        if self._saved.get("transport.send") is not None:
            transport.send = self._saved["transport.send"]
        else:
            transport.__dict__.pop("send", None)
        for op, (fn, wrapped) in self._handlers.items():
            if agent.control_handlers.get(op) is wrapped:
                agent.control_handlers[op] = fn
        self.stopped_ns = local_ns()

    def _send_request(self, dest: Any, kind: Kind, payload_obj: Any, what: str, timeout: float,
                      sync: bool = False, extra: Any = None) -> Any:
        orig, tls = self._saved["send_request"], self._tls
        if what.startswith(_OWN):
            tls.skip = True
            try:
                return orig(dest, kind, payload_obj, what, timeout, sync, extra)
            finally:
                tls.skip = False
        verb = "remote" if kind == Kind.REMOTE else "rpc_sync" if sync else "rpc_async"
        t0 = local_ns()
        tls.what = what
        try:
            return orig(dest, kind, payload_obj, what, timeout, sync, extra)
        finally:
            tls.what = None
            self.span(f"{verb} {short(what)} → {dest.name}", "rpc.call", t0,
                      {"to": dest.name, "function": what})

    def _notify(self, to: Any, func: Callable, args: tuple = (), kwargs: dict | None = None) -> bool:
        from ..rpc.agent import _qualname
        what = _qualname(func)
        self._tls.what = what
        try:
            return self._saved["notify"](to, func, args, kwargs)
        finally:
            self._tls.what = None

    def _send_control(self, dest: int, op: str, *args: Any) -> None:
        self._tls.what = f"control {op}"
        try:
            self._saved["send_control"](dest, op, *args)
        finally:
            self._tls.what = None

    def _transport_send(self, peer: int, frames: Any) -> Any:
        tls = self._tls
        if getattr(tls, "skip", False):
            return self._send(peer, frames)
        t0 = local_ns()
        try:
            kind, rid, _ = peek_header(frames)
        except Exception:  # noqa: BLE001 - not an agent message: not ours to record
            return self._send(peer, frames)
        what = getattr(tls, "what", None)
        nbytes = _nbytes(frames)
        to = self._peer_name(peer)
        flow = None
        if kind in _REQUESTS:
            flow = flow_id(self.rank, rid, 0)
            what = what or "?"
            if kind != Kind.NOTIFY:
                self._calls[rid] = (what, to)
            name = f"send {short(what)} → {to}"
        elif kind in _REPLIES:
            served = self._served.pop((peer, rid), None)
            if served is None:  # the reply to a request served before the trace (or its own)
                return self._send(peer, frames)
            flow = flow_id(peer, rid, 1)
            word = "error" if kind == Kind.ERROR else "reply"
            name = f"send {word} {short(served)} → {to}"
        else:
            name = f"send {what or 'control'} → {to}"
        tid = self.tid()
        ts = local_ns()
        try:
            return self._send(peer, frames)
        finally:
            end = local_ns()
            args = {"to": to, "bytes": nbytes, "kind": Kind(kind).name.lower(), "rid": rid}
            if what:
                args["function"] = what
            self.events.append(("X", name, "rpc.send", tid, t0, end, args))
            if flow is not None:
                self.events.append(("s", flow, tid, ts, "request" if kind in _REQUESTS else "reply"))

    def _on_message(self, peer: int, frames: list) -> Any:
        t0 = local_ns()
        try:
            kind, rid, _ = peek_header(frames)
        except Exception:  # noqa: BLE001 - the agent reports it
            return self._saved["on_message"](peer, frames)
        tid = self.tid()
        ta = local_ns()  # the flow's end: inside the span, which starts at t0
        work = None
        try:
            work = self._saved["on_message"](peer, frames)
            return work
        finally:
            end = local_ns()
            frm = self._peer_name(peer)
            if kind in _REPLIES:
                call = self._calls.pop(rid, None)
                if call is not None:  # a reply to a call made while tracing
                    what = call[0]
                    word = "error" if kind == Kind.ERROR else "reply"
                    self.events.append(("X", f"recv {word} {short(what)} ← {frm}", "rpc.recv", tid, t0,
                                        end, {"from": frm, "bytes": _nbytes(frames), "function": what,
                                              "kind": word, "rid": rid}))
                    self.events.append(("f", flow_id(self.rank, rid, 1), tid, ta, "reply"))
            elif kind in _REQUESTS:
                if work is not None:  # named when served (its function is known then)
                    self._arrived[(peer, rid)] = (tid, t0, ta, end, _nbytes(frames), kind)
            else:
                op = getattr(self._tls, "control", None)
                self._tls.control = None
                self.events.append(("X", f"recv control {op or '?'} ← {frm}", "rpc.recv", tid, t0, end,
                                    {"from": frm, "bytes": _nbytes(frames), "kind": "control"}))

    def _control(self, op: str, fn: Callable) -> Callable:
        def handler(peer: int, *args: Any) -> Any:
            self._tls.control = op
            return fn(peer, *args)
        return handler

    def _serve(self, peer: int, msg: Any) -> None:
        orig, tls = self._saved["_serve"], self._tls
        meta = msg.meta
        what = meta[0] if isinstance(meta, tuple) and meta and isinstance(meta[0], str) else "?"
        arrived = self._arrived.pop((peer, msg.rid), None)
        if what.startswith(_OWN):
            tls.skip = True
            try:
                return orig(peer, msg)
            finally:
                tls.skip = False
        frm = self._peer_name(peer)
        if arrived is not None:
            tid, t0, ta, end, nbytes, kind = arrived
            self.events.append(("X", f"recv {short(what)} ← {frm}", "rpc.recv", tid, t0, end,
                                {"from": frm, "bytes": nbytes, "function": what,
                                 "kind": Kind(kind).name.lower(), "rid": msg.rid}))
            self.events.append(("f", flow_id(peer, msg.rid, 0), tid, ta, "request"))
        if msg.kind != Kind.NOTIFY:
            self._served[(peer, msg.rid)] = what
        with self._count:
            self._serving += 1
        t0 = local_ns()
        try:
            return orig(peer, msg)
        finally:
            self.span(f"serve {short(what)} ← {frm}", "rpc.serve", t0,
                      {"from": frm, "function": what, "rid": msg.rid})
            with self._count:
                self._serving -= 1

    def _wait(self, p: Any) -> Any:
        t0 = local_ns()
        try:
            return self._saved["wait"](p)
        finally:
            self._wait_span(p, t0)

    def _read_reply(self, p: Any) -> None:
        t0 = local_ns()
        try:
            return self._saved["read_reply"](p)
        finally:
            self._wait_span(p, t0)

    def _wait_span(self, p: Any, t0: int) -> None:
        if not p.what.startswith(_OWN):
            frm = self._peer_name(p.peer)
            self.span(f"wait {short(p.what)} ← {frm}", "rpc.wait", t0, {"from": frm, "function": p.what})

    def _peer_name(self, peer: int) -> str:
        w = self.agent.workers.get(peer)
        return w.name if w is not None else f"rank {peer}"

    # -- the result ------------------------------------------------------------
    def settle(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout`` s) for the requests being served to end: a reply
        leaves before its serve span is recorded, so the caller may close the trace
        in between."""
        import time
        deadline = time.monotonic() + timeout
        while self._serving > 0 and time.monotonic() < deadline:
            time.sleep(0.001)

    def payload(self) -> dict:
        """What this worker sends the tracing worker when the trace closes."""
        import os
        return {"rank": self.rank, "name": self.name, "pid": os.getpid(), "events": self.events,
                "threads": self.threads, "started_ns": self.started_ns, "stopped_ns": self.stopped_ns}
