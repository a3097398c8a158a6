"""Change 2: a thread waiting on an rpc_async future while the peer sends it requests.
Same program on torch and distgrad; compares outcomes (values, served counts, whether
the wait stalled/raised, rough time). Run:
PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/waits_cases.py [case ...]"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

R: dict = {"served": [], "lock": threading.Lock()}
EV = threading.Event()


def rpcm():
    return R["rpc"]


def note(i):
    with R["lock"]:
        R["served"].append(i)
    return i


def served_reset():
    with R["lock"]:
        R["served"] = []
    EV.clear()


def block(i, limit):
    EV.wait(limit)
    return note(i)


# ---- worker1 side ----
def long_call(n, gap, impl, tail_async=False):
    rpc = _harness.modules(impl)[0]
    out = []
    for i in range(n):
        out.append(rpc.rpc_sync("worker0", note, args=(i,), timeout=30))
        if gap:
            time.sleep(gap)
    if tail_async:
        # a request sent just before the reply: often read together with it
        rpc.rpc_async("worker0", note, args=(1000 + n,), timeout=30)
    return out


def fire_blockers(k, impl, then_sleep):
    rpc = _harness.modules(impl)[0]
    for i in range(k):
        rpc.rpc_async("worker0", block, args=(i, 15.0), timeout=30)
    time.sleep(then_sleep)
    return "done"


def sleepy_with_requests(impl, n, sleep):
    rpc = _harness.modules(impl)[0]
    for i in range(n):
        rpc.rpc_async("worker0", note, args=(i,), timeout=30)
    time.sleep(sleep)
    return "late"


def pingpong(depth, impl):
    rpc = _harness.modules(impl)[0]
    if depth == 0:
        return 0
    me = rpc.get_worker_info().name
    other = "worker0" if me == "worker1" else "worker1"
    fut = rpc.rpc_async(other, pingpong, args=(depth - 1, impl), timeout=30)
    side = rpc.rpc_async(other, note, args=(depth,), timeout=30)
    return fut.wait() + 1 + 0 * side.wait()


# ---- cases on worker0 ----
def case_many_requests(rpc, impl):
    served_reset()
    t = time.time()
    fut = rpc.rpc_async("worker1", long_call, args=(40, 0.002, impl), timeout=60)
    v = fut.wait()
    return {"value_ok": v == list(range(40)), "served": sorted(R["served"]) == list(range(40)),
            "fast": time.time() - t < 20}


def case_reply_with_request(rpc, impl):
    served_reset()
    ok = 0
    for r in range(150):
        fut = rpc.rpc_async("worker1", long_call, args=(1, 0, impl, True), timeout=30)
        ok += fut.wait() == [0]
    time.sleep(0.5)
    return {"all_replies": ok == 150, "served_tail": sum(1 for s in R["served"] if s >= 1000) == 150}


def case_many_waiters(rpc, impl):
    served_reset()
    res, errs = [], []

    def one(k):
        try:
            for j in range(5):
                f = rpc.rpc_async("worker1", long_call, args=(6, 0.001, impl, True), timeout=60)
                res.append(f.wait() == list(range(6)))
        except Exception as e:  # noqa: BLE001
            errs.append(repr(e))
    ths = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    t = time.time()
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    return {"all": len(res) == 40 and all(res), "errs": errs, "hung": any(th.is_alive() for th in ths),
            "fast": time.time() - t < 60}


def case_callbacks(rpc, impl):
    served_reset()
    got = {}
    done = threading.Event()
    fut = rpc.rpc_async("worker1", long_call, args=(10, 0.002, impl), timeout=60)
    chained = fut.then(lambda f: len(f.value()))
    fut.add_done_callback(lambda f: (got.update(cb=len(f.value())), done.set()))
    v = chained.wait()
    # a then() whose callback itself waits on a future whose peer sends requests
    f2 = rpc.rpc_async("worker1", long_call, args=(3, 0, impl), timeout=60)
    c2 = f2.then(lambda f: rpc.rpc_async("worker1", long_call, args=(4, 0, impl)).wait() + f.value())
    v2 = c2.wait()
    return {"chained": v, "cb": got.get("cb") if done.wait(20) else "no callback",
            "nested_then": v2}


def case_timeout(rpc, impl):
    served_reset()
    t = time.time()
    fut = rpc.rpc_async("worker1", sleepy_with_requests, args=(impl, 20, 4.0), timeout=1.0)
    try:
        fut.wait()
        out = "returned"
    except Exception as e:  # noqa: BLE001
        out = "raised " + ("timeout" if "timeout" in str(e).lower() or "timed out" in str(e).lower()
                           else type(e).__name__)
    el = time.time() - t
    time.sleep(3.5)
    return {"outcome": out, "raised_by_3s": el < 3.0, "served": sorted(R["served"]) == list(range(20))}


def case_nested(rpc, impl):
    served_reset()
    v = rpc.rpc_async("worker1", pingpong, args=(8, impl), timeout=60).wait()
    return {"depth": v}


def case_saturated(rpc, impl):
    """worker0 has AUDIT37_THREADS=4 threads; worker1 fires k blocking requests at it
    and then replies; does main's fut.wait() return before the blockers are released?"""
    out = {}
    for k in (3, 4):
        served_reset()
        t = time.time()
        fut = rpc.rpc_async("worker1", fire_blockers, args=(k, impl, 0.5), timeout=60)
        box = {}
        th = threading.Thread(target=lambda: box.update(v=fut.wait()))
        th.start()
        th.join(6)
        out[f"k={k} returned_while_blocked"] = not th.is_alive()
        EV.set()
        th.join(30)
        out[f"k={k} value"] = box.get("v")
        time.sleep(0.5)
    return out


