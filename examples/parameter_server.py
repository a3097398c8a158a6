#!/usr/bin/env python
"""Parameter server: one server holds the model, two trainers train it together.

    python examples/parameter_server.py [--steps 60] [--lr 0.05] [--trace ps.json]

``--trace ps.json`` records trainer1's last step with ``distgrad.trace`` (every
worker, trainer2's step in flight included): open it at https://ui.perfetto.dev,
or draw it with ``distgrad trace-plot ps.json -o ps.png``.

Three local processes (torch.multiprocessing spawn, 127.0.0.1):

* ``ps`` keeps an MLP. It computes nothing: trainers pull its parameters and
  push gradients back, and its DistributedOptimizer steps run there.
* ``trainer1`` and ``trainer2`` each, per step, inside a distributed autograd
  context: pull the parameters with ``rpc_sync`` (the RPC is recorded, so the
  gradients of the copies flow back to the server's parameters), run the
  forward pass locally on a synthetic batch, ``dist_autograd.backward`` and
  ``DistributedOptimizer.step``. Both trainers step the same parameters at the
  same time; the server serializes the updates.

The data is a regression problem set by a fixed random "teacher" MLP, so the
loss printed by each trainer (mean of the last 10 steps) falls.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys
import threading

import torch
import torch.multiprocessing as mp
import torch.nn as nn

try:
    import distgrad  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgrad
import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.optim import DistributedOptimizer

# every worker needs the same DISTGRAD_SECRET (README, "Trust model"); the ones spawned here inherit this
os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))

IN, HIDDEN, OUT = 16, 32, 4
BATCH = 32


def make_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


# --------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------
class ParameterServer:
    """Holds the model; trainers reach it through the module-level functions below."""

    def __init__(self) -> None:
        self.model = make_mlp(seed=0)
        self.lock = threading.Lock()
        self.pulls = 0

    def parameters(self) -> list[torch.Tensor]:
        with self.lock:
            self.pulls += 1
        # views of the parameters, not the Parameters: an nn.Parameter sent over RPC
        # arrives as a new leaf and no gradient comes back through it (torch's rule,
        # which distgrad keeps); a view carries the autograd link back to the server
        return [p.view_as(p) for p in self.model.parameters()]


_server: ParameterServer | None = None


def _get_server() -> ParameterServer:
    global _server
    if _server is None:
        _server = ParameterServer()
    return _server


def param_rrefs() -> list[rpc.RRef]:
    """Runs on ps: RRefs to its parameters, for the trainers' DistributedOptimizer."""
    return [rpc.RRef(p) for p in _get_server().model.parameters()]


def pull_parameters() -> list[torch.Tensor]:
    """Runs on ps: views of the parameters (copied to the caller, gradients come back)."""
    return _get_server().parameters()


# --------------------------------------------------------------------------
# the trainers
# --------------------------------------------------------------------------
def forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1.t() + b1) @ w2.t() + b2


def run_trainer(name: str, steps: int, lr: float, seed: int, trace: str | None = None) -> None:
    teacher = make_mlp(seed=1234)      # the same on both trainers: one problem to solve
    gen = torch.Generator().manual_seed(seed)
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", param_rrefs), lr=lr)
    window: list[float] = []
    for step in range(1, steps + 1):
        x = torch.randn(BATCH, IN, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        traced = trace if step == steps and name == "trainer1" else None
        with distgrad.trace(traced) if traced else contextlib.nullcontext():
            with dist_autograd.context() as context_id:
                params = rpc.rpc_sync("ps", pull_parameters)
                with distgrad.trace.span("forward + loss"):
                    loss = nn.functional.mse_loss(forward(params, x), y)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        window.append(loss.item())
        if step % 10 == 0:
            print(f"{name} step {step:4d} loss {sum(window) / len(window):.5f}", flush=True)
            window.clear()


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------
def run_worker(rank: int, world_size: int, port: int, steps: int, lr: float,
               trace: str | None = None) -> None:
    torch.set_num_threads(1)
    name = "ps" if rank == 0 else f"trainer{rank}"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank != 0:
        run_trainer(name, steps, lr, seed=rank, trace=trace)
    rpc.shutdown()   # waits for every worker, so ps serves until both trainers are done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per trainer")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--trace", default=None, help="record trainer1's last step to this trace file")
    a = ap.parse_args()
    world_size = 3
    trace = os.path.abspath(a.trace) if a.trace else None
    mp.spawn(run_worker, args=(world_size, free_port(), a.steps, a.lr, trace), nprocs=world_size,
             join=True)
    if trace:
        print(f"trace written to {trace}: open it at https://ui.perfetto.dev", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
