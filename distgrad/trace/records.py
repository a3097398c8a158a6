"""A recorder's flat records -> the events a trace file is made of.

The recorder (:mod:`.recorder`) keeps each event as :data:`WIDTH` atomic values
``(code, tid, start_ns, end_ns, text, peer_or_cat, rid, n, extra)`` in one bounded
deque: nothing is formatted and no container is kept per message while the trace
is open. :func:`decode` runs once, when the trace closes: it names every span
(``rpc_sync add → worker1``), joins each message with what explains it (a reply
with the call it answers, an arrival with the request it served) and returns the
raw event tuples :mod:`.export` writes::

    ("X", name, cat, tid, start_ns, end_ns, args)   spans
    ("s" | "f", flow_id, tid, ns, name)              flow ends
    ("i", name, cat, tid, ns, args)                  instants

:func:`plain` turns any value a user puts in a span's details (numpy scalars,
tensors, dtypes, NaN, objects) into something JSON reads.

Example::

    >>> decode([CALL, 7, 100, 900, "torch.add", 1, 0, 1, None], 0, {1: "worker1"})[0]
    [('X', 'rpc_sync add → worker1', 'rpc.call', 7, 100, 900, {'to': 'worker1', 'function': 'torch.add'})]
"""
from __future__ import annotations

import math
import sys
import threading
from typing import Any

from ..wire import Kind

WIDTH = 9
SPAN, INSTANT, CALL, SEND, RECV, SERVE, WAIT, GC = range(8)

_REQUESTS = (int(Kind.CALL), int(Kind.REMOTE), int(Kind.NOTIFY), int(Kind.GRADS))
_REPLIES = (int(Kind.REPLY), int(Kind.ERROR))
_VERBS = ("rpc_async", "rpc_sync", "remote")
_OWN = "distgrad.trace."
# friendlier names for distgrad's own functions in span names
_NAMES = {
    "distgrad.autograd.engine._propagate": "gradients",
    "distgrad.autograd.engine._resume": "backward resume",
    "distgrad.autograd.engine._flush": "backward DDP flush",
    "distgrad.autograd.engine._discover": "backward discovery",
}
_SMALL = 16     # tensors and arrays up to this many elements are written out whole
_TEXT = 200     # longest text kept for an object shown by its str()


def flow_id(rank: int, rid: int, reply: int) -> int:
    """The id both ends of a message's flow share (unique in a trace; < 2**53)."""
    return ((rank + 1) << 41) | (rid << 1) | reply


def short(what: str) -> str:
    """A function's name as spans show it (``torch.add`` -> ``add``)."""
    if what in _NAMES:
        return _NAMES[what]
    return what.rsplit(".", 1)[-1] or what


def plain(args: dict) -> dict:
    """``args`` with every key a string and every value one JSON can write."""
    return {_text(k): value(v) for k, v in dict(args).items()}


def value(v: Any, depth: int = 0) -> Any:
    """``v`` as JSON can write it: numbers, strings, lists, dicts (see the module's docstring).
    Never raises: a value that cannot be read (a meta tensor, a dict whose ``items``
    fails) is shown as text."""
    try:
        return _value(v, depth)
    except Exception:  # noqa: BLE001 - a span's detail must never cost the user's block
        return _text(v)


def _value(v: Any, depth: int) -> Any:
    t = type(v)
    if v is None or t is bool or t is str or t is int:
        return v
    if t is float:
        return v if math.isfinite(v) else str(v)
    if depth > 4:
        return _text(v)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(v, torch.Tensor):
            if v.numel() <= _SMALL and v.layout == torch.strided:
                return value(v.detach().cpu().tolist(), depth + 1)
            return f"tensor(shape={list(v.shape)}, dtype={v.dtype}, device={v.device})"
        if isinstance(v, torch.Size):
            return list(v)
        if isinstance(v, (torch.dtype, torch.device)):
            return str(v)
    if t.__module__ == "numpy":
        if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
            if v.size <= _SMALL:
                return value(v.tolist(), depth + 1)
            return f"array(shape={list(v.shape)}, dtype={v.dtype})"
        if hasattr(v, "item"):
            try:
                return value(v.item(), depth + 1)
            except Exception:  # noqa: BLE001 - shown as text below
                pass
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return value(float(v))
    if isinstance(v, str):
        return str(v)
    if isinstance(v, dict):
        return {_text(k): value(x, depth + 1) for k, x in list(v.items())[:_TEXT]}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [value(x, depth + 1) for x in list(v)[:_TEXT]]
    return _text(v)


def _text(v: Any) -> str:
    try:
        s = str(v)
    except Exception:  # noqa: BLE001 - an object whose str() fails
        s = f"<{type(v).__name__}>"
    return s if len(s) <= _TEXT else s[:_TEXT - 1] + "…"


def _kind(kind: int) -> str:
    try:
        return Kind(kind).name.lower()
    except ValueError:
        return f"kind {kind}"


