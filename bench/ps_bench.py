#!/usr/bin/env python
"""Parameter-server training throughput: torch.distributed.rpc vs distgrad.

    python bench/ps_bench.py [--impl torch,distgrad] [--steps 100] [--warmup 10] [--json out.json]

For each implementation a fresh 3-process cluster is spawned on 127.0.0.1
(common.run_cluster): worker0 is the parameter server and holds a small MLP
(64 -> 128 -> 128 -> 10, 26k parameters); worker1 and worker2 are trainers.
Each trainer builds its own DistributedOptimizer(SGD) over the server's
parameters and runs ``--warmup`` then ``--steps`` timed steps of:

    with dist_autograd.context() as cid:
        params = rpc_sync("worker0", pull_parameters)   # views: grads flow back
        loss = cross_entropy(mlp(params, x), y)          # local forward, batch 32
        dist_autograd.backward(cid, [loss])
        opt.step(cid)                                    # SGD step on worker0

Both trainers run at once against the same server. Figures: aggregate steps/s
(both trainers' timed steps / wall time from the first timed step to the last
one finished), per-trainer median step time, and its p90. The torch column uses
torch.distributed.rpc/autograd and torch.distributed.optim.DistributedOptimizer
(TorchScript functional SGD); the distgrad column the three distgrad imports.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
from common import Metric  # noqa: E402

IN, HIDDEN, OUT, BATCH = 64, 128, 10, 32
# a step's phases, timed on the trainer: pull the parameters (rpc_sync), the local
# forward and loss, dist_autograd.backward, DistributedOptimizer.step, the context's exit
PHASES = ("pull", "forward", "backward", "optimizer", "release")
_SERVER: dict = {}


def _modules(rpc):
    """(rpc, dist_autograd, DistributedOptimizer) of the implementation of ``rpc``."""
    if rpc.__name__.startswith("torch."):
        import torch.distributed.autograd as dist_autograd
        from torch.distributed.optim import DistributedOptimizer
    else:
        import distgrad.autograd as dist_autograd
        from distgrad.optim import DistributedOptimizer
    return dist_autograd, DistributedOptimizer


def _rpc_module(name):
    import importlib
    return importlib.import_module(name)


# -- server side --------------------------------------------------------------
def _model():
    import torch
    if "model" not in _SERVER:
        torch.manual_seed(0)
        _SERVER["model"] = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    return _SERVER["model"]


def param_rrefs(rpc_name):
    rpc = _rpc_module(rpc_name)
    return [rpc.RRef(p) for p in _model().parameters()]


def pull_parameters():
    # views, so that gradients flow back to the server on both implementations: torch
    # sends an nn.Parameter as a new leaf, with no autograd link (distgrad too, since
    # it matches torch there); with the Parameters themselves torch's backward never
    # reached the server and its trainers did not train (the loss did not fall)
    return [p.view_as(p) for p in _model().parameters()]


# -- trainer side -------------------------------------------------------------
def _forward(params, x):
    import torch
    h = x
    for i in range(0, len(params), 2):
        h = h @ params[i].t() + params[i + 1]
        if i + 2 < len(params):
            h = torch.relu(h)
    return h


def trainer(rpc_name, seed, warmup, steps, trace=None):
    """Runs on a trainer (called by worker0 through rpc_async); returns its timings.
    ``trace``: a path where this trainer records its timed steps with distgrad.trace."""
    import torch
    import torch.nn.functional as F
    rpc = _rpc_module(rpc_name)
    dist_autograd, DistributedOptimizer = _modules(rpc)
    torch.set_num_threads(1)
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("worker0", param_rrefs, args=(rpc_name,)),
                               lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(8, BATCH, IN, generator=gen)
    ys = torch.randint(0, OUT, (8, BATCH), generator=gen)
    times, losses, phases = [], [], {}
    t_start = cpu_start = None
    for i in range(warmup + steps):
        if i == warmup:
            server_cpu_start = rpc.rpc_sync("worker0", common.cpu_seconds)
            if trace:
                import distgrad
                distgrad.trace.start(trace)
            t_start = time.time()
            cpu_start = common.cpu_seconds()
        pc = time.perf_counter
        t0 = pc()
        with dist_autograd.context() as cid:
            params = rpc.rpc_sync("worker0", pull_parameters)
            t1 = pc()
            loss = F.cross_entropy(_forward(params, xs[i % 8]), ys[i % 8])
            t2 = pc()
            dist_autograd.backward(cid, [loss])
            t3 = pc()
            opt.step(cid)
            t4 = pc()
        t5 = pc()
        if i >= warmup:
            if trace and i == warmup + steps - 1:
                distgrad.trace.stop()
            times.append(t5 - t0)
            losses.append(loss.item())
            for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases.setdefault(k, []).append(v)
    return {"start": t_start, "end": time.time(), "times": times,
            "cpu": common.cpu_seconds() - cpu_start, "phases": phases,
            "server_cpu": (server_cpu_start, rpc.rpc_sync("worker0", common.cpu_seconds)),
            "loss_first": losses[0], "loss_last": losses[-1]}


def ps_workload(rpc, warmup=10, steps=100, trace=None):
    """Runs on worker0 (the server): starts both trainers and waits for them
    (``trace``: trainer1 records its timed steps there, distgrad only)."""
    import ps_bench
    import torch
    torch.set_num_threads(1)
    ps_bench._model()
    futs = [rpc.rpc_async(f"worker{r}", ps_bench.trainer,
                          args=(rpc.__name__, r, warmup, steps, trace if r == 1 else None))
            for r in (1, 2)]
    res = [f.wait() for f in futs]
    # the server's CPU from the first trainer's first timed step to the last one's end
    server_cpu = (max(r["server_cpu"][1] for r in res) - min(r["server_cpu"][0] for r in res))
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    times = sorted(t for r in res for t in r["times"])
    return {
        "steps_per_s": len(times) / wall,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_p90": times[int(0.9 * (len(times) - 1))] * 1e3,
        "loss_first": statistics.mean(r["loss_first"] for r in res),
        "loss_last": statistics.mean(r["loss_last"] for r in res),
        "steps": len(times),
        **{f"{k}_us_median": statistics.median(v for r in res for v in r["phases"][k]) * 1e6
           for k in PHASES},
        # CPU per timed step, the server's and a trainer's: with 3 processes on 2 cores
        # it bounds the throughput (torch's figures include its busy polling)
        "server_cpu_us_per_step": server_cpu / len(times) * 1e6,
        "trainer_cpu_us_per_step": sum(r["cpu"] for r in res) / len(times) * 1e6,
    }


def metrics():
    return [
        Metric("steps_per_s", "aggregate throughput, 2 trainers", "steps/s", "higher", ".1f"),
        Metric("step_ms_median", "step time median", "ms", "lower", ".2f"),
        Metric("step_ms_p90", "step time p90", "ms", "lower", ".2f"),
        *(Metric(f"{k}_us_median", f"phase: {k}, median", "us", "lower", ".0f")
          for k in PHASES),
        Metric("server_cpu_us_per_step", "server CPU per step served", "us", "lower", ".0f"),
        Metric("trainer_cpu_us_per_step", "trainer CPU per step", "us", "lower", ".0f"),
        Metric("loss_first", "loss, first timed step", "", "lower", ".3f"),
        Metric("loss_last", "loss, last timed step", "", "lower", ".3f"),
        Metric("init_rpc_s", "init_rpc time", "s", "lower", ".2f"),
    ]


def main(argv=None):
    import functools
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="torch,distgrad", help="comma list: torch, distgrad")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per trainer")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per trainer first")
    ap.add_argument("--timeout", type=float, default=300.0, help="per implementation, seconds")
    ap.add_argument("--json", metavar="PATH", help="dump results as JSON")
    a = ap.parse_args(argv)
    impls = [s.strip() for s in a.impl.split(",") if s.strip()]
    results = {}
    for impl in impls:
        print(f"[ps_bench] {impl}: 1 server + 2 trainers, {a.warmup}+{a.steps} steps each ...",
              flush=True)
        try:
            results[impl] = common.run_cluster(
                impl, 3, functools.partial(ps_workload, warmup=a.warmup, steps=a.steps),
                timeout=a.timeout)
        except Exception:
            print(f"[ps_bench] {impl} FAILED:\n{traceback.format_exc()}", flush=True)
    print()
    common.print_table(metrics(), results, impls=impls)
    if "torch" in results and "distgrad" in results:
        r = results["distgrad"]["steps_per_s"] / results["torch"]["steps_per_s"]
        print(f"\nthroughput ratio distgrad/torch: {r:.2f}x (higher is better for distgrad)")
    if a.json:
        common.dump_json(a.json, results)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
