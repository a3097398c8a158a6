#!/usr/bin/env python
"""Distributed autograd benchmark: torch.distributed.{rpc,autograd} vs distgrad.

    python bench/autograd_bench.py [--quick] [--impl torch,distgrad]
                                   [--only local,pipeline] [--profile] [--json out.json]

Two workloads, each run on both implementations (the rpc / dist_autograd
modules are imported by name inside the spawned workers, so the very same
workload code runs on both):

1. ``local``: a world_size-1 cluster; a deep local graph, 200 x
   (Linear(64,64) + tanh), batch 32, inside ``dist_autograd.context()``.
   Times ``dist_autograd.backward(cid, [loss])`` and plain
   ``loss.backward()`` on a fresh forward each repetition, interleaved
   (alternating which goes first); reports medians and dist/plain ratio.
2. ``pipeline``: a 3-worker cluster; worker1 holds stage1
   (Linear(256,512)+ReLU), worker2 holds stage2 (Linear(512,10)), both created
   by the driver (worker0) with ``rpc.remote`` and held by RRefs. The driver
   runs x -> stage1 -> stage2 -> cross entropy (local) -> dist_autograd.backward,
   batch 64; reports forward+backward steps/s, and with a plain SGD step on
   each stage through rpc (using ``get_gradients``) steps/s.

``--profile`` additionally runs cProfile around distgrad's
``dist_autograd.backward`` (local) and the driver's pipeline loop and prints
the top functions. See bench/README.md.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import io
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

AUTOGRAD_MODULES = {
    "torch.distributed.rpc": "torch.distributed.autograd",
    "distgrad.rpc": "distgrad.autograd",
}


def autograd_module_name(rpc_module_name: str) -> str:
    return AUTOGRAD_MODULES.get(rpc_module_name,
                                rpc_module_name.rsplit(".", 1)[0] + ".autograd")


def _dist_autograd(rpc):
    return importlib.import_module(autograd_module_name(rpc.__name__))


def _profile_text(prof, n=30, sort="tottime"):
    import pstats
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.strip_dirs().sort_stats(sort).print_stats(n)
    return s.getvalue()


# --------------------------------------------------------------------------
# 1. deep local graph
# --------------------------------------------------------------------------
def _deep_model(depth=200, width=64):
    import torch
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def local_workload(rpc, quick=False, profile=False):
    import torch
    dist_autograd = _dist_autograd(rpc)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # 2-core box; same for both implementations
    model = _deep_model()
    params = list(model.parameters())
    x = torch.randn(32, 64)
    warm, reps = (10, 60) if quick else (30, 300)
    pc = time.perf_counter_ns

    def dist_once():
        with dist_autograd.context() as cid:
            loss = model(x).sum()
            t0 = pc()
            dist_autograd.backward(cid, [loss])
            dt = pc() - t0
            g = dist_autograd.get_gradients(cid)
            assert len(g) == len(params), (len(g), len(params))
        return dt

    def plain_once():
        for p in params:
            p.grad = None
        # same setting as dist: inside a context, plain local autograd
        with dist_autograd.context():
            loss = model(x).sum()
            t0 = pc()
            loss.backward()
            dt = pc() - t0
        assert params[0].grad is not None
        for p in params:
            p.grad = None
        return dt

    # sanity: same gradients
    with dist_autograd.context() as cid:
        loss = model(x).sum()
        dist_autograd.backward(cid, [loss])
        g = dist_autograd.get_gradients(cid)
        loss2 = model(x).sum()
        loss2.backward()
        for p in params:
            assert torch.allclose(g[p], p.grad, rtol=1e-4, atol=1e-5)
            p.grad = None

    d, p_ = common.interleaved(dist_once, plain_once, warm, reps)
    ratios = sorted(a / b for a, b in zip(d, p_))  # per-pair ratio (drift-robust)
    res = {
        "local_reps": reps,
        "local_plain_ms": statistics.median(p_) / 1e6,
        "local_dist_ms": statistics.median(d) / 1e6,
        "local_plain_min_ms": min(p_) / 1e6,
        "local_dist_min_ms": min(d) / 1e6,
        "local_pair_ratio_median": statistics.median(ratios),
    }
    res["local_ratio"] = res["local_dist_ms"] / res["local_plain_ms"]
    res["local_overhead_ms"] = res["local_dist_ms"] - res["local_plain_ms"]
    if profile:
        import cProfile
        prof = cProfile.Profile()
        n = 50 if quick else 200
        for _ in range(n):
            with dist_autograd.context() as cid:
                loss = model(x).sum()
                prof.enable()
                dist_autograd.backward(cid, [loss])
                prof.disable()
        res["local_profile_calls"] = n
        res["local_profile"] = _profile_text(prof)
    return res


# --------------------------------------------------------------------------
# 2. 3-worker pipeline
# --------------------------------------------------------------------------
class Stage1:
    """Built on worker1 by rpc.remote (module-level => pickled by reference)."""

    def __init__(self):
        import torch
        torch.manual_seed(1)
        torch.set_num_threads(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU())

    def forward(self, x):
        return self.net(x)

    def parameters(self):
        return list(self.net.parameters())


class Stage2:
    def __init__(self):
        import torch
        torch.manual_seed(2)
        torch.set_num_threads(1)
        self.net = torch.nn.Linear(512, 10)

    def forward(self, x):
        return self.net(x)

    def parameters(self):
        return list(self.net.parameters())


def stage_forward(rref, x):
    """RPC target on the stage's owner: run the held module."""
    return rref.local_value().forward(x)


