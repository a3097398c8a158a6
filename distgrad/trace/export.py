"""The gathered recordings -> one Chrome trace-event JSON file (Perfetto, chrome://tracing).

Layout of the file::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"distgrad": {...}}}

* a process per worker, identified by its rank (``pid`` = rank + 1: workers in
  containers may all be OS pid 1; ``process_name`` its worker name,
  ``process_sort_index`` its rank, ``process_labels`` its host and OS pid), a
  thread track per thread (``thread_name``);
* ``X`` spans (``ts``/``dur`` in microseconds from the trace's first event, on the
  tracing worker's clock), ``i`` instants;
* ``s``/``f`` flow pairs sharing an ``id`` (``f`` with ``"bp": "e"``: it binds to
  the span that encloses it, the one that read the message): request -> arrival,
  reply -> arrival; only pairs whose two ends were both recorded; with
  ``profile_ops``, torch's ``fwdbwd`` links from a forward op to its backward node;
* per worker, counter tracks (``C``, :func:`counters`): calls in flight, requests
  waiting to be served, bytes per second sent to each peer;
* per worker, a "backward passes" track with one span per pass that reached it
  (first to last run of its share there); passes that overlap in time get a track
  each ("backward passes (2)", ...);
* ``otherData.distgrad``: the tracing worker, the members, the ``missing`` ones and
  why, each clock's offset and estimated error (:mod:`.clock`), torch's profiler's
  clock error, the seconds its start took and the ops left out as outside the tracing
  worker's window where ``profile_ops``, each worker's recording window and the
  tracer's (``window_us``), the events each worker dropped past ``max_events``.

The file is written atomically (a new file beside ``path``, then renamed over it):
a close that fails leaves no truncated file.

Example::

    >>> write("trace.json", 0, payloads, offsets, session)
    >>> json.load(open("trace.json"))["traceEvents"][0]["ph"]
    'M'
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..safe_files import check_dirs, new_file
from .clock import Offset, keep_causal
from .records import value

# the synthetic tracks a worker's backward passes are drawn on (not OS thread ids): + lane
PASSES_TID = 10_000_000


def write(path: str, tracer: int, payloads: dict[int, dict], offsets: dict[int, Offset],
          session: Any) -> None:
    """Merge every worker's events onto ``tracer``'s clock and write them to ``path``."""
    doc = build(tracer, payloads, offsets, session)
    with new_file(path, binary=False) as f:   # never through a link (see safe_files)
        json.dump(doc, f, separators=(",", ":"), default=value)


def check_path(path: str) -> None:
    """Raise now (before anything is recorded) where the trace could not be written to ``path``."""
    p = os.fspath(path)
    if not p:
        raise ValueError("distgrad.trace: the trace's path is empty")
    if os.path.isdir(p):
        raise IsADirectoryError(f"distgrad.trace: cannot write the trace to {p}: it is a directory")
    where = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(where):
        raise FileNotFoundError(f"distgrad.trace: cannot write the trace to {p}: "
                                f"directory {where} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise PermissionError(f"distgrad.trace: cannot write the trace to {p}: "
                              f"directory {where} is not writable")
    check_dirs(where, f"writing the trace {p}")   # refused now, not at the close (safe_files)


def track(rank: int) -> int:
    """The trace-event ``pid`` of worker ``rank``'s process track."""
    return rank + 1


