"""For torchrun (tests/test_rendezvous_shared.py): distgrad RPC and a gloo process
group on the agent's store (env://), an all_reduce, an rpc_sync and a distributed
backward checked against local autograd, then both shut down."""
import os

import torch
import torch.distributed as dist

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)

rpc.init_rpc(f"worker{rank}")
dist.init_process_group("gloo")

t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
assert t.item() == world_size * (world_size + 1) / 2, t

peer = f"worker{(rank + 1) % world_size}"
assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank)).tolist() == [1.0 + rank] * 2
if rank == 0:
    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    w = torch.tensor([1.0, 2.0, 3.0])
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync(peer, torch.mul, args=(x, x))
        dist_autograd.backward(cid, [(y * w).sum()])
        got = dist_autograd.get_gradients(cid)[x]
    torch.testing.assert_close(got, 2 * x.detach() * w)

rpc.shutdown()
dist.destroy_process_group()
print(f"OK rank={rank} agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
