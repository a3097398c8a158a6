#!/usr/bin/env python
"""Where a training step's time goes, torch beside distgrad: the attribution table.

    python bench/step_attribution.py [--only ps,pipeline,transformer] [--steps N]
                                     [--impl torch,distgrad] [--trace-dir DIR] [--json PATH]

For each workload, each implementation runs it on a fresh cluster
(common.run_cluster) with the step cut into the phases a user's code has, timed
with ``perf_counter`` on the worker that drives the step, the same code on both:

- ``ps``: bench/ps_bench.py (2 trainers, one server): pull (rpc_sync of views of
  the server's parameters), forward, ``dist_autograd.backward`` (the gradients reach
  the server), ``DistributedOptimizer.step``, the context's exit;
- ``pipeline``: bench/autograd_bench.py's 3 workers: forward (2 rpc_sync through the
  stages), backward, an SGD step on each stage (2 rpc_async), the context's exit;
- ``transformer``: bench/transformer_bench.py's 12 layers split 6+6: forward,
  backward, ``DistributedOptimizer.step``, the context's exit.

Then distgrad runs each workload once more with ``distgrad.trace`` open over the
timed steps, and the trace's critical path (the one ``distgrad trace-plot`` prints)
is summed by kind over those steps and divided by their number: compute (the
backward's regions, the optimizer), serve (a request's unpickling, running and
reply on its callee), network (a message from its send to its arrival: the kernel,
the peer's wake-up, its reading), queueing (arrived, not yet served), waiting (a
thread blocked on a reply or on the pass's end), user spans, gc pauses and what no
span covers. torch has no such trace: its column is the phases only.

Figures: medians of the phases in microseconds, and distgrad's critical path per
step in microseconds (a trace costs a few percent; its steps are slower than the
untraced ones). Run it on a quiet machine (load average under 1).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

WORKLOADS = ("ps", "pipeline", "transformer")
PHASES = {"ps": ("pull", "forward", "backward", "optimizer", "release"),
          "pipeline": ("forward", "backward", "optimizer", "release"),
          "transformer": ("forward", "backward", "optimizer", "release")}


def _trace_open(rpc, path):
    if path and not rpc.__name__.startswith("torch."):
        import distgrad
        distgrad.trace.start(path)
        return True
    return False


def _timed(rpc, step, warmup, steps, trace):
    """Run ``step()`` (returns its phase times) warmup + steps times; medians in us."""
    for _ in range(warmup):
        step()
    tracing = _trace_open(rpc, trace)
    phases: list = []
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            phases.append(step())
    finally:
        if tracing:
            import distgrad
            distgrad.trace.stop()
    wall = time.perf_counter() - t0
    cols = list(zip(*phases))
    return {"steps": steps, "step_us": wall / steps * 1e6,
            "phases_us": [statistics.median(c) * 1e6 for c in cols]}


def pipeline_run(rpc, warmup=30, steps=200, trace=None):
    """Rank 0 of 3: the pipeline of bench/autograd_bench.py, phase by phase."""
    import autograd_bench as ab
    import torch
    import torch.nn.functional as F
    dist_autograd = ab._dist_autograd(rpc)
    ag_name = dist_autograd.__name__
    torch.manual_seed(0)
    torch.set_num_threads(1)
    s1, s2 = rpc.remote("worker1", ab.Stage1), rpc.remote("worker2", ab.Stage2)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    pc = time.perf_counter

    def step():
        t0 = pc()
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync("worker1", ab.stage_forward, args=(s1, x))
            loss = F.cross_entropy(rpc.rpc_sync("worker2", ab.stage_forward, args=(s2, h)), y)
            t1 = pc()
            dist_autograd.backward(cid, [loss])
            t2 = pc()
            f1 = rpc.rpc_async("worker1", ab.stage_sgd, args=(s1, ag_name, cid, 0.01))
            f2 = rpc.rpc_async("worker2", ab.stage_sgd, args=(s2, ag_name, cid, 0.01))
            f1.wait(), f2.wait()
            t3 = pc()
        return t1 - t0, t2 - t1, t3 - t2, pc() - t3

    out = _timed(rpc, step, warmup, steps, trace)
    s1 = s2 = None
    return out


def transformer_run(rpc, warmup=5, steps=30, trace=None):
    """Rank 0 of 2: bench/transformer_bench.py's split, phase by phase."""
    import torch
    import transformer_bench as tb
    dist_autograd = tb._dist_autograd(rpc)
    torch.set_num_threads(1)
    half = tb.LAYERS // 2
    local = tb._layers(0, half)
    rref = rpc.remote("worker1", tb.Half, args=(half, tb.LAYERS - half))
    x = tb._input()
    params = [rpc.RRef(p) for p in local.parameters()]
    params += rpc.rpc_sync("worker1", tb.half_param_rrefs, args=(rref, rpc.__name__))
    opt = tb._optimizer_cls(rpc)(torch.optim.SGD, params, lr=1e-3)
    pc = time.perf_counter

    def step():
        t0 = pc()
        with dist_autograd.context() as cid:
            loss = tb._loss(rpc.rpc_sync("worker1", tb.half_forward, args=(rref, local(x))))
            t1 = pc()
            dist_autograd.backward(cid, [loss])
            t2 = pc()
            opt.step(cid)
            t3 = pc()
        return t1 - t0, t2 - t1, t3 - t2, pc() - t3

    out = _timed(rpc, step, warmup, steps, trace)
    opt = params = rref = None
    return out