def build(tracer: int, payloads: dict[int, dict], offsets: dict[int, Offset], session: Any) -> dict:
    ends = _flow_ends(payloads)
    msgs = [(s[0], s[2], f[0], f[2]) for s, f in ends.values() if s is not None and f is not None]
    estimated = {r: offsets[r].offset_ns for r in payloads}
    causal = keep_causal(estimated, msgs, tracer)
    for r, off in causal.items():
        offsets[r].shift_ns = off - offsets[r].offset_ns
    align = {r: causal[r] for r in payloads}   # worker clock - tracer clock
    ends.update(_control_flows(payloads, align))
    payloads = _clip_ops(tracer, payloads, align)
    origin = min((_first(p) - align[r] for r, p in payloads.items() if _first(p) is not None),
                 default=0)

    def us(rank: int, ns: int) -> float:
        return round((ns - align[rank] - origin) / 1e3, 3)

    events: list[dict] = []
    for rank, p in sorted(payloads.items()):
        events.extend(_worker_events(rank, p, us))
        events.extend(_fwd_bwd_flows(rank, p, us))
    unmatched = 0
    for fid, (s, f) in ends.items():
        if s is None or f is None:
            unmatched += 1
            continue
        for (rank, tid, ns, name), ph in ((s, "s"), (f, "f")):
            ev = {"ph": ph, "id": fid, "cat": "rpc.flow", "name": name,
                  "pid": track(rank), "tid": tid, "ts": us(rank, ns)}
            if ph == "f":
                ev["bp"] = "e"
            events.append(ev)
    meta = {
        "tracer": payloads[tracer]["name"],
        "workers": {p["name"]: {"rank": r, "pid": p["pid"], "host": p.get("host", "?"), "track": track(r)}
                    for r, p in sorted(payloads.items())},
        "window_us": _window(payloads[tracer], tracer, us),
        "windows_us": {p["name"]: _window(p, r, us) for r, p in sorted(payloads.items())},
        "max_events": getattr(session, "max_events", None),
        "recorded": {p["name"]: p.get("recorded", len(p["events"])) for p in payloads.values()},
        "dropped": {p["name"]: p.get("dropped", 0) for p in payloads.values()},
        "missing": dict(session.missing),
        "clock": {payloads[r]["name"]: offsets[r].as_meta() for r in sorted(payloads)},
        "clock_method": "perf_counter_ns per worker; offsets to the tracer's clock by NTP-style pings "
                        "over RPC (least round trip; error = half of it), then moved where a message "
                        "would arrive before it was sent (causality_shift_us)",
        "origin_ns": origin,
        "profile_ops": session.profile_ops,
        "ops": {p["name"]: p["ops"] for p in payloads.values() if "ops" in p},
        "unmatched_flow_ends": unmatched,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"distgrad": meta}}


_CONTROL_FLOWS = 1 << 52   # ids of control messages' flows (request flows stay below: rank < 2047)
_FWD_BWD_FLOWS = 3 << 51   # torch's forward-to-backward links (above the control flows' few)


def _fwd_bwd_flows(rank: int, p: dict, us: Any) -> list[dict]:
    """torch's links from a forward op to the backward node it made (``profile_ops``),
    as flows (cat ``fwdbwd``) on worker ``rank``'s track, inside the tracing window."""
    lo, hi = p.get("_window_ns", (None, None))
    out = []
    for e in p["events"]:
        if e[0] != "L":
            continue
        _, i, (stid, sns), (ftid, fns) = e
        if lo is not None and (sns < lo or fns > hi):
            continue
        fid = _FWD_BWD_FLOWS | ((rank + 1) << 32) | i
        out.append({"ph": "s", "id": fid, "cat": "fwdbwd", "name": "fwdbwd", "pid": track(rank),
                    "tid": stid, "ts": us(rank, sns)})
        out.append({"ph": "f", "id": fid, "cat": "fwdbwd", "name": "fwdbwd", "pid": track(rank),
                    "tid": ftid, "ts": us(rank, fns), "bp": "e"})
    return out


def _control_flows(payloads: dict[int, dict], align: dict[int, int]) -> dict[int, list]:
    """Flows for control messages (the end-of-backward reports, RRef forks), which carry
    no request id: one connection delivers them in order, so the k-th ``op`` a worker
    received from another is the k-th it sent there, counting the sends from when the
    receiver started recording (on the tracer's clock); a pair that would arrive before
    it left is not drawn."""
    names = {p["name"]: r for r, p in payloads.items()}
    sent: dict[tuple, list] = {}
    got: dict[tuple, list] = {}
    for r, p in payloads.items():
        for e in p["events"]:
            if e[0] != "X" or e[2] not in ("rpc.send", "rpc.recv") or e[6].get("kind") != "control":
                continue
            _, name, cat, tid, start, _, args = e
            if cat == "rpc.send" and args.get("to") in names:
                op = str(args.get("function", "")).removeprefix("control ")
                sent.setdefault((r, names[args["to"]], op), []).append((start - align[r], r, tid, start))
            elif cat == "rpc.recv" and args.get("from") in names:
                op = name.removeprefix("recv control ").rsplit(" ← ", 1)[0]
                got.setdefault((names[args["from"]], r, op), []).append((start - align[r], r, tid, start))
    out: dict[int, list] = {}
    for key, recvs in sorted(got.items()):
        sends = sorted(sent.get(key, ()))
        recvs.sort()
        first = payloads[key[1]]["started_ns"] - align[key[1]]
        skip = sum(1 for s in sends if s[0] < first)  # left before the receiver recorded
        for s, f in zip(sends[skip:], recvs):
            if f[0] >= s[0]:
                out[_CONTROL_FLOWS | len(out)] = [(s[1], s[2], s[3], "control"),
                                                  (f[1], f[2], f[3], "control")]
    return out


