"""Audit of becf8ee + c3f4b63: a worker killed in the middle of its contexts.
worker0 opens three contexts (one per thread), each reaching worker1 by one kind of
call, then os._exit()s with all three still open:
  udf_nograd   rpc_sync(udf, plain tensor)       worker1: context, known [] (heard_from {0})
  udf_grad     rpc_sync(udf_none, grad tensor)   worker1: context with a recv function
  builtin_grad rpc_sync(torch.add, grad tensor)  worker1: recv + send (reply)
worker1 polls each context for 15 s: does it release it, how long after the death.
distgrad promises a lost sender releases the contexts it reached; torch may keep them
(pytorch issue 26379). Run:
PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/known_kill.py"""
from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
import torch  # noqa: E402

SEEN: dict = {}


def note(name, cid, impl, t=None):
    da = _harness.modules(impl)[1]
    try:
        SEEN[name] = (cid, sorted(da._retrieve_context(cid)._known_worker_ids()))
    except Exception:  # noqa: BLE001
        SEEN[name] = (cid, None)
    return None


def scenario(rank, rpc, da, impl):
    if rank == 0:
        ready = []

        def th(name, kind):
            with da.context() as cid:
                if kind == "udf_nograd":
                    rpc.rpc_sync("worker1", note, args=(name, cid, impl, torch.ones(2)))
                elif kind == "udf_grad":
                    rpc.rpc_sync("worker1", note, args=(name, cid, impl, torch.ones(2, requires_grad=True)))
                else:
                    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2, requires_grad=True), 1))
                    rpc.rpc_sync("worker1", note, args=(name, cid, impl))
                ready.append(name)
                time.sleep(60)
        for k in ("udf_nograd", "udf_grad", "builtin_grad"):
            threading.Thread(target=th, args=(k, k), daemon=True).start()
        t = time.time()
        while len(ready) < 3 and time.time() - t < 20:
            time.sleep(0.01)
        rpc.rpc_sync("worker1", note, args=("_dying", -1, impl))
        time.sleep(0.2)
        os._exit(3)
    # worker1
    t = time.time()
    while "_dying" not in SEEN and time.time() - t < 30:
        time.sleep(0.01)
    t_death = time.time()
    out = {}
    names = ("udf_nograd", "udf_grad", "builtin_grad")
    for n in names:
        cid, known = SEEN.get(n, (None, None))
        out[f"{n}.known_at_call"] = known
        # for builtin_grad the "note" UDF itself was forced: the known set is after both
    pending = {n: SEEN[n][0] for n in names if n in SEEN}
    released = {}
    while pending and time.time() - t_death < 15:
        for n, cid in list(pending.items()):
            try:
                da._retrieve_context(cid)
            except Exception:  # noqa: BLE001
                released[n] = round(time.time() - t_death, 2)
                del pending[n]
        time.sleep(0.02)
    for n in names:
        out[f"{n}.released_within_15s"] = n in released
        out[f"{n}.release_s"] = released.get(n)
    out["num_autograd_contexts_end"] = int(da._get_debug_info()["num_autograd_contexts"])
    return out


def main():
    os.environ["AUDIT37_GRACEFUL"] = "0"
    got = {}
    for impl in ("torch", "distgrad"):
        t = time.time()
        got[impl] = _harness.run("known_kill", "scenario", impl, world=2, timeout=40)
        print(f"[{impl}] ran {time.time() - t:.1f} s; rank0: {got[impl].get(0, 'died (expected)')}")
    a = got["torch"].get(1, ("?", {}))
    b = got["distgrad"].get(1, ("?", {}))
    if a[0] != "ok" or b[0] != "ok":
        print("torch rank1:", a, "\ndistgrad rank1:", b)
        print("RESULT: FAIL (a side did not finish)")
        return
    a, b = a[1], b[1]
    fails = 0
    for k in sorted(set(a) | set(b)):
        if k.endswith("release_s"):
            print(f"  {k}: torch={a.get(k)} distgrad={b.get(k)} (not compared)")
            continue
        same = a.get(k) == b.get(k)
        fails += not same
        print(("PASS" if same else "DIFF") + f" {k}: torch={a.get(k)!r}" + ("" if same else f" distgrad={b.get(k)!r}"))
    promise = all(b.get(f"{n}.released_within_15s") for n in ("udf_nograd", "udf_grad", "builtin_grad"))
    print("distgrad promise (every context the dead worker reached released):", "PASS" if promise else "FAIL")
    print("RESULT:", "PASS" if promise else "FAIL", f"({fails} differences from torch, see above)")


if __name__ == "__main__":
    main()
