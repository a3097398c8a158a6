"""What a trace file says, in numbers: each worker's time by activity, and the
critical path of the step (``distgrad trace-plot`` prints both).

Each instant of a worker's time goes to one activity, the first that applies:

1. **computing**: a backward run or region, an optimizer step;
2. **serving**: running a request another worker sent (its function, unpickling,
   the reply);
3. **network**: sending or receiving a message (pickling, the system calls), or a
   thread waiting for a reply (also ``dist_autograd.backward`` and
   ``DistributedOptimizer.step`` while they wait for other workers);
4. **computing** again: user spans and torch ops outside all of the above (the
   driver's own work);
5. **idle**: nothing recorded.

The critical path is walked back from the last busy moment of the tracing worker:
through each busy stretch of a worker, jumping at the latest message that arrived
in it to the moment its sender sent it, until the start of the trace.

Example::

    >>> s = summarize(json.load(open("trace.json")))
    >>> s.shares["worker1"]["serving"]
    0.41
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

ACTIVITIES = ("computing", "serving", "network", "idle")
_PRIORITY = {"backward": 0, "backward.region": 0, "optim": 0, "rpc.serve": 1, "rpc.send": 2,
             "rpc.recv": 2, "rpc.call": 2, "rpc.wait": 2, "backward.call": 2, "optim.call": 2,
             "user": 3, "op": 3}
_CLASS = {0: "computing", 1: "serving", 2: "network", 3: "computing"}
_BUSY = {"backward", "backward.region", "optim", "rpc.serve", "rpc.send", "rpc.recv", "rpc.call", "op"}


@dataclass
class Summary:
    """Workers (in rank order), their activity segments, shares, messages, critical path."""

    workers: list[str]
    window: tuple[float, float]                         # us
    segments: dict[str, list[tuple[float, float, str]]]  # worker -> (start, end, activity)
    shares: dict[str, dict[str, float]]
    messages: list[tuple[str, float, str, float]]        # (sender, sent, receiver, arrived)
    path: list[tuple[str, float, float, str]] = field(default_factory=list)  # worker, start, end, label
    missing: dict[str, str] = field(default_factory=dict)


def summarize(doc: dict) -> Summary:
    """The :class:`Summary` of a trace document (``json.load`` of a distgrad trace)."""
    events = doc["traceEvents"]
    names, order = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
            order[e["pid"]] = e["args"]["sort_index"]
    workers = [names[p] for p in sorted(names, key=lambda p: order.get(p, p))]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in _PRIORITY]
    if spans:
        window = (min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans))
    else:
        window = (0.0, 0.0)
    by_worker: dict[str, list[dict]] = {w: [] for w in workers}
    for e in spans:
        by_worker.setdefault(names.get(e["pid"], str(e["pid"])), []).append(e)
    segments = {w: _classify(evs, window) for w, evs in by_worker.items()}
    total = max(window[1] - window[0], 1e-9)
    shares = {}
    for w, segs in segments.items():
        acc = dict.fromkeys(ACTIVITIES, 0.0)
        for a, b, act in segs:
            acc[act] += b - a
        shares[w] = {k: v / total for k, v in acc.items()}
    messages = _messages(events, names)
    meta = doc.get("otherData", {}).get("distgrad", {})
    s = Summary(workers, window, segments, shares, messages, missing=dict(meta.get("missing", {})))
    tracer = meta.get("tracer", workers[0] if workers else None)
    s.path = critical_path(by_worker, messages, tracer, window)
    return s


def _classify(evs: list[dict], window: tuple[float, float]) -> list[tuple[float, float, str]]:
    """Cut the window into (start, end, activity) by the first activity that applies."""
    points = []
    for e in evs:
        p = _PRIORITY[e["cat"]]
        points.append((e["ts"], 0, p))
        points.append((e["ts"] + e["dur"], 1, p))
    points.sort()
    active = [0, 0, 0, 0]
    out: list[tuple[float, float, str]] = []
    last = window[0]
    for t, kind, p in points:
        if t > last:
            act = next((_CLASS[i] for i in range(4) if active[i] > 0), "idle")
            if out and out[-1][2] == act and out[-1][1] == last:
                out[-1] = (out[-1][0], t, act)
            else:
                out.append((last, t, act))
            last = t
        active[p] += 1 if kind == 0 else -1
    if window[1] > last:
        out.append((last, window[1], "idle"))
    return out


def _messages(events: list[dict], names: dict) -> list[tuple[str, float, str, float]]:
    ends: dict = {}
    for e in events:
        if e.get("ph") in ("s", "f"):
            ends.setdefault(e["id"], {})[e["ph"]] = e
    out = []
    for pair in ends.values():
        if "s" in pair and "f" in pair:
            s, f = pair["s"], pair["f"]
            out.append((names.get(s["pid"], str(s["pid"])), s["ts"], names.get(f["pid"], str(f["pid"])),
                        f["ts"]))
    return sorted(out, key=lambda m: m[3])


def _merge(evs: Iterable[dict]) -> list[list]:
    """Busy stretches: the union of busy spans, each with its longest span's name."""
    out: list[list] = []
    for e in sorted(evs, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1] = b
            if e["dur"] > out[-1][3]:
                out[-1][2], out[-1][3] = e["name"], e["dur"]
        else:
            out.append([a, b, e["name"], e["dur"]])
    return out


