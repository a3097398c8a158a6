#!/usr/bin/env python
"""A local distributed backward, torch's and distgrad's, in one process, pass by pass.

    python bench/local_ab.py [--depths 30,120,600,1800] [--reps 200,100,30,8]

``run_all.py --only local,graph_size,tf_local`` runs each implementation in
its own cluster, one after the other, so a machine whose load changes between
them (other jobs, a shared 2-core VM) moves the ratio. Here both run in one
process, each with its own one-worker RPC group (torch's TensorPipe agent and
distgrad's), on the same model and input: fresh forward, then
``dist_autograd.backward(cid, [loss])``, torch and distgrad alternating which
goes first (``common.interleaved``), so drift hits both alike. The model is the
graph_size workload's: ``depth`` x (Linear(16,16) + Tanh), batch 4, 5 autograd
nodes a layer. The gradients of both are checked equal once per depth.

Prints, per depth, both medians in ms and distgrad / torch (target: <= 1).
"""
from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sys.path, DISTGRAD_SECRET)
import torch


def _group(rpc, name: str) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{common.free_port()}")
    rpc.init_rpc(name, rank=0, world_size=1, rpc_backend_options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="30,120,600,1800")
    ap.add_argument("--reps", default="200,100,30,8")
    args = ap.parse_args()
    import torch.distributed.autograd as torch_autograd
    import torch.distributed.rpc as torch_rpc

    import distgrad.autograd as dg_autograd
    import distgrad.rpc as dg_rpc
    torch.set_num_threads(1)
    _group(torch_rpc, "torch0")
    _group(dg_rpc, "distgrad0")
    try:
        for depth, reps in zip(map(int, args.depths.split(",")), map(int, args.reps.split(","))):
            torch.manual_seed(depth)
            net = torch.nn.Sequential(*[m for _ in range(depth)
                                        for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
            x = torch.randn(4, 16)

            def once(mod, check=False, net=net, x=x):
                with mod.context() as cid:
                    loss = net(x).sum()
                    t0 = time.perf_counter_ns()
                    mod.backward(cid, [loss])
                    dt = time.perf_counter_ns() - t0
                    return mod.get_gradients(cid) if check else dt

            a, b = once(torch_autograd, True), once(dg_autograd, True)
            assert all(torch.equal(a[p], b[p]) for p in net.parameters()), "gradients differ"
            t, d = common.interleaved(lambda: once(torch_autograd), lambda: once(dg_autograd),
                                      warm=max(2, reps // 10), reps=reps)
            tm, dm = statistics.median(t) / 1e6, statistics.median(d) / 1e6
            print(f"depth={depth} nodes={5 * depth + 1} torch_ms={tm:.3f} distgrad_ms={dm:.3f} "
                  f"ratio={dm / tm:.3f}", flush=True)
    finally:
        dg_rpc.shutdown()
        torch_rpc.shutdown()


if __name__ == "__main__":
    main()