def stage_sgd(rref, autograd_mod, context_id, lr):
    """RPC target: a plain SGD step with this worker's grads in the context."""
    import torch
    dist_autograd = importlib.import_module(autograd_mod)
    grads = dist_autograd.get_gradients(context_id)
    with torch.no_grad():
        for p in rref.local_value().parameters():
            g = grads.get(p)
            if g is not None:
                p.add_(g, alpha=-lr)
    return len(grads)


def engine_stats(autograd_mod):
    mod = importlib.import_module(autograd_mod)
    fn = getattr(mod, "get_engine_stats", None)
    return dict(fn()) if fn is not None else None


def pipeline_workload(rpc, quick=False, profile=False):
    import autograd_bench as ab  # importable name for the RPC targets
    import torch
    import torch.nn.functional as F
    dist_autograd = _dist_autograd(rpc)
    ag_name = dist_autograd.__name__
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w1, w2 = common.worker_name(1), common.worker_name(2)
    s1 = rpc.remote(w1, ab.Stage1)
    s2 = rpc.remote(w2, ab.Stage2)
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))
    pc = time.perf_counter_ns

    def step(sgd):
        with dist_autograd.context() as cid:
            t0 = pc()
            h = rpc.rpc_sync(w1, ab.stage_forward, args=(s1, x))
            out = rpc.rpc_sync(w2, ab.stage_forward, args=(s2, h))
            loss = F.cross_entropy(out, y)
            t1 = pc()
            dist_autograd.backward(cid, [loss])
            t2 = pc()
            if sgd:
                f1 = rpc.rpc_async(w1, ab.stage_sgd, args=(s1, ag_name, cid, 0.01))
                f2 = rpc.rpc_async(w2, ab.stage_sgd, args=(s2, ag_name, cid, 0.01))
                n1, n2 = f1.wait(), f2.wait()
                assert n1 == 2 and n2 == 2, (n1, n2)
        return t1 - t0, t2 - t1, pc() - t0

    warm = 10 if quick else 30
    blocks, per_block = (3, 20) if quick else (5, 60)
    block_cap_ns = int((1.5 if quick else 3.0) * 1e9)
    t0 = pc()
    for i in range(warm):
        step(True)
        if i >= 5 and pc() - t0 > 5e9:
            break
    stats0 = {w: rpc.rpc_sync(w, ab.engine_stats, args=(ag_name,))
              for w in (w1, w2)}
    stats0["worker0"] = ab.engine_stats(ag_name)
    res = {}
    pids = [os.getpid()] + [rpc.rpc_sync(w, os.getpid) for w in (w1, w2)]
    cpu_ok = common.can_read_proc_cpu()
    for sgd in (False, True):
        key = "sgd" if sgd else "fb"
        fwd, bwd, rates = [], [], []
        cpu0 = [common.proc_cpu_seconds(p) for p in pids] if cpu_ok else None
        nsteps = 0
        for _ in range(blocks):
            t0 = pc()
            n = 0
            # time-capped blocks: distgrad's rpc.shutdown() on the idle ranks
            # gives up after 60 s (torch: 100000 s), so rank 0 must finish well
            # within that even when steps are slow.
            while n < per_block and (n < 3 or pc() - t0 < block_cap_ns):
                a, b, _c = step(sgd)
                fwd.append(a)
                bwd.append(b)
                n += 1
            rates.append(n / ((pc() - t0) / 1e9))
            nsteps += n
        if cpu_ok:
            cpu = [common.proc_cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
            res[f"pipe_{key}_cpu_ms_per_step"] = 1e3 * sum(cpu) / nsteps
            for r, c in enumerate(cpu):
                res[f"pipe_{key}_cpu_ms_per_step_w{r}"] = 1e3 * c / nsteps
        res[f"pipe_{key}_steps"] = nsteps
        res[f"pipe_{key}_steps_per_s"] = statistics.median(rates)
        res[f"pipe_{key}_steps_per_s_best"] = max(rates)
        res[f"pipe_{key}_fwd_ms"] = statistics.median(fwd) / 1e6
        res[f"pipe_{key}_bwd_ms"] = statistics.median(bwd) / 1e6
    stats1 = {w: rpc.rpc_sync(w, ab.engine_stats, args=(ag_name,)) for w in (w1, w2)}
    stats1["worker0"] = ab.engine_stats(ag_name)
    if stats1["worker0"] is not None:
        res["engine_stats_delta"] = {
            w: {k: v - (stats0[w] or {}).get(k, 0) for k, v in stats1[w].items()}
            for w in stats1}
    if profile:
        import cProfile
        prof = cProfile.Profile()
        n = 40 if quick else 150
        done, t0 = 0, pc()
        prof.enable()
        while done < n and pc() - t0 < 8e9:  # keep rank 0 well under 60 s
            step(False)
            done += 1
        prof.disable()
        n = done
        res["pipe_profile_steps"] = n
        res["pipe_profile"] = _profile_text(prof, 40)
    s1 = s2 = None  # drop the stages' RRefs before shutdown
    return res


# --------------------------------------------------------------------------
def metrics():
    return [
        Metric("local_plain_ms", "local 200x(Linear+tanh): loss.backward() median", "ms"),
        Metric("local_dist_ms", "local: dist_autograd.backward median", "ms"),
        Metric("local_overhead_ms", "local: dist - plain", "ms", fmt=".3f"),
        Metric("local_ratio", "local: dist/plain (distgrad beside torch: the ms row, "
               "target distgrad <= torch)", "x", fmt=".3f"),
        Metric("local_pair_ratio_median", "local: median of per-pair dist/plain", "x", fmt=".3f"),
        Metric("pipe_fb_steps_per_s", "pipeline fwd+bwd", "steps/s", "higher"),
        Metric("pipe_fb_steps_per_s_best", "pipeline fwd+bwd, best block", "steps/s", "higher"),
        Metric("pipe_fb_steps", "pipeline fwd+bwd steps measured", "n", "higher", "d"),
        Metric("pipe_fb_fwd_ms", "pipeline fwd (2 rpc_sync) median", "ms", fmt=".2f"),
        Metric("pipe_fb_bwd_ms", "pipeline dist_autograd.backward median", "ms", fmt=".2f"),
        Metric("pipe_fb_cpu_ms_per_step", "pipeline fwd+bwd CPU, 3 procs", "ms/step", fmt=".2f"),
        Metric("pipe_fb_cpu_ms_per_step_w0", "  of which worker0 (driver)", "ms/step", fmt=".2f"),
        Metric("pipe_fb_cpu_ms_per_step_w1", "  of which worker1 (stage1)", "ms/step", fmt=".2f"),
        Metric("pipe_fb_cpu_ms_per_step_w2", "  of which worker2 (stage2)", "ms/step", fmt=".2f"),
        Metric("pipe_sgd_steps_per_s", "pipeline fwd+bwd+SGD via rpc", "steps/s", "higher"),
        Metric("pipe_sgd_bwd_ms", "pipeline (sgd run) backward median", "ms", fmt=".2f"),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="torch,distgrad")
    ap.add_argument("--only", default="local,pipeline",
                    help="comma list of workloads: local, pipeline")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile distgrad's backward / pipeline driver")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args(argv)
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    timeout = args.timeout or (200.0 if args.quick else 400.0)
    import autograd_bench as ab

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    results = {impl: {} for impl in impls}
    errors = {}
    runs = []
    if "local" in only:
        runs.append(("local", 1, ab.local_workload))
    if "pipeline" in only:
        runs.append(("pipeline", 3, ab.pipeline_workload))
    for name, ws, fn in runs:
        for impl in impls:
            prof = args.profile and impl != "torch"
            print(f"[{impl}] {name}: {ws}-worker cluster ...", flush=True)
            t0 = time.perf_counter()
            try:
                r = common.run_cluster(
                    impl, ws, functools.partial(fn, quick=args.quick, profile=prof),
                    timeout=timeout)
                r.pop("init_rpc_s", None)
                r.pop("shutdown_s", None)
                if r.get("shutdown_warning"):
                    print(f"[{impl}] WARNING: {r.pop('shutdown_warning')}")
                results[impl].update(r)
                print(f"[{impl}] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
            except Exception as e:
                errors[f"{impl}/{name}"] = "".join(
                    traceback.format_exception_only(type(e), e)).strip()
                print(f"[{impl}] {name} FAILED:\n{errors[f'{impl}/{name}']}",
                      file=sys.stderr, flush=True)

    try:
        load_after = os.getloadavg()
    except OSError:
        load_after = None
    print()
    print(f"Autograd benchmark ({'quick' if args.quick else 'full'}; {os.cpu_count()} CPUs; "
          f"loadavg before {load and tuple(round(v, 2) for v in load)}, "
          f"after {load_after and tuple(round(v, 2) for v in load_after)})")
    cols = list(dict.fromkeys(["torch", "distgrad"] + impls))
    common.print_table(metrics(), results, impls=cols)
    for impl in impls:
        es = results[impl].get("engine_stats_delta")
        if es:
            print(f"\n{impl} engine stats during the measured pipeline steps: {es}")
    for impl in impls:
        for k in ("local_profile", "pipe_profile"):
            if results[impl].get(k):
                print(f"\n=== {impl} {k} ===")
                print(results[impl][k])
    for k, err in errors.items():
        last = [line for line in err.splitlines() if line.strip()]
        print(f"\n{k}: FAILED: {last[-1] if last else err}")
    if args.json:
        common.dump_json(args.json, {"results": results, "errors": errors,
                                     "quick": args.quick, "cpus": os.cpu_count(),
                                     "loadavg": [load, load_after]})
        print(f"\nwrote {args.json}")
    return 0 if any(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
