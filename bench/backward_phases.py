#!/usr/bin/env python
"""Where a local ``dist_autograd.backward`` spends its time, phase by phase.

    python bench/backward_phases.py [--depths 30,1800] [--reps 200,6] [--json out.json]

One worker (world_size 1), ``depth`` x (Linear(16,16) + Tanh), batch 4 (the
graph_size workload's model: 5 autograd nodes a layer). Each repetition runs a
fresh forward and ``dist_autograd.backward(cid, [loss])``, then
``get_gradients``, then a fresh forward and a plain ``loss.backward()``. Every
phase is timed by wrapping the function that does it (wrapper cost: about 1 us a
call), so the same script measures any commit of distgrad:

- ``walk``: building the pass's share (``PassState.__init__``: the walk);
- ``engine``: torch's engine call(s) (``_engine_run_backward``);
- ``context``: taking results into the context (``accumulate_fresh``);
- ``gc``: the cyclic collector, wherever it ran in the repetition;
- ``other``: the rest of ``backward`` (Python around the phases);
- ``get_gradients`` (not part of backward).

Figures are microseconds per repetition, means over the repetitions.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_BENCH_DIR))


def _wrap(owner, name: str, key: str, totals: collections.Counter) -> bool:
    fn = getattr(owner, name, None)
    if fn is None:
        return False

    def timed(*args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter_ns() - t

    setattr(owner, name, timed)
    return True


def measure(depths: list[int], reps: list[int]) -> list[dict]:
    import torch

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.autograd import share
    ctx_mod = sys.modules["distgrad.autograd.context"]

    totals: collections.Counter = collections.Counter()
    _wrap(share.PassState, "__init__", "walk", totals)
    for mod_name in ("distgrad.autograd.share", "distgrad.autograd.nodes", "distgrad.autograd.ddp"):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, "_engine_run_backward", None) is not None:
            _wrap(mod, "_engine_run_backward", "engine", totals)
    _wrap(ctx_mod.DistAutogradContext, "accumulate_fresh", "context", totals)
    gc_start: list = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter_ns()
        else:
            totals["gc"] += time.perf_counter_ns() - gc_start[0]

    gc.callbacks.append(on_gc)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    rpc.init_rpc("worker0", rank=0, world_size=1)
    rows = []
    try:
        for depth, n in zip(depths, reps):
            model = torch.nn.Sequential(*[m for _ in range(depth)
                                          for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
            x = torch.randn(4, 16)
            params = list(model.parameters())
            for warm in (True, False):
                totals.clear()
                back = grads = plain = 0
                for _ in range(2 if warm else n):
                    with dist_autograd.context() as cid:
                        loss = model(x).sum()
                        t0 = time.perf_counter_ns()
                        dist_autograd.backward(cid, [loss])
                        t1 = time.perf_counter_ns()
                        got = dist_autograd.get_gradients(cid)
                        t2 = time.perf_counter_ns()
                        assert len(got) == len(params)
                        back += t1 - t0
                        grads += t2 - t1
                    loss = model(x).sum()
                    t0 = time.perf_counter_ns()
                    loss.backward()
                    plain += time.perf_counter_ns() - t0
                    for p in params:
                        p.grad = None
            us = {k: v / n / 1e3 for k, v in totals.items()}
            row = {"depth": depth, "nodes": 5 * depth + 1, "reps": n,
                   "plain_us": plain / n / 1e3, "backward_us": back / n / 1e3,
                   "get_gradients_us": grads / n / 1e3}
            row.update({k: us.get(k, 0.0) for k in ("walk", "engine", "context", "gc")})
            row["other_us"] = row["backward_us"] - row["walk"] - row["engine"] - row["context"]
            row["ratio"] = row["backward_us"] / row["plain_us"]
            rows.append(row)
            print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) and k != "ratio" else f"{k}={v:.3f}"
                           if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
        rpc.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="30,1800")
    ap.add_argument("--reps", default="200,6")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = measure([int(d) for d in args.depths.split(",")], [int(r) for r in args.reps.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
