"""Run a scenario on 2 spawned workers under torch.distributed.rpc and under distgrad,
return each rank's observations; compare.  scenario(rank, rpc, dist_autograd, impl)
is a module-level function of the calling program."""
from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def modules(impl):
    if impl == "torch":
        import torch.distributed.autograd as da
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as da
        import distgrad.rpc as rpc
    return rpc, da


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, impl, modname, fname, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("DISTGRAD_SECRET", "audit37")
    sys.path.insert(0, HERE)
    import torch
    torch.set_num_threads(1)
    try:
        rpc, da = modules(impl)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=60,
                                               num_worker_threads=int(os.environ.get("AUDIT37_THREADS", "16")))
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
        mod = importlib.import_module(modname)
        val = getattr(mod, fname)(rank, rpc, da, impl)
        out.put((rank, "ok", val))
        rpc.shutdown(graceful=os.environ.get("AUDIT37_GRACEFUL", "1") == "1")
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run(modname, fname, impl, world=2, timeout=120):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_worker, args=(r, world, port, impl, modname, fname, out))
          for r in range(world)]
    for p in ps:
        p.start()
    res = {}
    try:
        for _ in range(world):
            r, status, val = out.get(timeout=timeout)
            res[r] = (status, val)
    except queue.Empty:
        res["timeout"] = True
    finally:
        for p in ps:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return res


def compare(modname, fname, world=2, timeout=120, impls=("torch", "distgrad")):
    """Returns (ok, results by impl). Prints per-key diffs."""
    got = {impl: run(modname, fname, impl, world, timeout) for impl in impls}
    ok = True
    for impl, res in got.items():
        for r, v in res.items():
            if r == "timeout" or v[0] != "ok":
                print(f"  [{impl}] rank {r}: {v if r != 'timeout' else 'TIMEOUT'}")
                ok = False
    if not ok:
        return False, got
    a, b = (got[i] for i in impls)
    for r in a:
        ra, rb = a[r][1], b[r][1]
        if isinstance(ra, dict):
            for k in sorted(set(ra) | set(rb)):
                same = ra.get(k) == rb.get(k)
                print(f"  rank{r} {k}: {'same' if same else 'DIFF'} torch={ra.get(k)!r}"
                      + ("" if same else f" distgrad={rb.get(k)!r}"))
                ok &= same
        else:
            same = ra == rb
            print(f"  rank{r}: {'same' if same else 'DIFF'} torch={ra!r} distgrad={rb!r}")
            ok &= same
    return ok, got
