import torch
from mp_utils import run_workers


def _add(rank, world_size):
    import distgrad.rpc as rpc
    other = f"worker{(rank + 1) % world_size}"
    return rpc.rpc_sync(other, torch.add, args=(torch.ones(2) * rank, 1)).tolist()


def test_two_workers_add():
    assert run_workers(_add, world_size=2, timeout=60) == [[1.0, 1.0], [2.0, 2.0]]