def _clip_ops(tracer: int, payloads: dict[int, dict], align: dict[int, int]) -> dict[int, dict]:
    """torch's ops outside the tracing worker's window left out (a member's profiler starts
    before the tracer's, and its first start can take seconds), counted in its ``ops``."""
    lo, hi = payloads[tracer]["started_ns"], payloads[tracer]["stopped_ns"] or float("inf")
    out = {}
    for r, p in payloads.items():
        keep = [e for e in p["events"] if not (e[0] == "X" and e[2] == "op"
                                               and (e[5] - align[r] < lo or e[4] - align[r] > hi))]
        p = dict(p, _window_ns=(lo + align[r], hi + align[r]))   # (this worker's clock)
        if len(keep) != len(p["events"]):
            ops = dict(p.get("ops") or {}, outside_window=len(p["events"]) - len(keep))
            p = dict(p, events=keep, ops=ops)
        out[r] = p
    return out


def _window(p: dict, rank: int, us: Any) -> list[float]:
    """A worker's recording window (its start and stop) on the trace's time axis (µs)."""
    return [max(0.0, us(rank, p["started_ns"])), us(rank, p["stopped_ns"] or p["started_ns"])]


def _first(p: dict) -> int | None:
    return min((e[3] if e[0] in ("s", "f") else e[4] for e in p["events"] if e[0] != "L"),
               default=None)


def _flow_ends(payloads: dict[int, dict]) -> dict[int, list]:
    ends: dict[int, list] = {}
    for rank, p in payloads.items():
        for e in p["events"]:
            if e[0] in ("s", "f"):
                _, fid, tid, ns, name = e
                slot = ends.setdefault(fid, [None, None])
                slot[0 if e[0] == "s" else 1] = (rank, tid, ns, name)
    return ends


def _worker_events(rank: int, p: dict, us: Any) -> list[dict]:
    pid, out = track(rank), []
    out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p["name"]}})
    out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                "args": {"sort_index": rank}})
    out.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                "args": {"labels": f"rank {rank}, host {p.get('host', '?')}, pid {p['pid']}"}})
    threads = dict(p["threads"])
    passes: dict[Any, list[int]] = {}
    lane_of = _async_lanes(p["events"], threads)
    for e in p["events"]:
        if e[0] == "X":
            _, name, cat, tid, start, end, args = e
            tid = lane_of.get(id(e), tid)
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                        "ts": us(rank, start), "dur": round(max(0, end - start) / 1e3, 3), "args": args})
            if cat == "op" and tid not in threads:
                threads[tid] = (f"torch ops (tid {tid})" if tid < 20_000_000
                                else f"device stream {tid - 20_000_000}")
            if cat == "backward" and "pass" in args:
                span = passes.setdefault(args["pass"], [start, end])
                span[0], span[1] = min(span[0], start), max(span[1], end)
        elif e[0] == "i":
            _, name, cat, tid, ns, args = e
            out.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                        "ts": us(rank, ns), "args": args})
    lanes: list[int] = []  # the end of the last pass on each track
    for key, (start, end) in sorted(passes.items(), key=lambda kv: kv[1][0]):
        # concurrent passes get a track each (Perfetto cannot draw partly overlapping spans)
        lane = next((i for i, busy_until in enumerate(lanes) if busy_until <= start), len(lanes))
        if lane == len(lanes):
            lanes.append(end)
            threads[PASSES_TID + lane] = "backward passes" + (f" ({lane + 1})" if lane else "")
        lanes[lane] = end
        out.append({"ph": "X", "name": f"backward pass {key} on {p['name']}", "cat": "backward.pass",
                    "pid": pid, "tid": PASSES_TID + lane, "ts": us(rank, start),
                    "dur": round((end - start) / 1e3, 3), "args": {"pass": key}})
    for tid, name in threads.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    out.extend(counters(rank, p["events"], us))
    return out


ASYNC_TID = 30_000_000   # + n: tracks of user spans that partly overlap others of their thread


def _async_lanes(events: list, threads: dict) -> dict[int, int]:
    """Where user spans of one thread overlap partly (asyncio coroutines sharing a
    thread, each in its own ``span``), which Perfetto cannot draw on one track: each
    such span moves to a track of its own kind ("MainThread spans (2)", ...), the
    first track where it nests, as torch.profiler keeps async work off the thread's
    stack. Returns ``id(event)`` -> its new track (only the spans that move)."""
    by_tid: dict[int, list] = {}
    for e in events:
        if e[0] == "X" and e[2] == "user":
            by_tid.setdefault(e[3], []).append(e)
    moved: dict[int, int] = {}
    made = 0
    for tid, spans in by_tid.items():
        if len(spans) < 2:
            continue
        spans.sort(key=lambda e: (e[4], -e[5]))
        lanes: list[list] = [[]]   # per track, the spans open on it (a stack)
        tracks = [tid]
        for e in spans:
            start, end = e[4], e[5]
            k = 0
            while k < len(lanes):
                stack = lanes[k]
                while stack and stack[-1][5] <= start:
                    stack.pop()
                if not stack or end <= stack[-1][5]:
                    break   # it nests here
                k += 1
            if k == len(lanes):
                made += 1
                lanes.append([])
                tracks.append(ASYNC_TID + made)
                threads[tracks[k]] = f"{threads.get(tid, f'thread {tid}')} spans ({k + 1})"
            lanes[k].append(e)
            if k:
                moved[id(e)] = tracks[k]
    return moved