def critical_path(by_worker: dict[str, list[dict]], messages: list, tracer: str | None,
                  window: tuple[float, float]) -> list[tuple[str, float, float, str]]:
    """(worker, start, end, label) from the start of the step to its end; a message hop
    is ``(receiver, sent, arrived, "message sender → receiver")``."""
    busy = {w: _merge(e for e in evs if e["cat"] in _BUSY) for w, evs in by_worker.items()}
    arrivals: dict[str, list] = {}
    for m in messages:
        arrivals.setdefault(m[2], []).append(m)
    if tracer not in busy or not busy[tracer]:
        return []
    w, t = tracer, busy[tracer][-1][1]
    path: list[tuple[str, float, float, str]] = []
    for _ in range(100000):
        block = next((b for b in reversed(busy[w]) if b[0] < t), None)
        if block is None or t <= window[0]:
            break
        start, end = block[0], min(t, block[1])
        came = [m for m in arrivals.get(w, ()) if start <= m[3] <= end and m[1] < m[3] + 1e-9]
        if came:
            sender, sent, _, arrived = came[-1]
            path.append((w, arrived, end, block[2]))
            path.append((w, sent, arrived, f"message {sender} → {w}"))
            if sent >= t:  # never loop: time only goes back
                break
            w, t = sender, sent
            continue
        path.append((w, start, end, block[2]))
        t = start
    path.reverse()
    return [(w, a, b, label if label.startswith("message") else _label(by_worker[w], a, b, label))
            for w, a, b, label in path if b > a or label.startswith("message")]


def _label(evs: list[dict], a: float, b: float, default: str) -> str:
    """The name of the busy span that covers most of [a, b] (the more specific on a tie)."""
    best, key = default, None
    for e in evs:
        if e["cat"] not in _BUSY:
            continue
        overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
        if overlap > 0:
            k = (round(overlap, 3), -_PRIORITY[e["cat"]], -e["dur"])
            if key is None or k > key:
                best, key = e["name"], k
    return best


def report(s: Summary) -> str:
    """The text ``distgrad trace-plot`` prints: shares per worker, then the critical path."""
    span_ms = (s.window[1] - s.window[0]) / 1e3
    lines = [f"trace window {span_ms:.3f} ms, {len(s.workers)} workers, {len(s.messages)} messages"]
    lines.append(f"{'worker':<14}" + "".join(f"{a:>11}" for a in ACTIVITIES))
    for w in s.workers:
        sh = s.shares.get(w, {})
        lines.append(f"{w:<14}" + "".join(f"{100 * sh.get(a, 0):>10.1f}%" for a in ACTIVITIES))
    for w, why in s.missing.items():
        lines.append(f"{w:<14} missing: {why}")
    total = sum(b - a for _, a, b, _ in s.path)
    lines.append(f"critical path: {total / 1e3:.3f} ms in {len(s.path)} steps")
    on: dict[str, float] = {}
    for w, a, b, label in s.path:
        key = "network (messages)" if label.startswith("message") else w
        on[key] = on.get(key, 0.0) + (b - a)
    ranked = sorted(on.items(), key=lambda kv: -kv[1])
    lines.append("  on it: " + ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in ranked))
    for w, a, b, label in s.path:
        lines.append(f"  {(a - s.window[0]) / 1e3:9.3f} ms  +{(b - a) / 1e3:7.3f} ms  {w:<10} {label}")
    return "\n".join(lines)
