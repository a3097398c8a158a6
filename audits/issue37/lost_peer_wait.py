"""Change 2: worker0's main thread waits on an rpc_async future (fut.wait()) while
worker1 sends it requests, then worker1 dies (os._exit) in the middle of the call.
Compares, torch vs distgrad: does fut.wait() raise (not hang), within how long, and
were the requests before the death served. Run:
PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/lost_peer_wait.py"""
from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

SERVED: list = []


def note(i):
    SERVED.append(i)
    return i


def dying_call(n, impl):
    rpc = _harness.modules(impl)[0]
    for i in range(n):
        rpc.rpc_sync("worker0", note, args=(i,), timeout=30)
        time.sleep(0.01)
    for i in range(n, n + 5):   # requests in flight at the death
        rpc.rpc_async("worker0", note, args=(i,), timeout=30)
    time.sleep(0.05)
    os._exit(3)


def scenario(rank, rpc, da, impl):
    if rank != 0:
        time.sleep(60)   # serves until dying_call kills this process
        return "rank1 survived"
    t = time.time()
    fut = rpc.rpc_async("worker1", dying_call, args=(20, impl), timeout=50)
    box = {}

    def w():
        try:
            box["v"] = fut.wait()
        except Exception as e:  # noqa: BLE001
            box["e"] = type(e).__name__
    th = threading.Thread(target=w, daemon=True)
    th.start()
    th.join(45)
    el = time.time() - t
    return {"outcome": "hung" if th.is_alive() else ("raised" if "e" in box else "returned"),
            "within_20s": el < 20, "served_first_20": sorted(SERVED)[:20] == list(range(20)),
            "elapsed": round(el, 1)}


def main():
    os.environ["AUDIT37_GRACEFUL"] = "0"
    got = {}
    for impl in ("torch", "distgrad"):
        got[impl] = _harness.run("lost_peer_wait", "scenario", impl, timeout=45)
        print(f"[{impl}]", got[impl])
    a, b = got["torch"][0][1], got["distgrad"][0][1]
    ok = True
    for k in ("outcome", "within_20s", "served_first_20"):
        same = a[k] == b[k]
        ok &= same
        print(("PASS" if same else "FAIL") + f" {k}: torch={a[k]} distgrad={b[k]}")
    print(f"elapsed: torch={a['elapsed']} s distgrad={b['elapsed']} s (not compared)")
    print("RESULT:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
