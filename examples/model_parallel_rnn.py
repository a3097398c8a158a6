#!/usr/bin/env python
"""Model parallelism: an RNN language model split over workers, held by RRefs.

    python examples/model_parallel_rnn.py [--steps 60] [--lr 0.01] [--trace rnn.json]

``--trace rnn.json`` records the last step with ``distgrad.trace`` on all three
workers: open it at https://ui.perfetto.dev, or draw it with
``distgrad trace-plot rnn.json -o rnn.png``.

Like PyTorch's distributed RNN example (examples/distributed/rpc/rnn), on
distgrad. Three local processes (torch.multiprocessing spawn, 127.0.0.1):

* ``emb_worker`` holds the embedding table,
* ``lstm_worker`` holds the LSTM,
* ``trainer`` holds the decoder and drives training: the forward pass goes
  embedding (RPC) -> LSTM (RPC) -> decoder (local), ``dist_autograd.backward``
  sends gradients back through both RPCs, and one DistributedOptimizer (Adam)
  steps the parameters on all three workers.

The synthetic task is next-token prediction on sequences that count up modulo
the vocabulary size from a random start, so the printed loss (mean of the last
10 steps) falls quickly.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys

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

NTOKEN, NINP, NHID = 24, 16, 32
SEQ, BATCH = 12, 16


# --------------------------------------------------------------------------
# the pieces of the model
# --------------------------------------------------------------------------
class EmbeddingTable(nn.Module):
    """Lives on emb_worker."""

    def __init__(self, ntoken: int, ninp: int) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)


class RNN(nn.Module):
    """Lives on lstm_worker."""

    def __init__(self, ninp: int, nhid: int) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lstm = nn.LSTM(ninp, nhid, batch_first=True)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(emb)
        return out


def parameter_rrefs(module_rref: rpc.RRef) -> list[rpc.RRef]:
    """Runs on a module's owner: RRefs to the module's parameters."""
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


class RNNModel(nn.Module):
    """Built on the trainer: the embedding and the LSTM are remote, the decoder local."""

    def __init__(self, emb_worker: str, lstm_worker: str) -> None:
        super().__init__()
        self.emb_rref = rpc.remote(emb_worker, EmbeddingTable, args=(NTOKEN, NINP))
        self.rnn_rref = rpc.remote(lstm_worker, RNN, args=(NINP, NHID))
        torch.manual_seed(3)
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.emb_rref.rpc_sync().forward(tokens)      # on emb_worker
        hidden = self.rnn_rref.rpc_sync().forward(emb)      # on lstm_worker
        return self.decoder(hidden)                         # here

    def parameter_rrefs(self) -> list[rpc.RRef]:
        remote = []
        for r in (self.emb_rref, self.rnn_rref):
            remote += rpc.rpc_sync(r.owner(), parameter_rrefs, args=(r,))
        return remote + [rpc.RRef(p) for p in self.decoder.parameters()]


# --------------------------------------------------------------------------
# training (on the trainer)
# --------------------------------------------------------------------------
def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, NTOKEN, (BATCH, 1), generator=gen)
    seq = (start + torch.arange(SEQ + 1)) % NTOKEN
    return seq[:, :-1], seq[:, 1:]


def train(steps: int, lr: float, trace: str | None = None) -> None:
    model = RNNModel("emb_worker", "lstm_worker")
    params = model.parameter_rrefs()
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=lr)
    print(f"trainer: {len(params)} parameters on "
          f"{sorted({p.owner_name() for p in params})}", flush=True)
    gen = torch.Generator().manual_seed(0)
    loss_fn = nn.CrossEntropyLoss()
    window: list[float] = []
    for step in range(1, steps + 1):
        tokens, target = batch(gen)
        with distgrad.trace(trace) if trace and step == steps else contextlib.nullcontext():
            with dist_autograd.context() as context_id:
                with distgrad.trace.span("forward"):
                    logits = model(tokens)
                with distgrad.trace.span("loss"):
                    loss = loss_fn(logits.reshape(-1, NTOKEN), target.reshape(-1))
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        window.append(loss.item())
        if step % 10 == 0:
            print(f"trainer step {step:4d} loss {sum(window) / len(window):.5f}", flush=True)
            window.clear()


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------
NAMES = ["trainer", "emb_worker", "lstm_worker"]


def run_worker(rank: int, port: int, steps: int, lr: float, trace: str | None = None) -> None:
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=len(NAMES), rpc_backend_options=opts)
    if rank == 0:
        train(steps, lr, trace)
    rpc.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--trace", default=None, help="record the last step to this trace file")
    a = ap.parse_args()
    trace = os.path.abspath(a.trace) if a.trace else None
    mp.spawn(run_worker, args=(free_port(), a.steps, a.lr, trace), nprocs=len(NAMES), join=True)
    if trace:
        print(f"trace written to {trace}: open it at https://ui.perfetto.dev", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
