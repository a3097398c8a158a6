"""Which of torch's functions distgrad replaces, phase by phase, so that the list
cannot grow unnoticed (docs/compatibility.md, "What distgrad changes in torch").

Every function, method and class of torch's autograd, checkpoint, profiler, nn,
DDP and c10d modules is fingerprinted (tests/patch_census.py) in a process that
never imported distgrad, and again on real workers: after ``import distgrad``,
with a DDP built before RPC, while RPC is up, during a distributed backward (on
the worker whose share holds a reentrant checkpoint, and on one whose share holds
none), and after shutdown. What differs must be exactly the expected list.
"""
import pytest
import torch
from mp_utils import free_port, run_workers
from patch_census import clean_census, replaced
from torch.utils.checkpoint import checkpoint

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

USES_STORE_PROCESS = True   # rank 0 hosts its store as users get it (tests/mp_utils.py)

pytestmark = pytest.mark.timeout(240)

REGISTRY = ["torch.nn.modules.module._global_module_registration_hooks"]  # DDP's, public API
PROFILER = ["torch.autograd.profiler_legacy._parse_legacy_records",
            "torch.autograd.profiler_legacy.profile._start_trace"]
REDUCER = ["torch._C._distributed_c10d.Reducer.prepare_for_backward"]
# init_process_group ends with torch's barrier while RPC is up (distgrad/rpc/c10d_order.py)
C10D = ["torch.distributed.distributed_c10d._is_barrier_after_init"]
# rank 0 hosts RPC's store in a process of its own: torch's rendezvous on rank 0 is
# routed to it while that process lives (launch/keeper.py)
KEEPER = ["torch.distributed.rendezvous._create_c10d_store"]
CHECKPOINT = ["torch.autograd._is_checkpoint_valid", "torch.autograd.backward",
              "torch.utils.checkpoint.CheckpointFunction.backward",
              "torch.utils.checkpoint.detach_variable"]
CLEAN: list = []
SEEN: list = []


def _block(x):
    """Runs on worker1 at the forward, and again inside the pass (recomputed)."""
    SEEN.append(replaced(CLEAN[0]))
    return x.sin() * 2


def _callee(x):
    return checkpoint(_block, x, use_reentrant=True)


def _seen():
    return list(SEEN)


def _phases(rank, world, clean, rpc_port, pg_port):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    CLEAN.append(clean)
    out = {"import": replaced(clean)}
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{pg_port}")
    ddp = DDP(torch.nn.Linear(2, 2))
    out["ddp"] = replaced(clean)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out["rpc"] = replaced(clean)
    if rank == 0:
        x = torch.ones(3, requires_grad=True)
        during = []
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", _callee, args=(x,)) * 1
            y.register_hook(lambda g: during.append(replaced(clean)))
            dist_autograd.backward(cid, [y.sum()])
            g = dist_autograd.get_gradients(cid)[x]
        out["pass_here"] = during
        out["grad"] = torch.allclose(g, 2 * torch.ones(3).cos())
        out["worker1_block"] = rpc.rpc_sync("worker1", _seen)
    rpc.shutdown()
    out["shutdown"] = replaced(clean)
    del ddp
    dist.destroy_process_group()
    return out


def test_torch_functions_replaced_in_each_phase():
    clean = clean_census()
    res = run_workers(_phases, world_size=2, timeout=200, init=False,
                      args=(clean, free_port(), free_port()))
    up = sorted(REGISTRY + PROFILER + REDUCER + C10D)
    for rank, out in enumerate(res):
        assert out["import"] == REGISTRY, rank        # nothing of torch replaced
        assert out["ddp"] == REGISTRY, rank           # a DDP, no RPC: still nothing
        # RPC up, a DDP exists (rank 0: its store's process lives)
        assert out["rpc"] == sorted(up + (KEEPER if rank == 0 else [])), rank
        assert out["shutdown"] == REGISTRY, rank      # all of torch's back
    first = res[0]
    assert first["grad"]
    # a pass without checkpoints adds nothing
    assert first["pass_here"] == [sorted(up + KEEPER)]
    # worker1: the block's forward (RPC up), then its recomputation inside the pass
    assert first["worker1_block"] == [up, sorted(up + CHECKPOINT)]
