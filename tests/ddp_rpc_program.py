"""The shape of PyTorch's "Combining Distributed DataParallel with Distributed RPC
Framework" tutorial (pytorch/tutorials ``rpc_ddp_tutorial``; its program is
pytorch/examples' ``distributed/rpc/ddp_rpc/main.py``), written for torch's
names and run by ``tests/test_torch_suites.py`` with distgrad swapped in by
module patching (``tests/torch_swap.py``, from a ``sitecustomize`` in every process).

Four processes: two trainers, a master, a parameter server. The trainers start
a gloo group of their own *before* ``init_rpc``; the master puts an
``EmbeddingBag`` on the server as a ``RemoteModule`` and runs the training loop on
each trainer over RPC: an ``nn.Linear`` in ``DistributedDataParallel`` after the
remote lookup, one ``DistributedOptimizer`` over both, a distributed backward per
batch. At the end the master checks that the two trainers' DDP replicas are
identical (DDP averaged every step's gradients) and that they and the table moved.

    python tests/ddp_rpc_program.py [epochs]      # prints "ddp_rpc ok" at the end
"""
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel

ROWS, DIM, CLASSES, BATCHES = 50, 8, 4, 5


class Hybrid(torch.nn.Module):
    """A remote embedding lookup, then a local linear layer in DDP."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.head = DistributedDataParallel(torch.nn.Linear(DIM, CLASSES))

    def forward(self, indices, offsets):
        return self.head(self.table.forward(indices, offsets))


def batches(seed):
    rng = random.Random(seed)
    for _ in range(BATCHES):
        n = rng.randint(10, 30)
        indices = torch.randint(0, ROWS, (n,))
        offsets, start = [], 0
        while start < n:
            offsets.append(start)
            start += rng.randint(1, 6)
        yield indices, torch.tensor(offsets), torch.randint(0, CLASSES, (len(offsets),))


def train(table, trainer, epochs):
    torch.manual_seed(trainer)  # the replicas start apart: DDP's broadcast aligns them
    model = Hybrid(table)
    params = table.remote_parameters() + [RRef(p) for p in model.head.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = [p.detach().clone() for p in model.head.parameters()]
    for epoch in range(epochs):
        for indices, offsets, target in batches(100 * trainer + epoch):
            with dist_autograd.context() as cid:
                loss = loss_fn(model(indices, offsets), target)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
        print(f"trainer{trainer} epoch {epoch} loss {loss.item():.6f}", flush=True)
    moved = any(not torch.equal(a, p) for a, p in zip(start, model.head.parameters()))
    return [p.detach().clone() for p in model.head.parameters()], moved


def table_weight(table):
    return table.get_module_rref().to_here().weight.detach().clone()


def run(rank, world_size, rpc_port, pg_port, epochs):
    opts = TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=opts)
        print(f"rpc is {rpc.__name__}", flush=True)
        table = RemoteModule("ps", torch.nn.EmbeddingBag, args=(ROWS, DIM), kwargs={"mode": "sum"})
        before = table_weight(table)
        futs = [rpc.rpc_async(f"trainer{t}", train, args=(table, t, epochs)) for t in (0, 1)]
        (params0, moved0), (params1, moved1) = [f.wait() for f in futs]
        assert moved0 and moved1, "the DDP layer did not train"
        for a, b in zip(params0, params1):
            assert torch.equal(a, b), "the DDP replicas differ"
        assert not torch.equal(before, table_weight(table)), "the remote table did not train"
        print("ddp_rpc ok", flush=True)
    elif rank <= 1:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=opts)
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(4, os.environ["RPC_PORT"], os.environ["PG_PORT"], int((sys.argv[1:] or [3])[0])),
             nprocs=4, join=True)
