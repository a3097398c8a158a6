"""The critical path of a traced step, covering it from its start to its end.

Walked back from the tracing worker's last busy moment: inside a busy stretch of a
worker (the union of its spans that do work: computing, serving, sending,
receiving), the path jumps at the latest message that arrived in it to the moment
its sender sent it (a **network** stretch); where the worker did nothing traced, the
gap is on the path too, named by what covers it and cut where that changes:
**queueing** (between a request's arrival and the start of its serving), **waiting**
(an ``rpc.wait``, a backward or an optimizer step waiting for others), the innermost
**user span** (the user's own untraced work), or **untraced**. A thread's spans nest:
each has a parent pointer, so the span around a moment is found however many spans
came before it on its thread. So the stretches add up to the whole step, and the summary can say
where its time went (:func:`contributions`).

A served request is followed exactly, thread by thread: from its serving span (on the
thread that sent its reply) back to the arrival of that very request (matched by
sender and request id, never by overlap with another thread's work), the queueing in
between, then to its sender. Each step of the path is ``(worker, start, end, label,
category)`` with category one of :data:`CATEGORIES`. Everything is found by
bisection over sorted lists: linear in the events, whatever the trace's length.

Example::

    >>> steps = critical_path(spans, messages, "worker0", (0.0, 14226.0))
    >>> steps[0]
    ('worker0', 0.0, 31.5, 'rpc_sync _forward → worker1', 'network')
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

from .records import flow_id

CATEGORIES = ("compute", "serve", "network", "queueing", "waiting", "user span", "untraced", "gc pause")
BUSY = frozenset({"backward", "backward.region", "optim", "rpc.serve", "rpc.send", "rpc.recv", "rpc.call",
                  "op"})
_CATEGORY = {"backward": "compute", "backward.region": "compute", "optim": "compute", "op": "compute",
             "rpc.serve": "serve", "rpc.send": "network", "rpc.recv": "network", "rpc.call": "network"}
_WAITS = {"rpc.wait", "backward.call", "optim.call"}
_SCAN = 64  # spans of any thread looked at back from a point, where its thread is not known


class _Worker:
    """One worker's spans, indexed for the walk: per thread by start, each with its
    parent (the innermost span of its thread that encloses it), and the busy stretches."""

    def __init__(self, spans: Iterable[tuple]) -> None:
        self.threads: dict[int, tuple[list[float], list[tuple], list[int]]] = {}
        self.all_items = sorted(spans, key=lambda s: (s[0], -s[1]))  # (start, end, name, cat, tid, key)
        self.all_starts = [s[0] for s in self.all_items]
        busy = []
        stacks: dict[int, list[int]] = {}
        for s in self.all_items:
            starts, items, parents = self.threads.setdefault(s[4], ([], [], []))
            stack = stacks.setdefault(s[4], [])
            while stack and items[stack[-1]][1] <= s[0]:  # spans of one thread nest
                stack.pop()
            parents.append(stack[-1] if stack else -1)
            stack.append(len(items))
            starts.append(s[0])
            items.append(s)
            if s[3] in BUSY:
                busy.append(s)
        self.stretches: list[list[float]] = []
        for s in busy:
            if self.stretches and s[0] <= self.stretches[-1][1]:
                self.stretches[-1][1] = max(self.stretches[-1][1], s[1])
            else:
                self.stretches.append([s[0], s[1]])
        self.starts = [s[0] for s in self.stretches]
        self.serve_starts = sorted(s[0] for s in busy if s[3] == "rpc.serve")
        self._ups: dict[tuple[int, frozenset], list[int]] = {}

    def _up(self, tid: int, cats: frozenset) -> list[int]:
        """For each span of thread ``tid``, its nearest enclosing span of ``cats`` (-1:
        none): the chain :meth:`covering` climbs, without the spans of other kinds."""
        key = (tid, cats)
        up = self._ups.get(key)
        if up is None:
            _, items, parents = self.threads[tid]
            up = []
            for p in parents:
                up.append(-1 if p < 0 else p if items[p][3] in cats else up[p])
            self._ups[key] = up
        return up

    def stretch_before(self, t: float) -> list[float] | None:
        """The latest busy stretch that starts before ``t``."""
        i = bisect_left(self.starts, t) - 1
        return self.stretches[i] if i >= 0 else None

    def at(self, x: float, cats: set | None, tid: int | None = None, only: bool = False) -> tuple | None:
        """The innermost span (of ``cats``) that contains ``x``: on thread ``tid`` (only
        there with ``only``; found through the parents, however many spans came before),
        else among the worker's spans that started last before it (a bounded look back)."""
        if tid in self.threads:
            found = _inner(*self.threads[tid], x, cats)
            if found is not None or only:
                return found
        elif only:
            return None
        return _scan(self.all_starts, self.all_items, x, cats, 4 * _SCAN)

    def covering(self, tid: int, a: float, b: float, cats: set) -> list[tuple]:
        """The spans of thread ``tid`` (of ``cats``) that overlap ``[a, b]``: those around
        ``a`` (its enclosing chain) and those that start inside."""
        starts, items, parents = self.threads[tid]
        up = self._up(tid, cats if isinstance(cats, frozenset) else frozenset(cats))
        i = bisect_right(starts, a) - 1
        out = []
        j = i if i < 0 or items[i][3] in cats else up[i]
        while j >= 0:   # the enclosing chain, its spans of ``cats`` only
            if items[j][1] > a:
                out.append(items[j])
                if items[j][1] >= b:   # covers the rest: those above it are never innermost
                    break
            j = up[j]
        for k in range(i + 1, bisect_left(starts, b)):
            if items[k][3] in cats and items[k][1] > items[k][0]:
                out.append(items[k])
        return out


