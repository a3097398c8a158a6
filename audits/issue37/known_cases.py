"""Audit of becf8ee + c3f4b63 (known workers; autograd information on a call only
when torch sends it). 3 workers; worker0 runs every case under its own
dist_autograd context, observes its own ``_known_worker_ids()`` and, from a thread
with no context (so the probe itself carries nothing), each callee's view of the
context (present? known workers? num_autograd_contexts), then exits the context and
measures how long until every worker dropped it. Same program on torch and distgrad;
every observation compared. Run (one at a time):
PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/known_cases.py [case ...]"""
from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402
import torch  # noqa: E402

IMPL = {"v": None}


# ---------------------------------------------------------------- callee functions
def obs(cid, impl):
    rpc, da = _harness.modules(impl)
    try:
        known = sorted(da._retrieve_context(cid)._known_worker_ids())
    except Exception:  # noqa: BLE001
        known = None
    return {"has": known is not None, "known": known,
            "n": int(da._get_debug_info()["num_autograd_contexts"])}


def udf_plain(t):
    return t + 1


def udf_none(t):
    return None


def udf_detach(t):
    return (t * 2).detach()


def udf_new_grad():
    w = torch.ones(2, requires_grad=True)
    return w * 3


def nested_builtin(t, impl):
    rpc = _harness.modules(impl)[0]
    return rpc.rpc_sync("worker2", torch.add, args=(t, 1))


def nested_udf(t, impl):
    rpc = _harness.modules(impl)[0]
    return rpc.rpc_sync("worker2", udf_plain, args=(t,))


def nested_remote_builtin(t, impl):
    rpc = _harness.modules(impl)[0]
    rr = rpc.remote("worker2", torch.add, args=(t, 1))
    time.sleep(0.3)
    return rr


class Obj:
    def __init__(self):
        self.w = torch.ones(2)

    def get(self, t):
        return self.w + t


# ---------------------------------------------------------------- worker0 side
def probe(rpc, impl, w, cid):
    box = {}

    def f():
        try:
            box["v"] = rpc.rpc_sync(w, obs, args=(cid, impl), timeout=20)
        except Exception as e:  # noqa: BLE001
            box["v"] = f"probe error {type(e).__name__}: {e}"
    th = threading.Thread(target=f)
    th.start()
    th.join(30)
    return box.get("v", "probe timeout")


def grads(da, cid, tensors):
    g = da.get_gradients(cid)
    return [g[t].tolist() if t in g else None for t in tensors]


