"""A plain torch.distributed.rpc script written for torchrun (env:// rendezvous)."""
import os

import torch
import torch.distributed.rpc as rpc

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
peer = f"worker{(rank + 1) % world_size}"
result = rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank + 1))
print(f"RESULT rank={rank} {result.tolist()}", flush=True)
rpc.shutdown()