def _inner(starts: list[float], items: list[tuple], parents: list[int], x: float,
           cats: set | None) -> tuple | None:
    """The innermost span of one thread (of ``cats``) that contains ``x``: the last to
    start before it, or one of its enclosing spans (spans of a thread nest)."""
    j = bisect_right(starts, x) - 1
    while j >= 0:
        s = items[j]
        if s[1] >= x and (cats is None or s[3] in cats):
            return s
        j = parents[j]
    return None


def _scan(starts: list[float], items: list[tuple], x: float, cats: set | None,
          scan: int = _SCAN) -> tuple | None:
    """Going back from ``x`` by start (at most ``scan`` spans, of any thread), the first
    span that contains it."""
    i = bisect_right(starts, x) - 1
    for j in range(i, max(-1, i - scan), -1):
        s = items[j]
        if s[1] >= x and (cats is None or s[3] in cats):
            return s
    return None


def critical_path(spans: dict[str, list[tuple]], messages: list[tuple], tracer: str | None,
                  window: tuple[float, float], ranks: dict[str, int] | None = None,
                  ) -> list[tuple[str, float, float, str, str]]:
    """The path (see the module's docstring). ``spans``: worker -> ``(start, end, name, cat,
    tid, key)`` (``key``: ``(sender, rid)`` of a served or arrived request, else None);
    ``messages``: ``(sender, sent, receiver, arrived, sender_tid, receiver_tid, flow id)``;
    ``ranks``: worker -> rank (the flow ids of requests)."""
    workers = {w: _Worker(s) for w, s in spans.items()}
    arrivals: dict[str, tuple[list[float], list[tuple]]] = {}
    on_thread: dict[tuple, tuple[list[float], list[tuple]]] = {}
    for m in sorted(messages, key=lambda m: m[3]):
        for key in (m[2], (m[2], m[5])):
            times, items = (arrivals if key is m[2] else on_thread).setdefault(key, ([], []))
            times.append(m[3])
            items.append(m)
    flows = {m[6]: m for m in messages}
    ranks = ranks or {}
    if tracer not in workers or not workers[tracer].stretches:
        return []
    lo = window[0]
    w, tid = tracer, None
    t = min(workers[tracer].stretches[-1][1], window[1])
    path: list[tuple[str, float, float, str, str]] = []
    for _ in range(4 * (len(messages) + sum(len(x.stretches) for x in workers.values())) + 8):
        if t <= lo:
            break
        wk = workers[w]
        serve = wk.at(t, {"rpc.serve"}, tid, only=True) if tid is not None else None
        if serve is not None and serve[0] < t:
            hop = _from_serve(wk, w, t, tid, serve, on_thread, flows, ranks, workers, path)
            if hop is not None:
                w, t, tid = hop
                continue
        block = wk.stretch_before(t)
        if block is None:  # nothing of this worker's before: the rest of the step is a gap
            path.extend(_gap(wk, w, lo, t, tid))
            break
        if block[1] < t:  # a gap after the stretch
            path.extend(_gap(wk, w, max(block[1], lo), t, tid))
            t = block[1]
            continue
        a = max(block[0], lo)
        times, items = arrivals.get(w, ((), ()))
        i = bisect_right(times, t) - 1
        m = items[i] if i >= 0 and times[i] >= a else None
        if m is not None and m[1] < m[3] and m[1] < t and m[0] in workers:
            if t > m[3]:
                path.extend(_busy(wk, w, m[3], t, tid))
            path.append((w, m[1], m[3], f"message {m[0]} → {w}", "network"))
            w, t, tid = m[0], m[1], m[4]
            continue
        path.extend(_busy(wk, w, a, t, tid))
        t, tid = a, None
    path.reverse()
    return path


