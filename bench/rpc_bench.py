#!/usr/bin/env python
"""Side-by-side RPC micro-benchmark: torch.distributed.rpc vs distgrad.rpc.

    python bench/rpc_bench.py [--impl torch,distgrad] [--quick] [--json out.json]

For each implementation a fresh 2-worker cluster is spawned on 127.0.0.1
(see common.run_cluster); rank 0 ("worker0") drives the workload against
"worker1".  The rpc module is imported only inside the spawned workers.
See bench/README.md for what each figure means.
"""
from __future__ import annotations

import argparse
import functools
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

BW_SIZES = [
    # (label, bytes, reps, quick_reps)
    ("4KB", 4 * 1024, 200, 50),
    ("1MB", 1024 * 1024, 50, 10),
    ("16MB", 16 * 1024 * 1024, 10, 4),
    ("128MB", 128 * 1024 * 1024, 4, 2),
]


def identity(x):
    """RPC target for the bandwidth test (module-level => pickled by ref)."""
    return x


def _percentile(sorted_vals, q):
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def measure_idle_cpu(rpc, quick=False):
    """Idle CPU (% of a core) of worker0 and worker1 while the cluster sleeps."""
    dst = common.worker_name(1)
    res = {}
    peer_pid = rpc.rpc_sync(dst, os.getpid)
    idle_s = 2.0 if quick else 5.0
    # let start-up work settle (the workers' first seconds still import and warm up
    # lazily; an idle cluster is what is measured)
    time.sleep(2.0)
    if common.can_read_proc_cpu():
        me = os.getpid()
        c1_0, c0_0 = common.proc_cpu_seconds(peer_pid), common.proc_cpu_seconds(me)
        w0 = time.perf_counter()
        time.sleep(idle_s)
        wall = time.perf_counter() - w0
        c1_1, c0_1 = common.proc_cpu_seconds(peer_pid), common.proc_cpu_seconds(me)
        res["idle_cpu_method"] = "proc"
    else:  # fallback: ask worker1 itself (costs 2 tiny RPCs)
        c1_0 = rpc.rpc_sync(dst, time.process_time)
        c0_0 = time.process_time()
        w0 = time.perf_counter()
        time.sleep(idle_s)
        wall = time.perf_counter() - w0
        c1_1 = rpc.rpc_sync(dst, time.process_time)
        c0_1 = time.process_time()
        res["idle_cpu_method"] = "process_time-rpc"
    res["idle_cpu_worker1_pct"] = 100.0 * (c1_1 - c1_0) / wall
    res["idle_cpu_worker0_pct"] = 100.0 * (c0_1 - c0_0) / wall
    res["idle_window_s"] = wall
    return res


def measure_latency(rpc, quick=False):
    """rpc_sync(worker1, torch.add, (ones(4), 1)) round trips: median/p99/min."""
    import torch
    dst = common.worker_name(1)
    n = 300 if quick else 2000
    warm = 50 if quick else 200
    t = torch.ones(4)
    for _ in range(warm):
        out = rpc.rpc_sync(dst, torch.add, args=(t, 1))
    assert torch.equal(out, t + 1), out
    samples = []
    pc = time.perf_counter_ns
    cpu0 = common.cluster_cpu_seconds(rpc, [dst])
    for _ in range(n):
        s = pc()
        rpc.rpc_sync(dst, torch.add, args=(t, 1))
        samples.append(pc() - s)
    cpu = common.cluster_cpu_seconds(rpc, [dst]) - cpu0
    samples.sort()
    return {"lat_n": n,
            "lat_cpu_us_per_call": cpu / n * 1e6,
            "lat_median_us": statistics.median(samples) / 1e3,
            "lat_p99_us": _percentile(samples, 0.99) / 1e3,
            "lat_min_us": samples[0] / 1e3}


