#!/usr/bin/env python
"""Migrating from torch.distributed.rpc: the same script, two backends.

    python examples/migrate_from_torch.py           # runs on distgrad
    python examples/migrate_from_torch.py --torch   # runs on torch.distributed.rpc

Everything below the imports is plain torch.distributed.rpc code (a driver
trains a linear model whose weights live on another worker, with remote
references, rpc_sync/rpc_async, distributed autograd and DistributedOptimizer).
Moving it to distgrad changes exactly three lines, the imports, and adds one:
the cluster secret.
"""
import os
import secrets
import socket
import sys

import torch
import torch.multiprocessing as mp

if "--torch" in sys.argv:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
else:
    try:
        import distgrad  # noqa: F401
    except ImportError:  # a source checkout without `pip install -e .`
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # ---- the three lines that move a torch.distributed.rpc program to distgrad ----
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer
    # every worker needs the same DISTGRAD_SECRET (README, "Trust model"); the ones spawned here inherit this
    os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))

# ------------------------- unchanged torch.distributed.rpc code -------------------------
IN, OUT, STEPS = 8, 2, 40


class LinearShard:
    """A model shard living on worker1."""

    def __init__(self):
        torch.manual_seed(0)
        self.weight = torch.zeros(OUT, IN, requires_grad=True)
        self.bias = torch.zeros(OUT, requires_grad=True)

    def forward(self, x):
        return x @ self.weight.t() + self.bias

    def parameter_rrefs(self):
        return [rpc.RRef(self.weight), rpc.RRef(self.bias)]


def make_data(n=64):
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(OUT, IN, generator=g)
    x = torch.randn(n, IN, generator=g)
    return x, x @ true_w.t() + 0.5


def driver():
    shard = rpc.remote("worker1", LinearShard)                   # RRef to a remote object
    opt = DistributedOptimizer(torch.optim.SGD, shard.rpc_sync().parameter_rrefs(), lr=0.1)
    x, y = make_data()
    peer = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1)).wait()
    assert peer.tolist() == [2.0, 2.0]
    for step in range(1, STEPS + 1):
        with dist_autograd.context() as context_id:
            pred = shard.rpc_sync().forward(x)                    # forward through RPC
            loss = ((pred - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])            # distributed backward
            grads = dist_autograd.get_gradients(context_id)       # none here: all are remote
            assert len(grads) == 0
            opt.step(context_id)                                  # steps on worker1
        if step % 10 == 0:
            print(f"step {step:3d} loss {loss.item():.5f}", flush=True)
    w = shard.rpc_sync().forward(torch.zeros(1, IN))
    print(f"bias after training: {w.detach().squeeze().tolist()}", flush=True)


def run_worker(rank, port):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        driver()
    rpc.shutdown()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"backend: {rpc.__name__}", flush=True)
    mp.spawn(run_worker, args=(port,), nprocs=2, join=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