def _from_serve(wk: _Worker, w: str, t: float, tid: int, serve: tuple, on_thread: dict, flows: dict,
                ranks: dict, workers: dict, path: list) -> tuple | None:
    """Steps back through the serving span ``serve`` (thread ``tid`` of ``w``, up to ``t``):
    to a reply it waited for on its thread, or to the arrival of the request it served
    and that request's sender; returns where the walk goes on (or None: the usual way)."""
    times, items = on_thread.get((w, tid), ((), ()))
    i = bisect_right(times, t) - 1
    m = items[i] if i >= 0 and times[i] >= serve[0] else None
    if m is not None and m[1] < m[3] and m[0] in workers:
        if t > m[3]:
            path.append((w, m[3], t, serve[2], "serve"))
        path.append((w, m[1], m[3], f"message {m[0]} → {w}", "network"))
        return m[0], m[1], m[4]
    key = serve[5] if len(serve) > 5 else None
    req = flows.get(flow_id(ranks[key[0]], key[1], 0)) if key and key[0] in ranks else None
    if req is None or not req[1] < req[3] <= serve[0] or req[0] not in workers:
        return None
    path.append((w, serve[0], t, serve[2], "serve"))
    recv = wk.at(req[3], {"rpc.recv"}, req[5], only=True)
    end = recv[1] if recv is not None and recv[1] <= serve[0] else req[3]
    if serve[0] > end:
        path.append((w, end, serve[0], f"queued before {serve[2]}", "queueing"))
    if end > req[3]:
        path.append((w, req[3], end, recv[2], "network"))
    path.append((w, req[1], req[3], f"message {req[0]} → {w}", "network"))
    return req[0], req[1], req[4]


def _busy(wk: _Worker, w: str, a: float, b: float, tid: int | None) -> list[tuple]:
    """The busy stretch [a, b] of ``w`` as steps (latest first, as the walk adds them),
    cut where the innermost span of its thread changes (a send inside a backward run
    is the send, the run around it compute)."""
    s = wk.at((a + b) / 2, BUSY, tid)
    if s is None:
        return [(w, a, b, "busy", "compute")]
    spans = wk.covering(s[4], a, b, BUSY)
    return _named(w, a, b, spans, lambda x: (x[2], _CATEGORY.get(x[3], "compute")),
                  (s[2], _CATEGORY.get(s[3], "compute")))