def measure_bandwidth(rpc, quick=False, sizes=None):
    """Round-trip bandwidth of rpc_sync(worker1, identity, (x,)) per size label
    (``sizes``: labels of BW_SIZES to run, default all)."""
    # Refer to `identity` through the importable module name `rpc_bench`
    # (not __main__/__mp_main__) so the callee can unpickle it.
    import rpc_bench
    import torch
    dst = common.worker_name(1)
    pc = time.perf_counter_ns
    res = {}
    for label, nbytes, reps, qreps in BW_SIZES:
        if sizes is not None and label not in sizes:
            continue
        reps = qreps if quick else reps
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        y = rpc.rpc_sync(dst, rpc_bench.identity, args=(x,))  # warmup
        assert y.shape == x.shape and y.dtype == x.dtype
        del y
        times = []
        for _ in range(reps):
            s = pc()
            y = rpc.rpc_sync(dst, rpc_bench.identity, args=(x,))
            times.append(pc() - s)
            del y
        med_s = statistics.median(times) / 1e9
        res[f"bw_{label}_MBps"] = 2 * nbytes / med_s / 1e6
        res[f"bw_{label}_median_ms"] = med_s * 1e3
        res[f"bw_{label}_reps"] = reps
        del x
    return res


def rpc_workload(rpc, quick=False, parts=("idle", "latency", "bandwidth"),
                 sizes=None):
    """Runs on rank 0 (worker0) with the implementation's rpc module: the
    selected parts, idle CPU first (while the cluster is fresh and idle)."""
    res = {"quick": quick}
    if "idle" in parts:
        res.update(measure_idle_cpu(rpc, quick))
    if "latency" in parts:
        res.update(measure_latency(rpc, quick))
    if "bandwidth" in parts:
        res.update(measure_bandwidth(rpc, quick, sizes))
    return res


def metrics():
    ms = [
        Metric("lat_median_us", "latency median rpc_sync(torch.add, ones(4))", "us", "lower"),
        Metric("lat_p99_us", "latency p99", "us", "lower"),
    ]
    for label, _, _, _ in BW_SIZES:
        ms.append(Metric(f"bw_{label}_MBps", f"bandwidth round-trip {label}",
                         "MB/s", "higher", ".0f"))
    ms += [
        Metric("idle_cpu_worker1_pct", "idle CPU worker1 (callee)", "% core", "lower"),
        Metric("idle_cpu_worker0_pct", "idle CPU worker0 (driver)", "% core", "lower"),
        Metric("init_rpc_s", "init_rpc time (rank 0)", "s", "lower", ".2f"),
        Metric("shutdown_s", "shutdown time (rank 0)", "s", "lower", ".2f"),
    ]
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="torch,distgrad",
                    help="comma-separated: torch, distgrad (default both)")
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--json", metavar="PATH", help="dump results as JSON")
    ap.add_argument("--timeout", type=float, default=None,
                    help="per-implementation cluster timeout in s "
                         "(default 300, --quick 150)")
    args = ap.parse_args(argv)
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    timeout = args.timeout or (150.0 if args.quick else 300.0)

    # Import ourselves under the importable name so the worker_fn pickles as
    # `rpc_bench.rpc_workload`, not `__main__.rpc_workload`.
    import rpc_bench

    results, errors = {}, {}
    for impl in impls:
        print(f"[{impl}] spawning 2-worker cluster "
              f"({common.impl_module_name(impl)}) ...", flush=True)
        t0 = time.perf_counter()
        try:
            results[impl] = common.run_cluster(
                impl, 2, functools.partial(rpc_bench.rpc_workload, quick=args.quick),
                timeout=timeout)
            print(f"[{impl}] done in {time.perf_counter() - t0:.1f}s", flush=True)
            if results[impl].get("shutdown_warning"):
                print(f"[{impl}] WARNING: {results[impl]['shutdown_warning']}")
        except Exception as e:  # keep going with the other implementation
            errors[impl] = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"[{impl}] FAILED after {time.perf_counter() - t0:.1f}s:\n"
                  f"{errors[impl]}", file=sys.stderr, flush=True)

    print()
    print(f"RPC benchmark ({'quick' if args.quick else 'full'}; "
          f"2 workers on 127.0.0.1, {os.cpu_count()} CPUs)")
    cols = list(dict.fromkeys(["torch", "distgrad"] + impls))
    common.print_table(metrics(), results, impls=cols)
    for impl, err in errors.items():
        last = [line for line in err.splitlines() if line.strip()]
        print(f"\n{impl}: FAILED: {last[-1] if last else err}")
    if args.json:
        common.dump_json(args.json, {"results": results, "errors": errors,
                                     "quick": args.quick, "cpus": os.cpu_count()})
        print(f"\nwrote {args.json}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
