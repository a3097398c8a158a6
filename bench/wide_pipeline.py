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
medians. See docs/measurements/2026-12-04-backward-rounds.md ("Third round").
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

_GOMP: list = []


def openmp_team() -> int | None:
    """The calling thread's OpenMP team size (``omp_get_max_threads``), read without
    initializing ATen's count on it (``torch.get_num_threads()`` would); None where
    torch's OpenMP runtime is not libgomp (macOS, Windows)."""
    if not _GOMP:
        import ctypes
        try:
            path = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
            _GOMP.append(ctypes.CDLL(path).omp_get_max_threads)
        except (OSError, StopIteration):
            _GOMP.append(None)
    return _GOMP[0]() if _GOMP[0] is not None else None


class Stage:
    def __init__(self, seed: int, set_threads: str):
        import collections

        import torch
        torch.manual_seed(seed)
        if set_threads == "ctor":
            torch.set_num_threads(1)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers)
        # the OpenMP team each forward and each backward ran with (see --set-threads ctor)
        self.teams = {"fwd": collections.Counter(), "bwd": collections.Counter()}
        self.net[0].weight.register_hook(self._count_bwd)

    def _count_bwd(self, grad):
        self.teams["bwd"][openmp_team()] += 1
        return grad


def stage_forward(rref, x):
    stage = rref.local_value()
    stage.teams["fwd"][openmp_team()] += 1
    return stage.net(x)


def stage_teams(rref) -> dict:
    return {k: dict(v) for k, v in rref.local_value().teams.items()}


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
    rate = steps / (time.perf_counter() - t)
    return {"steps_per_s": rate, "teams": [rpc.rpc_sync(w, wp.stage_teams, args=(s,))
                                           for w, s in ((w1, s1), (w2, s2))]}


def run_once(impl: str, set_threads: str, steps: int, timeout: float = 300.0) -> dict:
    """Steps/s of one fresh 3-worker cluster of ``impl``, and the OpenMP teams its
    stages' forwards and backwards ran with."""
    res = common.run_cluster(impl, 3, functools.partial(drive, set_threads=set_threads, steps=steps),
                             timeout=timeout, num_worker_threads=4,
                             prepare=_one_thread if set_threads == "main" else None)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set-threads", default="none,main,ctor")
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    for case in args.set_threads.split(","):
        got: dict[str, list[float]] = {"torch": [], "distgrad": []}
        teams: dict[str, list] = {"torch": [], "distgrad": []}
        for _ in range(args.repeats):
            for impl in got:
                res = run_once(impl, case, args.steps)
                got[impl].append(res["steps_per_s"])
                teams[impl].append(res["teams"])
        t, d = statistics.median(got["torch"]), statistics.median(got["distgrad"])
        print(f"set_num_threads(1) {case:5s}: torch {t:6.2f} steps/s {got['torch']}, "
              f"distgrad {d:6.2f} {got['distgrad']}, distgrad/torch {d / t:.2f}x", flush=True)
        for impl in teams:   # {team size: passes} per stage, forward and backward, last run
            print(f"    OpenMP team by pass, {impl:8s}: {teams[impl][-1]}", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