def _named(w: str, a: float, b: float, spans: list[tuple], name_of: Callable,
           default: tuple[str, str]) -> list[tuple]:
    """[a, b] cut where the innermost of ``spans`` changes, each piece named by
    ``name_of(span)`` (``default`` where none covers it); latest first."""
    cuts = sorted({a, b, *(x[0] for x in spans if a < x[0] < b), *(x[1] for x in spans if a < x[1] < b)})
    order = sorted(spans, key=lambda x: (x[0], -x[1]))
    out: list[tuple] = []
    stack: list[tuple] = []   # the spans begun so far, the latest on top (a sweep: linear)
    k = 0
    for lo, hi in zip(cuts, cuts[1:]):
        mid = (lo + hi) / 2
        while k < len(order) and order[k][0] <= mid:
            stack.append(order[k])
            k += 1
        while stack and stack[-1][1] < mid:   # ended: never the innermost again (mid grows)
            stack.pop()
        inner = stack[-1] if stack else None
        name, cat = default if inner is None else name_of(inner)
        if out and out[-1][3] == name and out[-1][4] == cat and out[-1][2] == lo:
            out[-1] = (w, out[-1][1], hi, name, cat)
        else:
            out.append((w, lo, hi, name, cat))
    return out[::-1]


_NAMING = frozenset(_WAITS | {"user", "user.wait"})


def _gap(wk: _Worker, w: str, a: float, b: float, tid: int | None) -> list[tuple]:
    """The gap [a, b] of ``w`` (no busy span) as steps, latest first: queueing before a
    serve that starts at ``b``; else each stretch named by what covers it on its thread
    (a wait, else the innermost user span, else untraced)."""
    i = bisect_left(wk.serve_starts, b - 1e-3)
    if i < len(wk.serve_starts) and abs(wk.serve_starts[i] - b) <= 1e-3:
        return [(w, a, b, f"queued on {w} before serving", "queueing")]
    if tid not in wk.threads:  # the thread of the work that follows the gap
        nxt = wk.at(b + 1e-3, BUSY, None)
        tid = nxt[4] if nxt is not None else None
    untraced = (f"untraced on {w}", "untraced")
    if tid in wk.threads:
        spans = wk.covering(tid, a, b, _NAMING)
        waits = [x for x in spans if x[3] in _WAITS]
        users = [x for x in spans if x[3] not in _WAITS]
        if spans:
            # a wait names what it covers, whatever user span is around it
            steps = _named(w, a, b, users, lambda x: (x[2], "user span"), untraced)[::-1]
            out: list[tuple] = []
            for st in steps:
                out.extend(_named(w, st[1], st[2], waits, lambda x: (x[2], "waiting"), (st[3], st[4]))[::-1])
            return out[::-1]
    mid = (a + b) / 2
    s = wk.at(mid, _WAITS, tid)
    if s is not None:
        return [(w, a, b, s[2], "waiting")]
    s = wk.at(mid, {"user", "user.wait"}, tid)
    if s is not None:
        return [(w, a, b, s[2], "user span")]
    return [(w, a, b, *untraced)]


def split_gc(path: list[tuple], pauses: list[tuple[str, float, float]]) -> list[tuple]:
    """``path`` with the garbage collections ``(worker, start, µs)`` that fell in its
    stretches cut out as stretches of their own (category ``gc pause``): a pause is
    never read as the network or a wait."""
    by: dict[str, tuple[list[float], list[tuple[float, float]]]] = {}
    for w, at, dur in sorted(pauses, key=lambda p: p[1]):
        starts, items = by.setdefault(w, ([], []))
        starts.append(at)
        items.append((at, at + dur))
    out = []
    for step in path:
        w, a, b, label, cat = step
        starts, items = by.get(w, ((), ()))
        if label.startswith("message") or not starts:
            out.append(step)
            continue
        i = max(0, bisect_left(starts, a) - 1)
        while i < len(items) and items[i][0] < b:
            p0, p1 = max(items[i][0], a), min(items[i][1], b)
            if p1 > p0:
                if p0 > a:
                    out.append((w, a, p0, label, cat))
                out.append((w, p0, p1, f"gc pause during {label}", "gc pause"))
                a = p1
            i += 1
        if b > a:
            out.append((w, a, b, label, cat))
    return out


def contributions(path: list[tuple]) -> list[tuple[str, float]]:
    """(category, µs) of the path, the largest first."""
    acc: dict[str, float] = {}
    for step in path:
        acc[step[4]] = acc.get(step[4], 0.0) + (step[2] - step[1])
    return sorted(acc.items(), key=lambda kv: -kv[1])
