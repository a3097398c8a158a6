"""For tests/test_launch.py: distributed autograd training between two ranks under
torchrun with --max-restarts. On attempt 0 (TORCHELASTIC_RESTART_COUNT) rank 1
SIGKILLs itself inside the RPC of step 3; torchrun restarts the group and
attempt 1 runs every step, each gradient checked against local autograd.
An optional argument names a directory for pid files (pid<rank>.<attempt>)."""
import os
import signal
import sys

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

STEPS = 5
KILL_AT = 3
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
served = 0


def stage(x: torch.Tensor, w: torch.Tensor, step: int) -> torch.Tensor:
    """Rank 1's part of the model; on attempt 0 it dies at step KILL_AT."""
    global served
    if attempt == 0 and step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    served += 1
    return torch.tanh(x @ w)


torch.set_num_threads(1)
if sys.argv[1:]:
    with open(os.path.join(sys.argv[1], f"pid{rank}.{attempt}"), "w") as f:
        f.write(str(os.getpid()))
print(f"START rank={rank} attempt={attempt} store={os.environ['MASTER_ADDR']}:"
      f"{os.environ['MASTER_PORT']} agent_store={os.environ['TORCHELASTIC_USE_AGENT_STORE']}",
      flush=True)
rpc.init_rpc(f"worker{rank}")  # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT from the agent
if rank == 0:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=g), torch.randn(3, 2, generator=g).requires_grad_()
    for step in range(STEPS):
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync("worker1", stage, args=(x, w, step))
            loss = rpc.remote("worker1", torch.mul, args=(h, h)).to_here().sum()
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[w]
        w_local = w.detach().clone().requires_grad_()
        (torch.tanh(x @ w_local) ** 2).sum().backward()
        torch.testing.assert_close(grad, w_local.grad)
        print(f"GRAD OK rank=0 attempt={attempt} step={step}", flush=True)
        with torch.no_grad():
            w -= 0.1 * grad
rpc.shutdown()
print(f"DONE rank={rank} attempt={attempt} steps={STEPS if rank == 0 else served}", flush=True)