_CALLS = ("call", "remote")           # request kinds a reply answers
_SERVED = ("call", "remote", "notify")  # request kinds a worker serves
RATE_BUCKETS = 100                    # a worker's bytes/s counter: its events' span in this many


def counters(rank: int, events: list, us: Any) -> list[dict]:
    """Worker ``rank``'s counter tracks (``"ph": "C"``), derived from its recorded
    spans at the close, so they cost nothing while recording:

    * ``calls in flight``: its calls sent and not yet answered (a reply or error read);
    * ``requests waiting``: requests it read and has not begun to serve (queue depth);
    * ``sent → PEER (MB/s)``: bytes it sent to each peer, per slice of the recording
      (the span of its events in :data:`RATE_BUCKETS` slices, at least 100 µs each).

    Example::

        >>> [e["name"] for e in counters(0, [("X", "send f → w1", "rpc.send", 1, 0, 10,
        ...     {"to": "w1", "bytes": 64, "kind": "call", "rid": 7})], lambda r, ns: ns / 1e3)]
        ['calls in flight', 'sent → w1 (MB/s)', 'sent → w1 (MB/s)']
    """
    pid = track(rank)
    # each pair's two start times, by request id: an X event is recorded when it ENDS,
    # so a reply's recv span may come before its call's send span (which covers the
    # write): nothing here depends on the order the events were recorded in
    calls: dict[Any, list[list[int]]] = {}      # rid -> [sends' starts, replies' starts]
    queued: dict[Any, list[list[int]]] = {}     # (from, rid) -> [recvs' starts, serves' starts]
    sent: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if e[0] != "X" or not isinstance(e[6], dict):
            continue
        cat, start, args = e[2], e[4], e[6]
        kind = args.get("kind")
        if cat == "rpc.send":
            if kind in _CALLS:
                calls.setdefault(args.get("rid"), [[], []])[0].append(start)
            if isinstance(args.get("bytes"), int):
                sent.setdefault(str(args.get("to", "?")), []).append((start, args["bytes"]))
        elif cat == "rpc.recv":
            if kind in ("reply", "error"):
                calls.setdefault(args.get("rid"), [[], []])[1].append(start)
            elif kind in _SERVED:
                queued.setdefault((args.get("from"), args.get("rid")), [[], []])[0].append(start)
        elif cat == "rpc.serve":
            queued.setdefault((args.get("from"), args.get("rid")), [[], []])[1].append(start)
    flight, waiting = _deltas(calls), _deltas(queued)
    out: list[dict] = []
    for name, key, deltas in (("calls in flight", "calls", flight),
                              ("requests waiting", "requests", waiting)):
        level = 0
        for ns, d in sorted(deltas, key=lambda x: (x[0], -x[1])):
            level += d
            out.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": us(rank, ns),
                        "args": {key: level}})
    stamps = [ns for per in sent.values() for ns, _ in per]
    if stamps:
        first, last = min(stamps), max(stamps)
        width = max(100_000, (last - first) // RATE_BUCKETS + 1)   # ns
        for peer, per in sorted(sent.items()):
            buckets: dict[int, int] = {}
            for ns, n in per:
                b = (ns - first) // width
                buckets[b] = buckets.get(b, 0) + n
            name = f"sent → {peer} (MB/s)"
            for b in range(max(buckets) + 2):   # a zero after the last slice ends the curve
                rate = buckets.get(b, 0) / (width / 1e9) / 1e6
                if b and rate == 0 and not buckets.get(b - 1):
                    continue   # (idle slices: one zero is enough)
                out.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": us(rank, first + b * width),
                            "args": {"MB/s": round(rate, 3)}})
    return out


def _deltas(pairs: dict[Any, list[list[int]]]) -> list[tuple[int, int]]:
    """+1 at each opening (a call sent, a request read), -1 at the closing paired with
    it by key (its reply, the start of its serving), never before its opening; a
    closing whose opening was not recorded (it came before the trace) counts nothing."""
    out: list[tuple[int, int]] = []
    for opens, closes in pairs.values():
        opens.sort()
        closes.sort()
        out.extend((ns, 1) for ns in opens)
        out.extend((max(o, c), -1) for o, c in zip(opens, closes))
    return out
