#!/usr/bin/env python
"""Start-up and first-connection cost, torch and distgrad side by side.

    python bench/startup_bench.py [--worlds 2,4] [--repeats 5] [--impl torch,distgrad]

Each repeat spawns a fresh cluster per implementation (the implementations
alternate which goes first), with the cluster secret set as deployed
(``common``). Rank 0 reports:

* ``init_rpc_s``: its ``init_rpc`` (rendezvous, and for distgrad the secret's
  key derivation, ~150 ms of scrypt once per process, and the listening sockets);
* ``first_call_ms``: its first ``rpc_sync`` to each other worker, median over
  the peers: the connection and its handshake (client proves first, then the
  server) when the implementation connects lazily, plus one round trip;
* ``warm_call_ms``: the median of 50 further calls to worker 1 (one round trip).

Prints the medians over repeats and distgrad / torch. To compare with an older
distgrad, copy this file and ``common.py`` into that checkout's ``bench/`` and
run it there: ``common`` puts its own checkout first on ``sys.path``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
import torch


def startup_workload(rpc, world: int) -> dict:
    """Rank 0's body (see the module docstring)."""
    firsts = []
    for r in range(1, world):
        t0 = time.perf_counter()
        rpc.rpc_sync(f"worker{r}", torch.add, args=(torch.ones(1), 1))
        firsts.append(time.perf_counter() - t0)
    warm = []
    for _ in range(50):
        t0 = time.perf_counter()
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        warm.append(time.perf_counter() - t0)
    return {"first_call_ms": statistics.median(firsts) * 1e3,
            "warm_call_ms": statistics.median(warm) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", default="torch,distgrad")
    args = ap.parse_args()
    import functools
    impls = [s for s in args.impl.split(",") if s]
    keys = ("init_rpc_s", "first_call_ms", "warm_call_ms")
    print(f"startup_bench: repeats {args.repeats}, impls {impls}")
    for world in [int(w) for w in args.worlds.split(",")]:
        got: dict = {i: {k: [] for k in keys} for i in impls}
        for rep in range(args.repeats):
            order = impls if rep % 2 == 0 else impls[::-1]
            for impl in order:
                res = common.run_cluster(impl, world, functools.partial(startup_workload, world=world),
                                         timeout=180)
                for k in keys:
                    got[impl][k].append(res[k])
        for k in keys:
            med = {i: statistics.median(got[i][k]) for i in impls}
            line = "  ".join(f"{i}={med[i]:.3f}" for i in impls)
            ratio = (f"  ratio={med['distgrad'] / med['torch']:.2f}"
                     if "torch" in med and "distgrad" in med and med["torch"] else "")
            print(f"world={world} {k}: {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()