def decode(flat: list, rank: int, names: dict[int, str],
           thread_names: dict[int, str] | None = None) -> tuple[list[tuple], dict[int, str]]:
    """(events, thread names) of the records ``flat`` made on worker ``rank``;
    ``names``: rank -> worker name; ``thread_names``: native id -> the name a thread
    had while recording (kept for threads that exited before the close)."""
    recs = [flat[i:i + WIDTH] for i in range(0, len(flat) - WIDTH + 1, WIDTH)]
    served: dict[tuple[int, int], str] = {}
    called: dict[int, str] = {}
    for r in recs:
        if r[0] == SERVE:
            served[(r[5], r[6])] = r[4]
        elif r[0] == SEND and r[8] in _REQUESTS:
            called[r[6]] = r[4] or "?"

    def who(peer: int) -> str:
        return names.get(peer, f"rank {peer}")

    out: list[tuple] = []
    for code, tid, t0, t1, text, peer, rid, n, extra in recs:
        if code == SPAN:
            out.append(("X", text, peer, tid, t0, t1, extra or {}))
        elif code == INSTANT:
            out.append(("i", text, peer, tid, t0, extra or {}))
        elif code == GC:
            out.append(("i", f"gc pause (gen {n})", "gc", tid, t0,
                        {"generation": n, "pause_us": round((t1 - t0) / 1e3, 1), "collected": extra}))
        elif code == CALL:
            to = who(peer)
            out.append(("X", f"{_VERBS[n]} {short(text)} → {to}", "rpc.call", tid, t0, t1,
                        {"to": to, "function": text}))
        elif code == WAIT:
            if not text.startswith(_OWN):
                frm = who(peer)
                out.append(("X", f"wait {short(text)} ← {frm}", "rpc.wait", tid, t0, t1,
                            {"from": frm, "function": text}))
        elif code == SERVE:
            frm = who(peer)
            args = {"from": frm, "function": text, "rid": rid}
            if extra:   # the request's tensors: dtype[shape], in order
                args["tensors"] = extra.split("; ")
            out.append(("X", f"serve {short(text)} ← {frm}", "rpc.serve", tid, t0, t1, args))
        elif code == SEND:
            out.extend(_send(rank, tid, t0, t1, text, who(peer), peer, rid, n, extra, served))
        elif code == RECV:
            out.extend(_recv(rank, tid, t0, t1, text, who(peer), peer, rid, n, extra, served, called))
    return out, _thread_names({r[1] for r in recs}, thread_names or {})


def _send(rank, tid, t0, t1, what, to, peer, rid, nbytes, kind, served) -> list[tuple]:
    args = {"to": to, "bytes": nbytes, "kind": _kind(kind), "rid": rid}
    if kind in _REQUESTS:
        what = what or "?"
        args["function"] = what
        return [("X", f"send {short(what)} → {to}", "rpc.send", tid, t0, t1, args),
                ("s", flow_id(rank, rid, 0), tid, t0, "request")]
    if kind in _REPLIES:
        what = served.get((peer, rid))
        if what is None:  # the reply to a request served before the trace (or the trace's own)
            return []
        args["function"] = what
        word = "error" if kind == Kind.ERROR else "reply"
        return [("X", f"send {word} {short(what)} → {to}", "rpc.send", tid, t0, t1, args),
                ("s", flow_id(peer, rid, 1), tid, t0, "reply")]
    if what:
        args["function"] = what
    return [("X", f"send {what or 'control'} → {to}", "rpc.send", tid, t0, t1, args)]


def _recv(rank, tid, t0, t1, op, frm, peer, rid, nbytes, kind, served, called) -> list[tuple]:
    if kind in _REPLIES:
        what = called.get(rid)
        if what is None:  # the reply to a call made before the trace (or the trace's own)
            return []
        word = "error" if kind == Kind.ERROR else "reply"
        return [("X", f"recv {word} {short(what)} ← {frm}", "rpc.recv", tid, t0, t1,
                 {"from": frm, "bytes": nbytes, "function": what, "kind": word, "rid": rid}),
                ("f", flow_id(rank, rid, 1), tid, t0, "reply")]
    if kind in _REQUESTS:
        what = served.get((peer, rid))
        if what is None:  # not served while the trace was open (or the trace's own)
            return []
        return [("X", f"recv {short(what)} ← {frm}", "rpc.recv", tid, t0, t1,
                 {"from": frm, "bytes": nbytes, "function": what, "kind": _kind(kind), "rid": rid}),
                ("f", flow_id(peer, rid, 0), tid, t0, "request")]
    return [("X", f"recv control {op or '?'} ← {frm}", "rpc.recv", tid, t0, t1,
             {"from": frm, "bytes": nbytes, "kind": "control"})]


def _thread_names(tids: set, seen: dict[int, str]) -> dict[int, str]:
    """Each thread's name: now (alive), else as seen while recording, else its id."""
    alive = {t.native_id: t.name for t in threading.enumerate()}
    return {tid: alive.get(tid) or seen.get(tid) or f"thread {tid}" for tid in tids}
