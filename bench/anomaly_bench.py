#!/usr/bin/env python
"""What anomaly detection costs: a distributed backward with and without it.

    python bench/anomaly_bench.py [--quick] [--repeats 3] [--baseline-path DIR]

The 3-worker pipeline of ``autograd_bench`` (worker0 drives: x -> stage1 on
worker1 -> stage2 on worker2 -> cross entropy -> ``dist_autograd.backward``).
Each step's backward is timed, with anomaly mode off and on, interleaved
(alternating which goes first); medians over the steps, then over repeats.

* torch: "on" is ``torch.autograd.detect_anomaly()`` around torch's distributed
  backward (it only reaches the calling process);
* distgrad: "on" is ``dist_autograd.detect_anomaly()`` (every worker records
  forward stacks and checks every node's outputs);
* ``--baseline-path DIR``: distgrad from another checkout (e.g. a worktree of the
  commit before anomaly detection) is run as a third column, so the cost of the
  feature when it is *off* shows as the ratio off(now) / off(baseline).

Prints one table; ``--json F`` writes every repeat's figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# --baseline-path: the baseline column's workers import distgrad from there (ahead of
# this checkout, which the lines above put first)
if os.environ.get("DISTGRAD_BENCH_BASELINE"):
    sys.path.insert(0, os.environ["DISTGRAD_BENCH_BASELINE"])

import common  # noqa: E402


def anomaly_workload(rpc, quick=False):
    """Rank 0 of a 3-worker cluster: {"off_ms", "on_ms"} medians of the backward."""
    import autograd_bench as ab
    import torch
    import torch.nn.functional as F
    dist_autograd = ab._dist_autograd(rpc)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w1, w2 = common.worker_name(1), common.worker_name(2)
    s1, s2 = rpc.remote(w1, ab.Stage1), rpc.remote(w2, ab.Stage2)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    if hasattr(dist_autograd, "detect_anomaly"):
        anomaly = dist_autograd.detect_anomaly
    elif rpc.__name__.startswith("torch."):
        anomaly = lambda: torch.autograd.detect_anomaly()  # noqa: E731
    else:
        anomaly = None  # a distgrad without anomaly detection (a baseline)
    pc = time.perf_counter_ns

    def step(on):
        with (anomaly() if on else contextlib.nullcontext()), dist_autograd.context() as cid:
            h = rpc.rpc_sync(w1, ab.stage_forward, args=(s1, x))
            loss = F.cross_entropy(rpc.rpc_sync(w2, ab.stage_forward, args=(s2, h)), y)
            t0 = pc()
            dist_autograd.backward(cid, [loss])
            return pc() - t0

    import warnings
    warnings.simplefilter("ignore")  # torch's detect_anomaly warns on every entry
    modes = [False, True] if anomaly is not None else [False]
    n = 40 if quick else 200
    for _ in range(10):
        for m in modes:
            step(m)
    times = {m: [] for m in modes}
    for i in range(n):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            times[m].append(step(m))
    out = {"off_ms": statistics.median(times[False]) / 1e6, "distgrad_from": _where(dist_autograd)}
    if True in times:
        out["on_ms"] = statistics.median(times[True]) / 1e6
    return out


def _where(module) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-path", default=None,
                    help="a distgrad checkout to run as the baseline column (PYTHONPATH)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import functools
    fn = functools.partial(anomaly_workload, quick=args.quick)
    columns = [("torch", "torch", None), ("distgrad", "distgrad", None)]
    if args.baseline_path:
        path = os.path.abspath(args.baseline_path)
        columns.append(("distgrad@baseline", "distgrad", {"DISTGRAD_BENCH_BASELINE": path}))
    runs: dict = {c[0]: [] for c in columns}
    for r in range(args.repeats):
        for label, impl, env in (columns if r % 2 == 0 else columns[::-1]):
            try:
                runs[label].append(common.run_cluster(impl, 3, fn, timeout=600, env=env))
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                print(f"{label}: repeat {r} failed: {str(e)[-500:]}", file=sys.stderr)
    med = {label: {k: statistics.median([x[k] for x in rs if k in x]) for k in ("off_ms", "on_ms")
                   if any(k in x for x in rs)} for label, rs in runs.items() if rs}
    print(f"\ndistributed backward of the 3-worker pipeline, median of {args.repeats} repeats [ms]")
    print(f"{'':22} {'anomaly off':>12} {'anomaly on':>12} {'on / off':>9}")
    for label, m in med.items():
        on = m.get("on_ms")
        print(f"{label:22} {m['off_ms']:12.3f} {on if on is not None else float('nan'):12.3f} "
              f"{(on / m['off_ms']) if on else float('nan'):9.2f}x")
    if "torch" in med and "distgrad" in med:
        print(f"distgrad / torch, anomaly off: {med['distgrad']['off_ms'] / med['torch']['off_ms']:.2f}x")
    if "distgrad@baseline" in med and "distgrad" in med:
        print(f"distgrad now / baseline, anomaly off: "
              f"{med['distgrad']['off_ms'] / med['distgrad@baseline']['off_ms']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "medians": med, "load": os.getloadavg()}, f, indent=1)
    return 0 if med else 1


if __name__ == "__main__":
    sys.exit(main())