def run_case(name, rpc, da, impl, body, pre=None):
    """Returns observations for one case (body(cid, state) -> dict of extra obs)."""
    out = {}
    t0 = None
    try:
        state = pre() if pre is not None else {}
        with da.context() as cid:
            extra = body(cid, state) or {}
            out.update({f"{name}.{k}": v for k, v in extra.items()})
            out[f"{name}.caller_known"] = sorted(da._retrieve_context(cid)._known_worker_ids())
            for w in ("worker1", "worker2"):
                out[f"{name}.during.{w}"] = probe(rpc, impl, w, cid)
            t0 = time.time()
    except Exception as e:  # noqa: BLE001
        out[f"{name}.error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return out, {}
    # after the with block: does every worker drop it, and how fast
    try:
        da._retrieve_context(cid)
        out[f"{name}.after.caller_has"] = True
    except Exception:  # noqa: BLE001
        out[f"{name}.after.caller_has"] = False
    times = {}
    for w in ("worker1", "worker2"):
        deadline = time.time() + 5
        while True:
            o = probe(rpc, impl, w, cid)
            if not isinstance(o, dict) or not o["has"] or time.time() > deadline:
                break
            time.sleep(0.01)
        out[f"{name}.after5s.{w}.has"] = o["has"] if isinstance(o, dict) else o
        times[w] = round(time.time() - t0, 3)
    return out, times


def scenario(rank, rpc, da, impl):
    IMPL["v"] = impl
    if rank != 0:
        time.sleep(0.5)
        return None  # callees serve until worker0 finishes (graceful shutdown)
    only = [a for a in os.environ.get("AUDIT37_CASES", "").split(",") if a]
    res, timing = {}, {}
    tg = lambda: torch.ones(2, requires_grad=True)  # noqa: E731
    t = lambda: torch.ones(2)  # noqa: E731

    def call(fn, *a, dest="worker1"):
        return rpc.rpc_sync(dest, fn, args=a)

    cases = {}

    def case(f):
        cases[f.__name__] = f
        return f

    @case
    def builtin_nograd(cid, s):
        r = call(torch.add, t(), 1)
        return {"ret": r.tolist(), "ret_rg": r.requires_grad}

    @case
    def builtin_grad(cid, s):
        x = tg()
        r = call(torch.add, x, 1)
        da.backward(cid, [r.sum()])
        return {"ret_rg": r.requires_grad, "grad": grads(da, cid, [x])}

    @case
    def builtin_grad_nograd_mode(cid, s):
        with torch.no_grad():
            r = call(torch.add, tg(), 1)
        return {"ret_rg": r.requires_grad}

    @case
    def builtin_mixed_mul(cid, s):   # one grad tensor, one not; result requires grad
        x = tg()
        r = call(torch.mul, x, torch.full((2,), 3.0))
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def builtin_param(cid, s):   # an nn.Parameter as a builtin's argument
        p = torch.nn.Parameter(torch.ones(2))
        r = call(torch.mul, p, 2)
        out = {"ret_rg": r.requires_grad}
        try:
            da.backward(cid, [r.sum()])
            out["grad"] = grads(da, cid, [p])
        except Exception as e:  # noqa: BLE001
            out["backward"] = type(e).__name__
        return out

    @case
    def builtin_kwargs_grad(cid, s):
        x = tg()
        r = rpc.rpc_sync("worker1", torch.add, args=(x,), kwargs={"other": torch.ones(2), "alpha": 2})
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def builtin_async_nograd(cid, s):
        r = rpc.rpc_async("worker1", torch.add, args=(t(), 1)).wait()
        return {"ret": r.tolist()}

    @case
    def builtin_nontensor(cid, s):   # a builtin with no tensor at all
        r = call(torch.ones, 2)
        return {"ret": r.tolist(), "ret_rg": r.requires_grad}

    @case
    def udf_nograd(cid, s):
        r = call(udf_plain, t())
        return {"ret_rg": r.requires_grad}

    @case
    def udf_grad_ret_none(cid, s):   # request with a send fn, reply with no tensor
        r = call(udf_none, tg())
        return {"ret": r}

    @case
    def udf_grad_ret_detached(cid, s):   # request with a send fn, reply with no grad tensor
        r = call(udf_detach, tg())
        return {"ret_rg": r.requires_grad}

    @case
    def udf_grad_roundtrip(cid, s):
        x = tg()
        r = call(udf_plain, x)
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def udf_reply_grad_only(cid, s):   # no grad in the request, grad in the reply
        r = call(udf_new_grad)
        da.backward(cid, [r.sum()])
        return {"ret_rg": r.requires_grad}

    @case
    def self_builtin_grad(cid, s):
        x = tg()
        r = call(torch.add, x, 1, dest="worker0")
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def self_builtin_nograd(cid, s):
        r = call(torch.add, t(), 1, dest="worker0")
        return {"ret": r.tolist()}

    @case
    def remote_builtin_nograd(cid, s):
        rr = rpc.remote("worker1", torch.add, args=(t(), 1))
        time.sleep(0.3)
        return {"confirmed": rr.confirmed_by_owner()}

    @case
    def remote_builtin_grad(cid, s):
        x = tg()
        rr = rpc.remote("worker1", torch.add, args=(x, 1))
        time.sleep(0.3)
        return {"confirmed": rr.confirmed_by_owner()}

    @case
    def remote_udf_nograd(cid, s):
        rpc.remote("worker1", udf_plain, args=(t(),))
        time.sleep(0.3)
        return {}

    @case
    def to_here_nograd(cid, s):   # rref made before the context
        return {"v": s["rr"].to_here().tolist()}

    @case
    def to_here_of_remote_builtin_grad(cid, s):   # remote builtin + to_here + backward
        x = tg()
        rr = rpc.remote("worker1", torch.add, args=(x, 1))
        v = rr.to_here()
        da.backward(cid, [v.sum()])
        return {"v_rg": v.requires_grad, "grad": grads(da, cid, [x])}

    @case
    def proxy_rpc_sync(cid, s):
        return {"v": s["obj"].rpc_sync().get(t()).tolist()}

    @case
    def proxy_rpc_sync_grad(cid, s):
        x = tg()
        v = s["obj"].rpc_sync().get(x)
        da.backward(cid, [v.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def nested_udf_builtin_nograd(cid, s):
        r = call(nested_builtin, t(), impl)
        return {"ret_rg": r.requires_grad}

    @case
    def nested_udf_builtin_grad(cid, s):
        x = tg()
        r = call(nested_builtin, x, impl)
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def nested_udf_udf_nograd(cid, s):
        r = call(nested_udf, t(), impl)
        return {"ret_rg": r.requires_grad}

    @case
    def nested_udf_remote_builtin_nograd(cid, s):
        call(nested_remote_builtin, t(), impl)
        return {}

    @case
    def anomaly_builtin_grad(cid, s):
        x = tg()
        with torch.autograd.detect_anomaly():
            r = call(torch.mul, x, 2)
            da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def anomaly_builtin_nograd(cid, s):
        with torch.autograd.detect_anomaly():
            r = call(torch.mul, t(), 2)
        return {"ret": r.tolist()}

    @case
    def profiler_builtin_nograd(cid, s):   # a builtin under the legacy autograd profiler
        with torch.autograd.profiler.profile():
            r = call(torch.add, t(), 1)
        return {"ret": r.tolist()}

    @case
    def profiler_builtin_grad(cid, s):
        x = tg()
        with torch.autograd.profiler.profile():
            r = call(torch.add, x, 1)
        da.backward(cid, [r.sum()])
        return {"grad": grads(da, cid, [x])}

    @case
    def custom_pickler_builtin_nograd(cid, s):   # rpc.api._use_rpc_pickler (a subclass of the default)
        api = __import__(rpc.__name__ + ".api", fromlist=["api"])
        base = type(api._internal_rpc_pickler)
        with api._use_rpc_pickler(type("P", (base,), {})()):
            r = call(torch.add, t(), 1)
        return {"ret": r.tolist()}

    pres = {"to_here_nograd": lambda: {"rr": rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))},
            "proxy_rpc_sync": lambda: {"obj": rpc.remote("worker1", Obj)},
            "proxy_rpc_sync_grad": lambda: {"obj": rpc.remote("worker1", Obj)}}
    for name, body in cases.items():
        if only and name not in only:
            continue
        pre = pres.get(name)
        if pre is not None:
            p = pre
            pre = lambda p=p: (lambda st: (time.sleep(0.3), st)[1])(p())  # noqa: E731
        o, tm = run_case(name, rpc, da, impl, body, pre)
        res.update(o)
        timing[name] = tm
        # drain: wait until no context is left anywhere before the next case
        for w in ("worker1", "worker2"):
            deadline = time.time() + 2
            while time.time() < deadline:
                v = rpc.rpc_sync(w, obs, args=(-1, impl))
                if v["n"] == 0:
                    break
                time.sleep(0.02)
            res[f"{name}.leftover_contexts_after_drain.{w}"] = v["n"]
    res["_timing"] = timing
    return res


def main():
    cases = sys.argv[1:]
    if cases:
        os.environ["AUDIT37_CASES"] = ",".join(cases)
    got = {}
    for impl in ("torch", "distgrad"):
        t = time.time()
        got[impl] = _harness.run("known_cases", "scenario", impl, world=3, timeout=420)
        print(f"[{impl}] ran in {time.time() - t:.1f} s", flush=True)
        for r, v in got[impl].items():
            if r == "timeout" or v[0] != "ok":
                print(f"  [{impl}] rank {r}: {v}")
    a = got["torch"].get(0, ("?", {}))[1]
    b = got["distgrad"].get(0, ("?", {}))[1]
    if not isinstance(a, dict) or not isinstance(b, dict):
        print("RESULT: FAIL (a side did not finish)")
        return
    ta, tb = a.pop("_timing", {}), b.pop("_timing", {})
    fails = 0
    for k in sorted(set(a) | set(b), key=lambda k: (k.split(".")[0], k)):
        same = a.get(k) == b.get(k)
        fails += not same
        print(("PASS" if same else "FAIL") + f" {k}: torch={a.get(k)!r}" + ("" if same else f" distgrad={b.get(k)!r}"))
    print("release times after the with block (s, until each worker no longer had it; not compared):")
    for n in ta:
        print(f"  {n}: torch={ta.get(n)} distgrad={tb.get(n)}")
    print("RESULT:", "PASS" if not fails else f"FAIL ({fails} differences)")


if __name__ == "__main__":
    main()
