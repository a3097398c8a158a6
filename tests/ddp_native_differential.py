"""DDP inside a distributed backward on the native engine (issue 43), run on torch's RPC
and distributed autograd and on distgrad's, each in processes of its own (the torch
run never imports distgrad): every observation must be equal.

    python tests/ddp_native_differential.py --impl torch      # prints one JSON line
    python tests/ddp_native_differential.py --impl distgrad

worker0 serves; worker1 and worker2 train in a gloo group. Cases, on each trainer:
  - threads: two threads, each with a DDP of its own over a group of its own, passes at
    once (worker1 starts the first thread first, worker2 the second): every pass ends,
    with DDP's average in its context;
  - hooks: a DDP parameter with a tensor hook (doubles), a pre-hook and a post-hook on
    its AccumulateGrad node (the pre-hook triples), two passes in one context (the first
    local, the second through an RPC): each hook runs once a pass, the pre-hook sees only
    that pass's gradient, the context holds DDP's average of what the hooks made.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import sys
import threading

import torch
from mp_utils import free_port, reap  # no distgrad: mp_utils imports it only inside workers
from torch import nn

SECRET = "4c1f0a8be22f2a0d6c9f3e2b7d8a1c5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c"
D = 4


def _modules(impl: str):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    return rpc, dist_autograd


def served(h):
    return h * 2 + h.sin()


def _batch(rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(3, D, dtype=torch.float64, generator=g)


def _r(t) -> list | None:
    return None if t is None else [round(v, 9) for v in t.reshape(-1).tolist()]


def _grads(model, g) -> dict:
    return {n: _r(g.get(p)) for n, p in model.named_parameters()}


def _threads(rank, rpc, dist_autograd) -> list:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    g2 = dist.new_group([0, 1])
    torch.manual_seed(rank)
    models = [DDP(nn.Linear(D, D).double()), DDP(nn.Linear(D, D).double(), process_group=g2)]
    res: list = [None, None]

    def go(k):
        out = []
        try:
            for i in range(3):
                with dist_autograd.context() as cid:
                    o = models[k](_batch(rank, i + 10 * k))
                    r = rpc.rpc_sync("worker0", served, args=(o,))
                    dist_autograd.backward(cid, [(r * r).sum()])
                    out.append(_grads(models[k], dist_autograd.get_gradients(cid)))
        except Exception as e:  # noqa: BLE001 - recorded: it must match too
            out.append(f"error {type(e).__name__}")
        res[k] = out
    order = (0, 1) if rank == 1 else (1, 0)
    ts = [threading.Thread(target=go, args=(k,), daemon=True) for k in order]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return res if not any(t.is_alive() for t in ts) else ["hung", res]


def _hooks(rank, rpc, dist_autograd) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(rank)
    model = DDP(nn.Linear(D, D).double())
    w = model.module.weight
    counts = {"tensor": 0, "node_pre": 0, "node_post": 0}
    seen = []
    acc = torch.autograd.graph.get_gradient_edge(w).node

    def th(g):
        counts["tensor"] += 1
        return g * 2

    def npre(gs):
        counts["node_pre"] += 1
        seen.append(_r(gs[0]))
        return (gs[0] * 3,)

    def npost(gi, go):
        counts["node_post"] += 1
    handles = [w.register_hook(th), acc.register_prehook(npre), acc.register_hook(npost)]
    try:
        with dist_autograd.context() as cid:
            for i in range(2):   # (the first pass local only: torch's second pass in a
                o = model(_batch(rank, i))   # context whose first sent waits for ever)
                r = rpc.rpc_sync("worker0", served, args=(o,)) if i else served(o)
                dist_autograd.backward(cid, [(r * r).sum()])
            grads = _grads(model, dist_autograd.get_gradients(cid))
    finally:
        for h in handles:
            h.remove()
    return {"counts": counts, "pre_hook_saw": seen, "grads": grads, "grad_field": w.grad is None}


CASES = [("threads", _threads), ("hooks", _hooks)]


def _worker(rank: int, port: int, pg_port: int, impl: str, out, timeout: float) -> None:
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=False)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("DISTGRAD_SECRET", SECRET)
    rpc, dist_autograd = _modules(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    res = {}
    if rank > 0:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank - 1, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
        for name, fn in CASES:
            try:
                res[name] = fn(rank, rpc, dist_autograd)
            except BaseException as e:  # noqa: BLE001 - recorded: it must match too
                res[name] = f"error {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if impl == "distgrad":   # the native engine ran these passes: never fall back unseen
            from distgrad.autograd import native_pass
            from distgrad.autograd.engine import ENGINE
            if native_pass.M is None or ENGINE.stats.get("passes_graph_task", 0) == 0:
                res["error"] = f"not the native engine: {dict(ENGINE.stats)}"
    rpc.shutdown()
    if rank > 0:
        import torch.distributed as dist
        dist.destroy_process_group()
        out.put((rank, res))


def run(impl: str, timeout: float = 150.0) -> dict:
    """The cases on three spawned workers of ``impl``; the trainers' records."""
    port, pg_port = free_port(), free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, port, pg_port, impl, out, timeout), daemon=True)
          for r in range(3)]
    for p in ps:
        p.start()
    res = {}
    try:
        for _ in range(2):
            rank, r = out.get(timeout=timeout)
            res[f"worker{rank}"] = r
    except queue.Empty:
        res = {"error": f"no result in {timeout} s", "hung": True}
    reap(ps)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), required=True)
    print(json.dumps(run(ap.parse_args().impl), sort_keys=True))
    sys.stdout.flush()
