#!/usr/bin/env python
"""A compute-heavy pipeline, torch beside distgrad, by where the user sets the
intra-op thread count.

    python bench/wide_pipeline.py [--steps 40] [--repeats 2] [--set-threads none,main,ctor]

3 workers: the driver (worker0) sends a 64 x 1024 batch through two stages of
4 x (Linear(1024, 1024) + ReLU), one on worker1 and one on worker2 (``rpc.remote``
modules), takes ``out.pow(2).mean()`` and runs ``dist_autograd.backward``: about
60 ms of compute a step. ``--set-threads`` says where ``torch.set_num_threads(1)``
is called: ``none`` (nowhere), ``main`` (every worker, before ``init_rpc``),
``ctor`` (in the stages' constructors, as bench/autograd_bench.py and
bench/transformer_bench.py do). Each case runs each implementation on a fresh
cluster, alternating, ``--repeats`` times; prints steps/s and the ratio of the
medians. See docs/architecture.md ("Third round").
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"


def _modules(impl: str):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    return rpc, dist_autograd


class Stage:
    def __init__(self, seed: int, set_threads: str):
        import torch
        torch.manual_seed(seed)
        if set_threads == "ctor":
            torch.set_num_threads(1)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers)


def stage_forward(rref, x):
    return rref.local_value().net(x)


def _worker(rank: int, port: int, impl: str, set_threads: str, steps: int, out) -> None:
    import torch
    if set_threads == "main":
        torch.set_num_threads(1)
    os.environ.setdefault("DISTGRAD_SECRET", SECRET)
    rpc, dist_autograd = _modules(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=4)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    if rank == 0:
        s1 = rpc.remote("worker1", Stage, args=(1, set_threads))
        s2 = rpc.remote("worker2", Stage, args=(2, set_threads))
        x = torch.randn(64, 1024)

        def step():
            with dist_autograd.context() as cid:
                h = rpc.rpc_sync("worker1", stage_forward, args=(s1, x))
                h = rpc.rpc_sync("worker2", stage_forward, args=(s2, h))
                dist_autograd.backward(cid, [h.pow(2).mean()])
        for _ in range(5):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        out.put(steps / (time.perf_counter() - t))
    rpc.shutdown()


def run_once(impl: str, set_threads: str, steps: int, timeout: float = 300.0) -> float:
    """Steps/s of one fresh 3-worker cluster of ``impl``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, port, impl, set_threads, steps, out))
          for r in range(3)]
    for p in ps:
        p.start()
    try:
        return out.get(timeout=timeout)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set-threads", default="none,main,ctor")
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    for case in args.set_threads.split(","):
        got: dict[str, list[float]] = {"torch": [], "distgrad": []}
        for _ in range(args.repeats):
            for impl in got:
                got[impl].append(run_once(impl, case, args.steps))
        t, d = statistics.median(got["torch"]), statistics.median(got["distgrad"])
        print(f"set_num_threads(1) {case:5s}: torch {t:6.2f} steps/s {got['torch']}, "
              f"distgrad {d:6.2f} {got['distgrad']}, distgrad/torch {d / t:.2f}x", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