def ps_run(rpc, warmup=10, steps=200, trace=None):
    """Rank 0 of 3 (the server): bench/ps_bench.py, trainer1's phases."""
    import ps_bench
    r = ps_bench.ps_workload(rpc, warmup=warmup, steps=steps, trace=trace)
    return {"steps": r["steps"], "step_us": r["step_ms_median"] * 1e3,
            "phases_us": [r[f"{k}_us_median"] for k in ps_bench.PHASES]}


RUNS = {"ps": (3, ps_run, 200), "pipeline": (3, pipeline_run, 200),
        "transformer": (2, transformer_run, 30)}


def critical_per_step(path: str, steps: int) -> dict:
    """distgrad's critical path over a trace of ``steps`` steps, by kind, us per step."""
    from distgrad.trace.critical import contributions
    from distgrad.trace.summary import summarize
    with open(path) as f:
        s = summarize(json.load(f))
    return {k: v / steps for k, v in contributions(s.path)}


def measure(name: str, impls, steps: int | None, trace_dir: str) -> dict:
    world, fn, default = RUNS[name]
    n = steps or default
    out: dict = {}
    for impl in impls:
        out[impl] = common.run_cluster(impl, world, functools.partial(fn, steps=n), timeout=600)
        print(f"[{name}] {impl}: {out[impl]['step_us']:.0f} us a step", flush=True)
    if "distgrad" in impls:
        path = os.path.join(trace_dir, f"{name}.json")
        traced = common.run_cluster("distgrad", world, functools.partial(fn, steps=n, trace=path),
                                    timeout=600)
        out["distgrad_traced"] = traced
        out["critical_us"] = critical_per_step(path, traced["steps"])
        print(f"[{name}] distgrad traced: {traced['step_us']:.0f} us a step, trace {path}",
              flush=True)
    return out


def table(name: str, r: dict) -> str:
    lines = [f"### {name}", "", "| phase | torch, us | distgrad, us | distgrad / torch |",
             "|---|---:|---:|---:|"]
    t, d = r.get("torch"), r.get("distgrad")
    for i, ph in enumerate(PHASES[name] + ("step",)):
        tv = (t["phases_us"][i] if i < len(PHASES[name]) else t["step_us"]) if t else None
        dv = (d["phases_us"][i] if i < len(PHASES[name]) else d["step_us"]) if d else None
        ratio = f"{dv / tv:.2f}x" if tv and dv else "-"
        lines.append(f"| {ph} | {tv:.0f} | {dv:.0f} | {ratio} |" if tv and dv else
                     f"| {ph} | {tv or '-'} | {dv or '-'} | - |")
    if "critical_us" in r:
        tr = r["distgrad_traced"]["step_us"]
        lines += ["", f"distgrad's critical path per step (traced: {tr:.0f} us a step):", "",
                  "| on the critical path | us per step | share |", "|---|---:|---:|"]
        total = sum(r["critical_us"].values()) or 1.0
        for k, v in sorted(r["critical_us"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {v:.0f} | {100 * v / total:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--impl", default="torch,distgrad")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default per workload)")
    ap.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    impls = [s for s in a.impl.split(",") if s]
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="distgrad-attr-")
    os.makedirs(trace_dir, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = {}
    for name in a.only.split(","):
        results[name] = measure(name, impls, a.steps, trace_dir)
    print(f"\nload average after: {os.getloadavg()}\n")
    for name, r in results.items():
        print(table(name, r))
    if a.json:
        common.dump_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
