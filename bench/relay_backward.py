#!/usr/bin/env python
"""The backward's hops, magnified: a relay with almost no compute, torch beside distgrad.

    python bench/relay_backward.py [--sizes 16,256,1024] [--seconds 4] [--repeats 2]

3 workers. worker0 sends a 64 x N tensor (requires grad) to worker1, which returns
``x * w``; worker0 sends that to worker2, which returns ``h * w``; worker0 runs
``dist_autograd.backward`` on the sum. So each step's backward is 4 gradient hops
(worker0 -> worker2 -> worker0 -> worker1 -> worker0) with a few microseconds of
compute, and then the context's exit. Each implementation runs on a fresh cluster,
alternating, ``--repeats`` times per size, for ``--seconds`` of steps; printed:
the medians of the backward and of the context's exit, in ms, and the ratio
distgrad / torch of the backward (lower is better for distgrad). Where the time
goes: docs/measurements/2026-12-04-backward-rounds.md ("Third round").
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
from autograd_bench import autograd_module_name  # noqa: E402

_W: dict = {}


def scale(x):
    """A stage: ``x * w`` with a weight of this worker's (a leaf its gradient reaches)."""
    import torch
    w = _W.get(x.shape[1])
    if w is None:
        w = _W[x.shape[1]] = torch.ones(x.shape[1], requires_grad=True)
    return x * w


def drive(rpc, n: int, seconds: float) -> dict:
    """Rank 0: warm 50 steps, then time steps for ``seconds``."""
    import relay_backward as rb  # importable name for the RPC targets
    import torch
    dist_autograd = importlib.import_module(autograd_module_name(rpc.__name__))
    w1, w2 = common.worker_name(1), common.worker_name(2)
    x = torch.randn(64, n, requires_grad=True)
    bwd, exits = [], []
    steps = 0
    end = None
    while end is None or time.perf_counter() < end:
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(w1, rb.scale, args=(x,))
            h = rpc.rpc_sync(w2, rb.scale, args=(h,))
            t = time.perf_counter()
            dist_autograd.backward(cid, [h.sum()])
            t_exit = time.perf_counter()
        done = time.perf_counter()
        steps += 1
        if steps == 50:
            end = time.perf_counter() + seconds
        elif steps > 50:
            bwd.append(t_exit - t)
            exits.append(done - t_exit)
    return {"backward_ms": statistics.median(bwd) * 1e3, "exit_ms": statistics.median(exits) * 1e3,
            "steps": len(bwd)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,256,1024", help="N of the 64 x N tensor, comma list")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    for n in (int(s) for s in args.sizes.split(",")):
        got: dict[str, list[dict]] = {"torch": [], "distgrad": []}
        for _ in range(args.repeats):
            for impl in got:
                got[impl].append(common.run_cluster(
                    impl, 3, functools.partial(drive, n=n, seconds=args.seconds), timeout=300,
                    num_worker_threads=4))
        med = {impl: {k: statistics.median(r[k] for r in runs) for k in ("backward_ms", "exit_ms")}
               for impl, runs in got.items()}
        t, d = med["torch"], med["distgrad"]
        print(f"64 x {n:5d}: backward torch {t['backward_ms']:.3f} ms, distgrad {d['backward_ms']:.3f} ms "
              f"(distgrad/torch {d['backward_ms'] / t['backward_ms']:.2f}x); context exit torch "
              f"{t['exit_ms']:.3f} ms, distgrad {d['exit_ms']:.3f} ms", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
