"""What a trace file says, in numbers: each worker's time by activity, and the
critical path of the step (``distgrad trace-plot`` prints both).

The window is the tracing worker's recording window (``otherData.distgrad.window_us``;
the members start before it and stop after it); every share is of that window.
Each instant of a worker's time goes to one activity, the first that applies:

1. **computing**: a backward run or region, an optimizer step;
2. **serving**: running a request another worker sent (its function, unpickling,
   the reply);
3. **network**: sending or receiving a message (pickling, the system calls), or a
   thread waiting for a reply (also ``dist_autograd.backward`` and
   ``DistributedOptimizer.step`` while they wait for other workers);
4. **computing** again: torch ops outside all of the above, and user spans whose
   thread was mostly on the CPU (their ``cpu_us``; a span that sleeps or waits on
   something untraced is not computing);
5. **idle**: nothing recorded.

The critical path (:mod:`.critical`) covers the step from the window's start to the
tracing worker's last busy moment, each stretch named and put in a category.

Example::

    >>> s = summarize(json.load(open("trace.json")))
    >>> s.shares["worker1"]["serving"]
    0.41
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .critical import contributions, critical_path, split_gc

ACTIVITIES = ("computing", "serving", "network", "idle")
_PRIORITY = {"backward": 0, "backward.region": 0, "optim": 0, "rpc.serve": 1, "rpc.send": 2,
             "rpc.recv": 2, "rpc.call": 2, "rpc.wait": 2, "backward.call": 2, "optim.call": 2,
             "user": 3, "op": 3}
_CLASS = {0: "computing", 1: "serving", 2: "network", 3: "computing"}
_CPU_BOUND = 0.5  # a user span counts as computing when its thread was on the CPU this much of it


@dataclass
class Summary:
    """Workers (in rank order), their activity segments, shares, messages, critical path."""

    workers: list[str]
    window: tuple[float, float]                         # us
    segments: dict[str, list[tuple[float, float, str]]]  # worker -> (start, end, activity)
    shares: dict[str, dict[str, float]]
    messages: list[tuple]  # (sender, sent, receiver, arrived, sender tid, receiver tid, flow id)
    path: list[tuple] = field(default_factory=list)  # (worker, start, end, label, category)
    missing: dict[str, str] = field(default_factory=dict)
    spans: dict[str, list[tuple]] = field(default_factory=dict)  # worker -> (start, end, name, cat, tid, key)
    gc_pauses: list[tuple[str, float, float]] = field(default_factory=list)  # (worker, at, pause µs)
    threads: dict[tuple[str, int], str] = field(default_factory=dict)  # (worker, tid) -> thread name


def summarize(doc: dict) -> Summary:
    """The :class:`Summary` of a trace document (``json.load`` of a distgrad trace);
    ``ValueError`` saying what is wrong with one that is not."""
    events = _events(doc)
    names, order, tnames = {}, {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tnames[(e.get("pid"), e.get("tid"))] = str(_get(e, "args", dict).get("name", e.get("tid")))
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = str(_get(e, "args", dict).get("name", e["pid"]))
        elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
            order[e["pid"]] = _get(e, "args", dict).get("sort_index", 0)
    workers = [names[p] for p in sorted(names, key=lambda p: (_num(order.get(p, 0)), str(p)))]
    spans: dict[str, list[tuple]] = {w: [] for w in workers}
    pauses = []
    for e in events:
        ph = e.get("ph")
        if ph == "X" and e.get("cat") in _PRIORITY:
            a, d = _num(e.get("ts")), _num(e.get("dur", 0))
            w = names.get(e.get("pid"), str(e.get("pid")))
            cat = e["cat"]
            if cat == "user" and not _cpu_bound(e, d):
                cat = "user.wait"
            spans.setdefault(w, []).append((a, a + max(d, 0.0), str(e.get("name", "?")), cat,
                                            e.get("tid", 0), _key(e)))
        elif ph == "i" and e.get("cat") == "gc":
            pauses.append((names.get(e.get("pid"), "?"), _num(e.get("ts")),
                           _num(_get(e, "args", dict).get("pause_us", 0))))
    meta = doc.get("otherData", {}).get("distgrad", {}) if isinstance(doc.get("otherData"), dict) else {}
    window = _window(meta, spans)
    segments = {w: _classify(evs, window) for w, evs in spans.items()}
    total = max(window[1] - window[0], 1e-9)
    shares = {}
    for w, segs in segments.items():
        acc = dict.fromkeys(ACTIVITIES, 0.0)
        for a, b, act in segs:
            acc[act] += b - a
        shares[w] = {k: v / total for k, v in acc.items()}
    messages = _messages(events, names)
    s = Summary(workers, window, segments, shares, messages, missing=dict(meta.get("missing", {})),
                spans=spans, gc_pauses=pauses,
                threads={(names[p], t): n for (p, t), n in tnames.items() if p in names})
    tracer = meta.get("tracer", workers[0] if workers else None)
    ranks = {str(n): v.get("rank") for n, v in meta.get("workers", {}).items()
             if isinstance(v, dict) and isinstance(v.get("rank"), int)}
    s.path = split_gc(critical_path(spans, messages, tracer, window, ranks), pauses)
    return s


def _events(doc: Any) -> list[dict]:
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("not a trace: no list of traceEvents")
    other = doc.get("otherData")
    if not isinstance(other, dict) or not isinstance(other.get("distgrad"), dict):
        # a trace of another tool: drawing it would give an empty picture
        what = ("a torch.profiler trace" if "schemaVersion" in doc or "deviceProperties" in doc
                else "a trace another tool wrote")
        raise ValueError(f"{what}, not distgrad.trace's (it has no otherData.distgrad); "
                         "open it at https://ui.perfetto.dev, or record with distgrad.trace(path)")
    events = doc["traceEvents"]
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"trace event #{i} is not an object: {str(e)[:60]}")
    return events


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ValueError(f"a time that is not a number: {str(v)[:40]}")
    return float(v)


def _get(e: dict, key: str, kind: type) -> Any:
    v = e.get(key, kind())
    if not isinstance(v, kind):
        raise ValueError(f"{e.get('name', '?')}: {key} is not a {kind.__name__}")
    return v


def _key(e: dict) -> tuple | None:
    """(sender, request id) of a span that served a request or received one."""
    args = e.get("args")
    if not isinstance(args, dict) or not isinstance(args.get("rid"), int) or "from" not in args:
        return None
    if e["cat"] == "rpc.serve" or (e["cat"] == "rpc.recv" and args.get("kind") in ("call", "remote",
                                                                                    "notify")):
        return (str(args["from"]), args["rid"])
    return None


def _cpu_bound(e: dict, dur: float) -> bool:
    cpu = e.get("args", {}).get("cpu_us") if isinstance(e.get("args"), dict) else None
    return not isinstance(cpu, (int, float)) or cpu >= _CPU_BOUND * dur


def _window(meta: dict, spans: dict[str, list[tuple]]) -> tuple[float, float]:
    w = meta.get("window_us")
    if isinstance(w, list) and len(w) == 2 and all(isinstance(x, (int, float)) for x in w) and w[1] > w[0]:
        return (float(w[0]), float(w[1]))
    every = [s for evs in spans.values() for s in evs]
    if not every:
        return (0.0, 0.0)
    return (min(s[0] for s in every), max(s[1] for s in every))


def _classify(evs: list[tuple], window: tuple[float, float]) -> list[tuple[float, float, str]]:
    """Cut the window into (start, end, activity) by the first activity that applies."""
    points = []
    for a, b, _, cat, *_ in evs:
        if cat not in _PRIORITY:
            continue
        a, b = max(a, window[0]), min(b, window[1])
        if b <= a:
            continue
        p = _PRIORITY[cat]
        points.append((a, 0, p))
        points.append((b, 1, p))
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


def _messages(events: list[dict], names: dict) -> list[tuple]:
    """The RPC messages: the flows distgrad drew from a send to its arrival (cat
    ``rpc.flow``), not torch's links from a forward op to its backward node
    (``fwdbwd``, with ``profile_ops``), which are no message between workers."""
    ends: dict = {}
    for e in events:
        if e.get("ph") in ("s", "f") and e.get("cat") == "rpc.flow":
            ends.setdefault(e.get("id"), {})[e["ph"]] = e
    out = []
    for pair in ends.values():
        if "s" in pair and "f" in pair:
            s, f = pair["s"], pair["f"]
            out.append((names.get(s.get("pid"), str(s.get("pid"))), _num(s.get("ts")),
                        names.get(f.get("pid"), str(f.get("pid"))), _num(f.get("ts")),
                        s.get("tid"), f.get("tid"), s.get("id")))
    return sorted(out, key=lambda m: m[3])


def report(s: Summary) -> str:
    """The text ``distgrad trace-plot`` prints: shares per worker, then the critical path."""
    span_ms = (s.window[1] - s.window[0]) / 1e3
    lines = [f"trace window {span_ms:.3f} ms (the tracing worker's), {len(s.workers)} workers, "
             f"{len(s.messages)} messages"]
    lines.append(f"{'worker':<14}" + "".join(f"{a:>11}" for a in ACTIVITIES))
    for w in s.workers:
        sh = s.shares.get(w, {})
        lines.append(f"{w:<14}" + "".join(f"{100 * sh.get(a, 0):>10.1f}%" for a in ACTIVITIES))
    for w, why in s.missing.items():
        lines.append(f"{w:<14} missing: {why}")
    if s.gc_pauses:
        worst = max(s.gc_pauses, key=lambda p: p[2])
        lines.append(f"garbage collections: {len(s.gc_pauses)}, "
                     f"{sum(p[2] for p in s.gc_pauses) / 1e3:.3f} ms in all, longest "
                     f"{worst[2] / 1e3:.3f} ms on {worst[0]}")
    total = sum(b - a for _, a, b, _, _ in s.path)
    step = (s.path[-1][2] - s.window[0]) if s.path else 0.0
    covered = 100 * total / step if step > 0 else 0.0
    lines.append(f"critical path: {total / 1e3:.3f} ms in {len(s.path)} steps, "
                 f"{covered:.1f}% of the step ({step / 1e3:.3f} ms)")
    lines.append("  on it: " + ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in contributions(s.path)))
    top = sorted(s.path, key=lambda p: p[1] - p[2])[:5]
    lines.append("  longest: " + "; ".join(f"{label} ({w}, {(b - a) / 1e3:.3f} ms)"
                                           for w, a, b, label, _ in top))
    shown = s.path if len(s.path) <= 60 else s.path[:30] + [None] + s.path[-29:]
    for step_ in shown:
        if step_ is None:
            lines.append(f"  ... {len(s.path) - 59} steps ...")
            continue
        w, a, b, label, cat = step_
        lines.append(f"  {(a - s.window[0]) / 1e3:9.3f} ms  +{(b - a) / 1e3:7.3f} ms  {w:<10} "
                     f"{cat:<10} {label}")
    return "\n".join(lines)
