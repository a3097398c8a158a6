"""One worker's recording while a trace is open (:class:`Recorder`).

Tracing off costs the message path nothing: no flag is checked per message. While
a trace is open, the recorder puts pass-through wrappers on the running agent's
instance (``send_request``, ``notify``, ``send_control``, ``on_message``,
``_serve``, ``wait``, ``read_reply``, ``on_peer_lost``, the control handlers) and on
its transport's ``send``; :meth:`Recorder.uninstall` takes them off, and the
classes' own methods run again. The distributed backward, the optimizer, RRef forks
and user spans check :data:`distgrad.observe.ACTIVE` (the slot the session puts the
open trace's recorder in) where they start a span: once per backward run, optimizer
step or fork, never per message.

Storage is flat and bounded: every event is :data:`WIDTH` atomic values (ints,
strings, None) appended to one ``deque`` whose ``maxlen`` keeps the last
``max_events`` events (the older ones are dropped and counted). ``deque.extend``
of a tuple runs no Python code, so a record is never interleaved with another
thread's. A message's event
allocates no container that outlives the call, so an open trace triggers no
garbage collections of its own; names and details are made only when the trace
closes (:mod:`.records`). While the trace is open, every collection is recorded (a
``gc pause`` instant on the thread it stopped), so a pause is never read as the
network.

Flows: a request ``rid`` sent by rank ``r`` has flow id :func:`flow_id`\\ ``(r, rid,
0)`` on both sides; its reply ``flow_id(r, rid, 1)``. The ``s`` end is stamped just
before the bytes leave, the ``f`` end when the reading thread starts on it.

Example (what :func:`distgrad.trace` does on each worker)::

    >>> rec = Recorder(current_agent(), session=(0, 1))
    >>> rec.install(); ...; rec.uninstall()
    >>> rec.payload()["events"][0][:3]
    ('X', 'rpc_sync add → worker1', 'rpc.call')
"""
from __future__ import annotations

import collections
import gc
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import observe
from ..wire import Kind
from ..wire.fast_header import FAST, FAST_MAGIC
from ..wire.messages import peek_header
from ..wire.pickler import _SPARSE_COO
from . import clock, records
from .clock import local_ns
from .records import CALL, GC, INSTANT, RECV, SEND, SERVE, SPAN, WAIT, flow_id, plain, short


def _stream_name(stream: Any) -> str:
    """A stream as a trace names it: its device, and its id (0 is the default stream)."""
    sid = getattr(stream, "stream_id", None)
    return f"{getattr(stream, 'device', '?')} stream {sid}" if sid is not None else str(stream)


__all__ = ["Recorder", "flow_id", "short", "DEFAULT_MAX_EVENTS"]

#: events kept per worker unless ``distgrad.trace.start(max_events=...)`` says otherwise
#: (about 200-260 bytes each: at most ~130 MB per worker)
DEFAULT_MAX_EVENTS = 500_000

# the tracing session's own RPCs (start, stop, pings) are never recorded
_OWN = "distgrad.trace."
_WRAPPED = ("send_request", "notify", "send_control", "on_message", "_serve", "wait", "read_reply",
            "on_peer_lost")


_CONTROL = int(Kind.CONTROL)


class _Local(threading.local):
    """What a thread is doing, as the wrappers tell each other (defaults: nothing)."""

    skip = False            # the session's own RPC: not recorded
    what: str | None = None  # the function of the request being sent
    control: str | None = None  # the control message being handled


def _head(frames: Any) -> tuple[int, int]:
    """(kind, request id) of a message, for its record only (the agent checks it)."""
    env = frames[0]
    if type(env) is bytes or type(env) is bytearray:
        if env[:2] == FAST_MAGIC and len(env) >= FAST.size:
            h = FAST.unpack_from(env)
            return h[2], h[4]
    kind, rid, _ = peek_header(frames)
    return kind, rid


def _nbytes(frames: Any) -> int:
    n = 0
    for f in frames:
        n += f.nbytes if type(f) is memoryview else len(f)
    return n


MAX_TENSORS = 8   # the tensors of a served request named in its span (the rest counted)


