"""Served requests that name their tensors add no garbage collections (third audit).
2 real workers. worker0 makes 600 calls to worker1, each carrying 20 tensors (a tuple of
args: 8 named and '+12 more'), then 600 with a sparse COO tensor and a t() view; once
without a trace, once inside one. worker1 counts its gen-0 collections (gc.callbacks) in each
run: with the trace it may add some for the trace's own buffer, but not about one per few
records (a tuple/list per record would add ~ calls*objects/700).
Run: cd <repo> && PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue36/serve_gc.py"""
import gc, os, sys, tempfile, warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_workers, strict_load

N = [0]


def _cb(phase, info):
    if phase == "start":
        N[0] += 1


def _count(reset=False):
    if _cb not in gc.callbacks:
        gc.callbacks.append(_cb)
    if reset:
        gc.collect()
        N[0] = 0
    return N[0]


def _ident(*a):
    return 0


def _run(rank, world_size, where):
    import torch, distgrad, distgrad.rpc as rpc
    if rank != 0:
        rpc.api._barrier(["worker0", "worker1"])
        return None
    warnings.simplefilter("ignore")
    many = tuple(torch.ones(i + 1) for i in range(20))
    sp = torch.sparse_coo_tensor([[0, 2], [1, 0]], [3.0, 4.0], (3, 3))
    big = torch.arange(1000.0).reshape(100, 10)

    def load():
        for _ in range(600):
            rpc.rpc_sync("worker1", _ident, args=many)
        for _ in range(600):
            rpc.rpc_sync("worker1", _ident, args=(sp, big.t()))
    out = {}
    rpc.rpc_sync("worker1", _count, args=(True,))
    load()
    out["without"] = rpc.rpc_sync("worker1", _count)
    rpc.rpc_sync("worker1", _count, args=(True,))
    with distgrad.trace(os.path.join(where, "gc.json")):
        load()
        out["with"] = rpc.rpc_sync("worker1", _count)
    out["file"] = os.path.join(where, "gc.json")
    rpc.api._barrier(["worker0", "worker1"])
    return out


if __name__ == "__main__":
    where = tempfile.mkdtemp(prefix="audit-gc-"); os.chmod(where, 0o700)
    r = run_workers(_run, world_size=2, timeout=240, args=(where,))[0]
    doc = strict_load(r["file"])
    named = {str(e["args"]["tensors"]) for e in doc["traceEvents"]
             if e.get("cat") == "rpc.serve" and e.get("args", {}).get("tensors")}
    print(f"worker1 gen-0 collections over 1,200 calls: without trace {r['without']}, with {r['with']}")
    print("named:", sorted(named, key=len)[:3])
    ok = r["with"] <= r["without"] + 5
    print("PASS" if ok else "FAIL")