CASES = [n[5:] for n in list(globals()) if n.startswith("case_")]


def scenario(rank, rpc, da, impl):
    R["rpc"] = rpc
    if rank != 0:
        return None
    res = {}
    gave_back = [0]
    if impl == "distgrad":   # count the new path: a waiter's read that brought a request
        from distgrad.transport import reading
        orig = reading._has_request

        def counted(work):
            r = orig(work)
            gave_back[0] += bool(r)
            return r
        reading._has_request = counted
    for name in os.environ["AUDIT37_CASES"].split(","):
        try:
            res[name] = globals()["case_" + name](rpc, impl)
        except Exception as e:  # noqa: BLE001
            res[name] = {"raised": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"[{impl}] waiter reads that brought a request (distgrad only): {gave_back[0]}", flush=True)
    return res


def main():
    import json
    names = sys.argv[1:] or [c for c in CASES if c != "saturated"]
    os.environ["AUDIT37_CASES"] = ",".join(names)
    if names == ["saturated"]:
        os.environ["AUDIT37_THREADS"] = "4"
    fails = []
    got = {}
    for impl in ("torch", "distgrad"):
        t = time.time()
        got[impl] = _harness.run("waits_cases", "scenario", impl, timeout=300)
        print(f"[{impl}] {time.time() - t:.1f} s")
        for k, v in got[impl].items():
            if k == "timeout" or v[0] != "ok":
                print(f"[{impl}] {k}: {v}")
                fails.append(impl + " run")
    if fails:
        print("RESULT: FAIL", fails)
        return
    a, b = got["torch"][0][1], got["distgrad"][0][1]
    for case in names:
        ca, cb = a[case], b[case]
        for k in sorted(set(ca) | set(cb)):
            same = json.dumps(ca.get(k), default=str) == json.dumps(cb.get(k), default=str)
            print(("PASS" if same else "FAIL") + f" {case}.{k}: torch={ca.get(k)}"
                  + ("" if same else f" distgrad={cb.get(k)}"))
            if not same:
                fails.append(f"{case}.{k}")
    print("RESULT:", "PASS" if not fails else "FAIL " + ", ".join(fails))


if __name__ == "__main__":
    main()