def _tensor(spec: Any) -> str:
    """``"float32[8, 4]"``, or ``"sparse_coo float32[3, 3]"`` for a sparse COO tensor
    (its wire spec's ``kind`` says so: dtype and shape are the same for both)."""
    name = f"{str(spec[0]).removeprefix('torch.')}{list(spec[1])}"
    return f"sparse_coo {name}" if len(spec) > 3 and spec[3] & _SPARSE_COO else name


def _tensors(specs: Any) -> str | None:
    """``"float32[8, 4]; sparse_coo float32[3, 3]"``: the layout (sparse only), dtype and
    shape of each tensor a request carried (its wire specs: nothing is looked at that
    was not already decoded). One string, not a container: a record holds no object
    the garbage collector tracks."""
    if not specs:
        return None
    try:
        out = "; ".join([_tensor(s) for s in specs[:MAX_TENSORS]])
    except Exception:  # noqa: BLE001 - a spec this does not know: the span goes without
        return None
    return f"{out}; +{len(specs) - MAX_TENSORS} more" if len(specs) > MAX_TENSORS else out


def _value(counter: Any) -> int:
    """The next value of an ``itertools.count`` without taking it."""
    return counter.__reduce__()[1][0]


class Recorder:
    """The events one worker records for one trace (see the module's docstring)."""

    def __init__(self, agent: Any, session: tuple, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.agent, self.session = agent, session
        self.rank, self.name = agent.rank, agent.name
        self.max_events = max(1, int(max_events))
        self._buf: collections.deque = collections.deque(maxlen=self.max_events * records.WIDTH)
        self._add = self._buf.extend
        self._count = itertools.count()      # events recorded (kept or dropped)
        self._tick = self._count.__next__
        self.started_ns = local_ns()
        self.stopped_ns = 0
        # the clock: perf_counter_ns itself unless a test shifted this process's
        self._now = local_ns if clock._SKEW[0] else time.perf_counter_ns
        self.stopped_why: str | None = None  # set when recording stopped without the tracer
        self.on_tracer_lost: Callable[[], None] | None = None
        self._tls = _Local()
        self._saved: dict[str, Any] = {}
        self._served_in = itertools.count()  # requests whose serving began / ended:
        self._served_out = itertools.count()  # settle() waits for the two to agree
        self._handlers: dict[str, tuple[Callable, Callable]] = {}
        self._gc_t0 = 0
        # native id -> name of each thread that made a span or a call (one entry per
        # thread, set at its first): a thread that exits before the close keeps its name
        self.thread_names: dict[int, str] = {}

    # -- recording ------------------------------------------------------------
    def span(self, name: str, cat: str, start_ns: int, args: dict | None = None) -> None:
        """A span of this thread from ``start_ns`` to now (``args``: its details, any values)."""
        tid = threading.get_native_id()
        if tid not in self.thread_names:
            self.thread_names[tid] = threading.current_thread().name
        self._tick()
        self._add((SPAN, tid, start_ns, self._now(), name, cat, 0, 0, plain(args) if args else None))

    def instant(self, name: str, cat: str, args: dict | None = None) -> None:
        """An instant of this thread, now."""
        now = self._now()
        tid = threading.get_native_id()
        if tid not in self.thread_names:
            self.thread_names[tid] = threading.current_thread().name
        self._tick()
        self._add((INSTANT, tid, now, now, name, cat, 0, 0, plain(args) if args else None))

    @property
    def recorded(self) -> int:
        """Events recorded so far (kept and dropped)."""
        return _value(self._count)

    # -- the wrappers ------------------------------------------------------------
    def install(self) -> None:
        """Put the wrappers on the agent (and its transport): recording starts."""
        agent, transport = self.agent, self.agent.transport
        for attr in _WRAPPED:
            self._saved[attr] = getattr(agent, attr)
            setattr(agent, attr, getattr(self, "_" + attr.lstrip("_")))
        self._saved["transport.send"] = transport.__dict__.get("send")
        self._send = transport.send
        transport.send = self._transport_send
        self._saved["transport.send_soon"] = transport.__dict__.get("send_soon")
        self._send_soon = transport.send_soon
        transport.send_soon = self._transport_send_soon
        for op, fn in list(agent.control_handlers.items()):
            wrapped = self._control(op, fn)
            self._handlers[op] = (fn, wrapped)
            agent.control_handlers[op] = wrapped
        gc.callbacks.append(self._on_gc)
        from ..wire import devices as _devices
        _devices.ON_STAGE = self._on_stage

    def _on_stage(self, direction: str, device: Any, stream: Any, nbytes: int, t0: int, t1: int) -> None:
        """A device tensor's copy through host memory (wire/devices.py): a span naming the
        device, the stream and the bytes, on the thread that made it."""
        tid = threading.get_native_id()
        if tid not in self.thread_names:
            self.thread_names[tid] = threading.current_thread().name
        skew = clock._SKEW[0]
        self._tick()
        name = "stage to host" if direction == "to_host" else "place on device"
        self._add((SPAN, tid, t0 + skew, t1 + skew, name, "device", 0, 0,
                   plain({"device": str(device), "stream": _stream_name(stream), "bytes": nbytes})))

    def uninstall(self) -> None:
        """Take the wrappers off: the agent's own methods run again."""
        agent, transport = self.agent, self.agent.transport
        for attr in _WRAPPED:
            agent.__dict__.pop(attr, None)
        for name in ("send", "send_soon"):
            if self._saved.get("transport." + name) is not None:
                setattr(transport, name, self._saved["transport." + name])
            else:
                transport.__dict__.pop(name, None)
        for op, (fn, wrapped) in self._handlers.items():
            if agent.control_handlers.get(op) is wrapped:
                agent.control_handlers[op] = fn
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        from ..wire import devices as _devices
        if _devices.ON_STAGE == self._on_stage:
            _devices.ON_STAGE = None
        self.stopped_ns = self._now()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = self._now()
        elif self._gc_t0:
            self._tick()
            self._add((GC, threading.get_native_id(), self._gc_t0, self._now(), None, 0, 0,
                       info.get("generation", -1), info.get("collected", 0)))
            self._gc_t0 = 0

    def _send_request(self, dest: Any, kind: Kind, payload_obj: Any, what: str, timeout: float,
                      sync: bool = False, extra: Any = None) -> Any:
        orig, tls = self._saved["send_request"], self._tls
        if what.startswith(_OWN):
            tls.skip = True
            try:
                return orig(dest, kind, payload_obj, what, timeout, sync, extra)
            finally:
                tls.skip = False
        t0 = self._now()
        tls.what = what
        try:
            return orig(dest, kind, payload_obj, what, timeout, sync, extra)
        finally:
            tls.what = None
            tid = threading.get_native_id()
            if tid not in self.thread_names:
                self.thread_names[tid] = threading.current_thread().name
            self._tick()
            self._add((CALL, tid, t0, self._now(), what, dest.id, 0,
                       2 if kind == Kind.REMOTE else 1 if sync else 0, None))

    def _notify(self, to: Any, func: Callable, args: tuple = (), kwargs: dict | None = None,
                reverse: bool = False) -> bool:
        from ..rpc.agent import _qualname
        self._tls.what = _qualname(func)
        try:
            return self._saved["notify"](to, func, args, kwargs, reverse)
        finally:
            self._tls.what = None

    def _send_control(self, dest: int, op: str, *args: Any, **kwargs: Any) -> None:
        self._tls.what = f"control {op}"
        try:
            self._saved["send_control"](dest, op, *args, **kwargs)
        finally:
            self._tls.what = None

    def _transport_send(self, peer: int, frames: Any) -> Any:
        return self._record_send(self._send, peer, frames, False)

    def _transport_send_soon(self, peer: int, frames: Any) -> Any:
        """A message queued to go with the next one (a context's release): recorded when
        queued, as the user's code sent it (a send_soon that sends at once goes through
        transport.send, not recorded a second time: ``quiet``)."""
        return self._record_send(self._send_soon, peer, frames, True)

    def _record_send(self, send: Callable, peer: int, frames: Any, quiet: bool) -> Any:
        """``send(peer, frames)`` recorded as a SEND span (``quiet``: sends made inside it
        are not recorded)."""
        tls = self._tls
        if tls.skip:
            return send(peer, frames)
        try:
            kind, rid = _head(frames)
        except Exception:  # noqa: BLE001 - not an agent message: not ours to record
            return send(peer, frames)
        nbytes = _nbytes(frames)
        what = tls.what
        t0 = self._now()
        tls.skip = quiet
        try:
            return send(peer, frames)
        finally:
            tls.skip = False
            self._tick()
            self._add((SEND, threading.get_native_id(), t0, self._now(), what, peer, rid, nbytes, kind))

    def _on_message(self, peer: int, frames: list) -> Any:
        t0 = self._now()
        try:
            kind, rid = _head(frames)
        except Exception:  # noqa: BLE001 - the agent reports it
            return self._saved["on_message"](peer, frames)
        tls = self._tls
        if kind == _CONTROL:
            tls.control = None
        try:
            return self._saved["on_message"](peer, frames)
        finally:
            self._tick()
            self._add((RECV, threading.get_native_id(), t0, self._now(),
                       tls.control if kind == _CONTROL else None, peer, rid, _nbytes(frames), kind))

    def _control(self, op: str, fn: Callable) -> Callable:
        def handler(peer: int, *args: Any) -> Any:
            self._tls.control = op
            return fn(peer, *args)
        return handler

    def _serve(self, peer: int, msg: Any) -> None:
        orig, tls = self._saved["_serve"], self._tls
        meta = msg.meta
        what = meta[0] if type(meta) is tuple and meta and type(meta[0]) is str else "?"
        if what.startswith(_OWN):
            tls.skip = True
            try:
                return orig(peer, msg)
            finally:
                tls.skip = False
        next(self._served_in)
        t0 = self._now()
        try:
            return orig(peer, msg)
        finally:
            self._tick()
            self._add((SERVE, threading.get_native_id(), t0, self._now(), what, peer, msg.rid,
                       int(msg.kind), _tensors(msg.specs)))
            next(self._served_out)

    def _wait(self, p: Any) -> Any:
        t0 = self._now()
        try:
            return self._saved["wait"](p)
        finally:
            self._tick()
            self._add((WAIT, threading.get_native_id(), t0, self._now(), p.what, p.peer, 0, 0, None))

    def _read_reply(self, p: Any) -> None:
        t0 = self._now()
        try:
            return self._saved["read_reply"](p)
        finally:
            self._tick()
            self._add((WAIT, threading.get_native_id(), t0, self._now(), p.what, p.peer, 0, 0, None))

    def _on_peer_lost(self, peer: int, reason: str, graceful: bool) -> None:
        try:
            self._saved["on_peer_lost"](peer, reason, graceful)
        finally:
            if peer == self.session[0] and peer != self.rank and self.on_tracer_lost is not None:
                self.stopped_why = f"the tracing worker (rank {peer}) was lost: {reason}"
                try:
                    self.on_tracer_lost()
                except Exception:  # noqa: BLE001 - shutting down: stop here, now
                    self._stop_here()

    def _stop_here(self) -> None:
        if observe.ACTIVE is self:
            observe.ACTIVE = None
        self.uninstall()

    # -- the result ------------------------------------------------------------
    def settle(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout`` s) for the requests being served to end: a reply
        leaves before its serve span is recorded, so the caller may close the trace
        in between."""
        import time
        deadline = time.monotonic() + timeout
        while _value(self._served_in) > _value(self._served_out) and time.monotonic() < deadline:
            time.sleep(0.001)

    def payload(self) -> dict:
        """What this worker sends the tracing worker when the trace closes."""
        import os
        import socket
        kept = list(self._buf)
        recorded = self.recorded
        n_kept = len(kept) // records.WIDTH
        names = {w.id: w.name for w in list(self.agent.workers.values())}
        events, threads = records.decode(kept, self.rank, names, self.thread_names)
        return {"rank": self.rank, "name": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "events": events, "threads": threads, "started_ns": self.started_ns,
                "stopped_ns": self.stopped_ns, "recorded": recorded, "dropped": recorded - n_kept,
                "max_events": self.max_events}
