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


def _one_thread() -> None:
    import torch
    torch.set_num_threads(1)


def drive(rpc, set_threads: str, steps: int) -> dict:
    """Rank 0: build the stages, time ``steps`` steps after 5 warm ones."""
    import torch
    import wide_pipeline as wp  # importable name for the RPC targets
    dist_autograd = importlib.import_module(autograd_module_name(rpc.__name__))
    w1, w2 = common.worker_name(1), common.worker_name(2)
    s1 = rpc.remote(w1, wp.Stage, args=(1, set_threads))
    s2 = rpc.remote(w2, wp.Stage, args=(2, set_threads))
    x = torch.randn(64, 1024)

    def step():
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(w1, wp.stage_forward, args=(s1, x))
            h = rpc.rpc_sync(w2, wp.stage_forward, args=(s2, h))
            dist_autograd.backward(cid, [h.pow(2).mean()])
    for _ in range(5):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return {"steps_per_s": steps / (time.perf_counter() - t)}


def run_once(impl: str, set_threads: str, steps: int, timeout: float = 300.0) -> float:
    """Steps/s of one fresh 3-worker cluster of ``impl``."""
    res = common.run_cluster(impl, 3, functools.partial(drive, set_threads=set_threads, steps=steps),
                             timeout=timeout, num_worker_threads=4,
                             prepare=_one_thread if set_threads == "main" else None)
    return res["steps_per_s"]


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
