#!/usr/bin/env python
"""What an open ``distgrad.trace`` costs per ``rpc_sync`` (issue 36, item 14).

    python bench/trace_bench.py [--calls 3000] [--rounds 4]

Two workers on 127.0.0.1; worker0 makes ``calls`` round trips
``rpc_sync("worker1", torch.add, (ones(4), 1))`` per block, the blocks alternating
without and with a trace open (side by side in one cluster, ``rounds`` of each).
Per block: the CPU (user + system) each process spent per call, read just before
the first call and just after the last (the trace's start and stop are outside the
window), and the garbage collections each process ran in it (``gc.callbacks``).
Prints one row per side: the medians, their ratio, and the median of the ratios of
each traced block to the untraced block beside it ("paired": on a loaded machine
the load moves both alike); the target is <= 10 % more CPU per call with the trace
open.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

_GC = [0, 0, 0]


def _count_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC[info["generation"]] += 1


def _gc_watch() -> list:
    """On a worker: count collections by generation from now on; the counts so far."""
    if _count_gc not in gc.callbacks:
        gc.callbacks.append(_count_gc)
    return list(_GC)


def _probe(rpc, peer: str) -> tuple[float, float, list, list]:
    return (common.cpu_seconds(), rpc.rpc_sync(peer, common.cpu_seconds), _gc_watch(),
            rpc.rpc_sync(peer, _gc_watch))


def _block(rpc, calls: int, traced: bool, path: str) -> dict:
    import torch

    import distgrad
    x = torch.ones(4)
    if traced:
        distgrad.trace.start(path)
    c0, p0, g0, h0 = _probe(rpc, "worker1")
    for _ in range(calls):
        rpc.rpc_sync("worker1", torch.add, args=(x, 1))
    c1, p1, g1, h1 = _probe(rpc, "worker1")
    if traced:
        distgrad.trace.stop()
    return {"caller_us": (c1 - c0) / calls * 1e6, "callee_us": (p1 - p0) / calls * 1e6,
            "caller_gc": [b - a for a, b in zip(g0, g1)], "callee_gc": [b - a for a, b in zip(h0, h1)]}


def workload(rpc, calls: int = 3000, rounds: int = 4) -> dict:
    """worker0's body: alternating untraced and traced blocks (see the module's docstring)."""
    import torch
    path = os.path.join(tempfile.mkdtemp(prefix="distgrad-trace-bench-"), "t.json")
    for _ in range(300):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(4), 1))
    _block(rpc, 200, True, path)  # warm the tracing code too
    out: dict = {"off": [], "on": []}
    for i in range(rounds):
        for traced in ((False, True) if i % 2 == 0 else (True, False)):
            out["on" if traced else "off"].append(_block(rpc, calls, traced, path))
    out["trace_bytes"] = os.path.getsize(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    import functools
    res = common.run_cluster("distgrad", 2, functools.partial(workload, calls=args.calls,
                                                              rounds=args.rounds), timeout=600)
    print(f"rpc_sync(worker1, torch.add, (ones(4), 1)), {args.calls} calls x {args.rounds} blocks "
          f"each way, medians (message path: {'pure' if os.environ.get('DISTGRAD_PURE') else 'default'})")
    print(f"{'side':<8}{'off us/call':>13}{'on us/call':>13}{'on/off':>9}{'paired':>9}"
          "   gc off -> on (gen0,1,2)")
    for side in ("caller", "callee"):
        off = statistics.median(b[f"{side}_us"] for b in res["off"])
        on = statistics.median(b[f"{side}_us"] for b in res["on"])
        # each traced block against the untraced one next to it: the load moves both alike
        paired = statistics.median(a[f"{side}_us"] / b[f"{side}_us"] for a, b in zip(res["on"], res["off"]))
        goff = [sum(b[f"{side}_gc"][g] for b in res["off"]) for g in range(3)]
        gon = [sum(b[f"{side}_gc"][g] for b in res["on"]) for g in range(3)]
        print(f"{side:<8}{off:>13.1f}{on:>13.1f}{on / off:>8.2f}x{paired:>8.2f}x   {goff} -> {gon}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
