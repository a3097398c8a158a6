"""trace-plot on crafted large files shaped to be slow: deep nesting on one thread, one
long busy stretch that thousands of messages arrive in, a thread per span, many
workers. Each must finish in seconds (the summary, then the whole plot in process)."""
import contextlib, io, json, os, sys, tempfile, time, types
from distgrad.trace.plot import main
from distgrad.trace.summary import summarize, report
from distgrad.trace.records import flow_id


def meta_ev(pid, name):
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid - 1}}]


def X(pid, tid, ts, dur, name, cat, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "cat": cat, "args": args}


def deep(n):     # n user spans nested on one thread, a call at the bottom
    ev = meta_ev(1, "w0") + [X(1, 7, i, 2 * n - 2 * i, f"level {i}", "user") for i in range(n)]
    ev.append(X(1, 7, n, 1, "rpc_sync f → w0", "rpc.call"))
    return ev, {"tracer": "w0", "window_us": [0, 2 * n], "workers": {"w0": {"rank": 0}}}


def fan_in(n):   # w1 serves one long request while n messages from w0 arrive in it
    ev = meta_ev(1, "w0") + meta_ev(2, "w1")
    ev.append(X(2, 9, 0, 10 * n + 10, "serve big ← w0", "rpc.serve", rid=10**6, **{"from": "w0"}))
    for i in range(n):
        fid = flow_id(0, i, 0)
        ev.append(X(1, 7, 10 * i, 2, f"send x → w1", "rpc.send"))
        ev.append({"ph": "s", "id": fid, "pid": 1, "tid": 7, "ts": 10 * i + 1, "cat": "rpc.flow", "name": "request"})
        ev.append(X(2, 100 + i % 5, 10 * i + 3, 2, f"recv x ← w0", "rpc.recv", rid=i, kind="call", **{"from": "w0"}))
        ev.append({"ph": "f", "bp": "e", "id": fid, "pid": 2, "tid": 100 + i % 5, "ts": 10 * i + 4, "cat": "rpc.flow", "name": "request"})
    ev.append(X(1, 7, 10 * n + 20, 5, "rpc_sync end → w1", "rpc.call"))
    return ev, {"tracer": "w0", "window_us": [0, 10 * n + 30], "workers": {"w0": {"rank": 0}, "w1": {"rank": 1}}}


def thread_per_span(n):
    ev = meta_ev(1, "w0") + [X(1, 1000 + i, i, 3, f"serve s{i} ← w0", "rpc.serve") for i in range(n)]
    return ev, {"tracer": "w0", "window_us": [0, n + 3]}


def many_workers(k, per):
    ev, ws = [], {}
    for w in range(k):
        ev += meta_ev(w + 1, f"w{w}")
        ws[f"w{w}"] = {"rank": w}
    for i in range(per):
        for w in range(1, k):
            fid = flow_id(0, i * k + w, 0)
            t = i * 50 + w
            ev.append(X(1, 7, t, 1, f"send f → w{w}", "rpc.send"))
            ev.append({"ph": "s", "id": fid, "pid": 1, "tid": 7, "ts": t, "cat": "rpc.flow", "name": "request"})
            ev.append(X(w + 1, 8, t + 2, 1, f"recv f ← w0", "rpc.recv", rid=i * k + w, kind="call", **{"from": "w0"}))
            ev.append({"ph": "f", "bp": "e", "id": fid, "pid": w + 1, "tid": 8, "ts": t + 2, "cat": "rpc.flow", "name": "request"})
            ev.append(X(w + 1, 9, t + 4, 3, f"serve f ← w0", "rpc.serve", rid=i * k + w, **{"from": "w0"}))
    return ev, {"tracer": "w0", "window_us": [0, per * 50 + 60], "workers": ws}


d = tempfile.mkdtemp(prefix="audit-huge-"); os.chmod(d, 0o700)
bad = 0
for name, (ev, meta) in (("deep nesting 30,000", deep(30000)), ("fan-in 20,000 messages into one serve", fan_in(20000)),
                         ("a thread per span 50,000", thread_per_span(50000)), ("64 workers x 600 calls", many_workers(64, 600))):
    p = os.path.join(d, "h.json")
    with open(p, "w") as f:
        json.dump({"traceEvents": ev, "otherData": {"distgrad": meta}}, f)
    size = os.path.getsize(p) / 2**20
    t0 = time.perf_counter()
    s = summarize(json.load(open(p)))
    ts = time.perf_counter() - t0
    text = report(s)
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = main(types.SimpleNamespace(trace=p, output=p + ".png", title=None))
    tp = time.perf_counter() - t0
    ok = rc == 0 and ts < 20 and tp < 60
    bad += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name} ({size:.1f} MiB, {len(ev)} events): summary {ts:.1f} s, plot {tp:.1f} s, rc {rc}; "
          f"{[l for l in text.splitlines() if l.startswith('critical path')][0]}")
print("summary:", "PASS" if not bad else f"FAIL ({bad})")
