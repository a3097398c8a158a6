"""Counters, served tensors and fwdbwd flows on one real trace (third audit).
One 2-worker trace (127.0.0.1), profile_ops="shapes", in which worker0:
  - fans out 20 rpc_async calls at once, waits for all;
  - makes a call that raises on worker1; a call that times out (worker1 sleeps 1.5 s,
    timeout 0.3 s); then waits 2 s so the late reply is read inside the window;
  - sends a sparse COO tensor, a non-contiguous view (t()), a slice view of a big tensor,
    and a list of 20 tensors;
  - runs forward+backward of a small Linear locally (torch's fwdbwd links);
  - starts an rpc_async to a 2 s sleeper just before stop() (its reply after the end).
Checks: the counter events ("ph":"C") are valid (numeric args, levels >= 0), "calls in
flight" ends at 1 (only the call still out at stop) and drops to 0 between the phases,
"requests waiting" ends at 0; served spans name the tensors (sparse, views, 20 -> '+12 more');
flow ids unique, s/f pairs, fwdbwd ids disjoint from the RPC/control ones, inside the window.
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/trace_data.py"""
import json, os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load, perfetto_problems


def _boom(x):
    raise ValueError("boom")


def _nap(s, x=None):
    time.sleep(s)
    return 1


def _ident(*a):
    return len(a)


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        return None
    p = os.path.join(where, "t.json")
    distgrad.trace.start(p, profile_ops="shapes")
    marks = {}
    futs = [rpc.rpc_async("worker1", torch.add, args=(torch.ones(4), i)) for i in range(20)]
    [f.wait() for f in futs]
    marks["after_fanout"] = time.time_ns()
    try:
        rpc.rpc_sync("worker1", _boom, args=(1,))
    except Exception:  # noqa: BLE001
        pass
    try:
        rpc.rpc_sync("worker1", _nap, args=(1.5,), timeout=0.3)
    except Exception:  # noqa: BLE001
        pass
    time.sleep(2.0)
    marks["after_timeout"] = time.time_ns()
    sp = torch.sparse_coo_tensor([[0, 2], [1, 0]], [3.0, 4.0], (3, 3))
    big = torch.arange(1000.0).reshape(100, 10)
    rpc.rpc_sync("worker1", _ident, args=(sp,))
    rpc.rpc_sync("worker1", _ident, args=(big.t(),))
    rpc.rpc_sync("worker1", _ident, args=(big[5:7, 2:4],))
    rpc.rpc_sync("worker1", _ident, args=tuple(torch.ones(i + 1) for i in range(20)))
    lin = torch.nn.Linear(4, 3)
    lin(torch.randn(2, 4)).sum().backward()
    late = rpc.rpc_async("worker1", _nap, args=(2.0,))
    time.sleep(0.2)
    distgrad.trace.stop()
    late.wait()
    return p


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-data-"); os.chmod(where, 0o700)
    res = run_workers(_run, world_size=2, timeout=240, args=(where,))
    doc = strict_load(res[0])
    ev = doc["traceEvents"]
    bad = []
    probs = perfetto_problems(doc)
    if probs:
        bad.append(f"perfetto: {probs[:4]}")
    names = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    C = [e for e in ev if e.get("ph") == "C"]
    for e in C:
        if not e.get("args") or not all(isinstance(v, (int, float)) and v >= 0 for v in e["args"].values()):
            bad.append(f"counter bad args {e}")
    def series(pidname, name):
        return [(e["ts"], list(e["args"].values())[0]) for e in sorted(C, key=lambda e: e["ts"])
                if names.get(e["pid"], "").startswith(pidname) and e["name"] == name]
    fl = series("worker0", "calls in flight")
    wt = series("worker1", "requests waiting")
    # why: an X event is recorded at its END; a reply's recv span can end before the
    # send span of its call ends (the send span covers the write), so counters() sees the
    # reply first, finds no such call yet, and the call is never counted as answered
    print("calls in flight (worker0):", len(fl), "points, max", max(v for _, v in fl), "last", fl[-1][1])
    print("  levels:", [v for _, v in fl])
    print("requests waiting (worker1):", len(wt), "points, max", max(v for _, v in wt), "last", wt[-1][1])
    w0 = [e for e in ev if names.get(e["pid"], "").startswith("worker0") and e.get("ph") == "X"]
    snd = {e["args"].get("rid"): e for e in w0 if e["cat"] == "rpc.send" and e["args"].get("kind") == "call"}
    rcv = {e["args"].get("rid"): e for e in w0 if e["cat"] == "rpc.recv"}
    early = sum(1 for r, s in snd.items() if r in rcv and rcv[r]["ts"] + rcv[r]["dur"] < s["ts"] + s["dur"])
    print(f"  calls whose reply's recv span ENDS before their send span ends: {early} of {len(snd)}; "
          f"calls never answered in the window: {len(set(snd) - set(rcv))}")
    if fl[-1][1] != 1:
        bad.append(f"calls in flight ends at {fl[-1][1]}, 1 call was out at stop()")
    zeros = [v for _, v in fl].count(0)
    print("  times it is 0:", zeros)
    rates = sorted({e["name"] for e in C if "MB/s" in e["name"]})
    print("rate tracks:", rates)
    serve = [e for e in ev if e.get("cat") == "rpc.serve" and e.get("args", {}).get("tensors")]
    tens = sorted({"; ".join(t) if isinstance(t := e["args"]["tensors"], list) else str(t) for e in serve}, key=len)
    print("served tensors named:", len(serve), "spans; distinct:")
    for t in tens:
        print("   ", t[:150])
    if not any("sparse" in t.lower() or "coo" in t.lower() for t in tens):
        bad.append("(minor) the sparse COO tensor is named float32[3, 3], like a dense one")
    if not any("+12 more" in t for t in tens):
        bad.append("20 tensors not cut at 8 with '+12 more'")
    if not any("[10, 100]" in t for t in tens):
        bad.append("the t() view not named float32[10, 100]")
    flows = {}
    for e in ev:
        if e.get("ph") in ("s", "f"):
            flows.setdefault(e["id"], []).append(e)
    fwdbwd = {i for i, es in flows.items() if es[0]["cat"] == "fwdbwd"}
    other = set(flows) - fwdbwd
    pairs_bad = [i for i, es in flows.items() if sorted(x["ph"] for x in es) != ["f", "s"]]
    print(f"flows: {len(flows)} ids, fwdbwd {len(fwdbwd)}, other {len(other)}, not pairs {len(pairs_bad)}")
    if not fwdbwd:
        bad.append("no fwdbwd flows")
    if pairs_bad:
        bad.append(f"flow ids not s/f pairs: {pairs_bad[:4]}")
    if fwdbwd & other:
        bad.append("fwdbwd ids collide")
    xs = [e for e in ev if e.get("ph") == "X"]
    lo, hi = min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs)
    out_win = [i for i in fwdbwd if any(not lo <= x["ts"] <= hi for x in flows[i])]
    if out_win:
        bad.append(f"fwdbwd flows outside the events' span: {len(out_win)}")
    shapes = [e for e in ev if e.get("cat") in ("op", "cpu_op") and "input_dims" in e.get("args", {})]
    print("ops with Input Dims:", len(shapes))
    if not shapes:
        bad.append("profile_ops='shapes' gave no Input Dims")
    for b in bad:
        print("FAIL:", b)
    print("PASS" if not bad else "FAIL")
