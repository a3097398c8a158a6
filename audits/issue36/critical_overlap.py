"""Critical-path naming and speed on crafted traces the new parent-pointer code must handle.

Tries (each through distgrad.trace.summary.summarize, as trace-plot does):
 1. naming: a wait inside a span inside another span; nested user spans with calls
    between; a CPU-bound span after a wait; two threads whose spans overlap in time.
 2. speed (must stay linear, "15,000 calls in seconds"):
    a. 15,000 calls at the bottom of 2,000 nested user spans (a deep recursion): each gap
       walks the whole parent chain in critical.py _Worker.covering (O(calls x depth));
    b. 15,000 user spans on ONE thread that overlap partially (a staircase), as
       asyncio coroutines sharing a thread produce with `with trace.span(...)` around
       awaits, a call between each: the parent stack never pops, so every span's chain is
       every span before it, and covering() walks it per gap (quadratic);
    c. 15,000 short user spans each with a call inside, nested in one outer span.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/critical_overlap.py
Prints PASS/FAIL per case and a summary line."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distgrad.trace.summary import summarize
from distgrad.trace.critical import contributions  # noqa: F401 (exists)


def meta(pid, name):
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}]


def X(pid, tid, ts, dur, name, cat, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "cat": cat, "args": args}


def doc(ev, t1):
    return {"traceEvents": ev, "otherData": {"distgrad": {"tracer": "w0", "window_us": [0, t1],
                                                          "workers": {"w0": {"rank": 0}}}}}


def path_of(s):
    return [(round(p[2] - p[1], 3), p[3], p[4]) for p in s.critical] if hasattr(s, "critical") else None


def steps(s):
    for k in ("critical", "path", "critical_path"):
        if hasattr(s, k):
            return getattr(s, k)
    raise SystemExit(f"Summary has no critical path attribute: {dir(s)}")


res = []


def check(name, cond, detail):
    res.append(("PASS" if cond else "FAIL") + f" {name}: {detail}")
    print(res[-1], flush=True)


# 1a: outer 0..1000, inner 100..900, wait 300..500 inside inner, call at 990..1000
ev = meta(1, "w0") + [X(1, 7, 0, 1000, "outer", "user"), X(1, 7, 100, 800, "inner", "user"),
                      X(1, 7, 300, 200, "wait f ← w1", "rpc.wait"), X(1, 7, 990, 10, "rpc_sync g → w0", "rpc.call")]
s = summarize(doc(ev, 1000))
named = {}
for st in steps(s):
    named[st[3]] = named.get(st[3], 0) + (st[2] - st[1])
want = {"outer": 100 + 90, "inner": 200 + 400, "wait f ← w1": 200}
ok = all(abs(named.get(k, 0) - v) < 1 for k, v in want.items())
check("wait inside a span inside a span", ok, {k: round(v, 1) for k, v in named.items()})

# 1b: two threads of w0 overlap: thread 7 "A" 0..1000 (sleeps), thread 8 "B" 200..600 then
# thread 8 makes the last call at 990..1000; the gap before the call is thread 8's own
ev = meta(1, "w0") + [X(1, 7, 0, 1000, "A on t7", "user"), X(1, 8, 200, 400, "B on t8", "user"),
                      X(1, 8, 990, 10, "rpc_sync g → w0", "rpc.call")]
s = summarize(doc(ev, 1000))
named = {}
for st in steps(s):
    named[st[3]] = named.get(st[3], 0) + (st[2] - st[1])
ok = abs(named.get("B on t8", 0) - 400) < 1 and named.get("A on t7", 0) == 0
check("two overlapping threads: the gap named on the calling thread", ok,
      {k: round(v, 1) for k, v in named.items()})

# 1c: a span whose first half waits and second half computes untraced
ev = meta(1, "w0") + [X(1, 7, 0, 1000, "step", "user"), X(1, 7, 0, 500, "wait f ← w1", "rpc.wait"),
                      X(1, 7, 1000, 10, "rpc_sync g → w0", "rpc.call")]
s = summarize(doc(ev, 1010))
named = {}
for st in steps(s):
    named[st[3]] = named.get(st[3], 0) + (st[2] - st[1])
ok = abs(named.get("step", 0) - 500) < 1 and abs(named.get("wait f ← w1", 0) - 500) < 1
check("a span half waiting, half computing", ok, {k: round(v, 1) for k, v in named.items()})

# 1d: the calling thread 7 sleeps in "step" 0..1000 (last call 990..1000) while a loader
# thread 8 makes 2,000 tiny user spans: the gap is named "step", not a loader span
ev = meta(1, "w0") + [X(1, 7, 0, 1000, "step", "user"), X(1, 7, 990, 10, "rpc_sync g → w0", "rpc.call")]
ev += [X(1, 8, 0.49 * k, 0.2, f"load {k}", "user") for k in range(2000)]
s = summarize(doc(ev, 1000))
named = {}
for st in steps(s):
    named[st[3]] = named.get(st[3], 0) + (st[2] - st[1])
check("2,000 spans of a loader thread during the caller's sleep", abs(named.get("step", 0) - 990) < 1,
      {k: round(v, 1) for k, v in named.items() if not k.startswith("load")} | {"load*": round(sum(v for k, v in named.items() if k.startswith("load")), 1)})

# 1f: a wait inside "step" while 2,000 spans start on 50 other threads
ev = meta(1, "w0") + [X(1, 7, 0, 1000, "step", "user"), X(1, 7, 100, 880, "wait f ← w1", "rpc.wait"),
                      X(1, 7, 990, 10, "rpc_sync g → w0", "rpc.call")]
ev += [X(1, 8 + k % 50, 100 + 0.4 * k, 0.2, f"load {k}", "user") for k in range(2000)]
s = summarize(doc(ev, 1000))
named = {}
for st in steps(s):
    named[st[3]] = named.get(st[3], 0) + (st[2] - st[1])
check("a wait inside a span, 2,000 spans on 50 other threads", abs(named.get("wait f ← w1", 0) - 880) < 1
      and abs(named.get("step", 0) - 110) < 1, {k: round(v, 1) for k, v in named.items() if not k.startswith("load")})


def timed(name, ev, t1, limit=10.0):
    t0 = time.perf_counter()
    s = summarize(doc(ev, t1))
    dt = time.perf_counter() - t0
    cov = sum(st[2] - st[1] for st in steps(s))
    check(name, dt < limit, f"summary {dt:.1f} s (limit {limit:.0f} s), {len(ev)} events, path {len(steps(s))} steps covering {cov:.0f} of {t1} us")


N = 15000
# 2a: 2,000 nested user spans, 15,000 calls at the bottom with gaps between
D = 2000
T = D + 10 * N + 10
ev = meta(1, "w0") + [X(1, 7, i, 2 * T - 2 * i, f"level {i}", "user") for i in range(D)]
ev += [X(1, 7, D + 10 * k, 2, "rpc_sync f → w0", "rpc.call") for k in range(N)]
timed("15,000 calls under 2,000 nested spans", ev, 2 * T)

# 2b: staircase: user span k on thread 7 from 10k to 10k+5000 (partial overlaps), a call
# between each (asyncio coroutines that enter a span and await)
ev = meta(1, "w0") + [X(1, 7, 10 * k, 5000, f"coroutine {k}", "user") for k in range(N)]
ev += [X(1, 7, 10 * k + 5, 2, "rpc_async f → w0", "rpc.call") for k in range(N)]
timed("15,000 partially overlapping spans on one thread (asyncio)", ev, 10 * N + 5000)
# the same at a third and two thirds of the size: linear means ~1x per call
for n in (N // 3, 2 * N // 3):
    ev = meta(1, "w0") + [X(1, 7, 10 * k, 5000, f"coroutine {k}", "user") for k in range(n)]
    ev += [X(1, 7, 10 * k + 5, 2, "rpc_async f → w0", "rpc.call") for k in range(n)]
    t0 = time.perf_counter(); summarize(doc(ev, 10 * n + 5000)); dt = time.perf_counter() - t0
    print(f"INFO staircase of {n}: {dt:.1f} s ({1e6 * dt / n:.0f} us per call)", flush=True)

# 2c: one outer span, 15,000 user spans each with a call
ev = meta(1, "w0") + [X(1, 7, 0, 10 * N + 10, "outer", "user")]
ev += [X(1, 7, 10 * k, 6, f"item {k}", "user") for k in range(N)]
ev += [X(1, 7, 10 * k + 2, 2, "rpc_sync f → w0", "rpc.call") for k in range(N)]
timed("15,000 spans with a call each inside one span", ev, 10 * N + 10)

print("summary:", "FAIL" if any(r.startswith("FAIL") for r in res) else "PASS")
