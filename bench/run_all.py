#!/usr/bin/env python
"""Every workload on torch.distributed.rpc and distgrad, side by side, one table.

    python bench/run_all.py [--quick] [--repeats N] [--only a,b] [--impl torch,distgrad]
                            [--out DIR] [--timeout-factor F] [--wait-quiet LOAD]

For each workload (bench/workloads.py) and each repeat, every implementation
runs on a fresh cluster (common.run_cluster), the implementations one after
the other (their order flipped every repeat). Figures are medians over the
repeats; ratio = distgrad / torch. A workload or implementation that fails or
times out shows '-' (its error goes to the JSON and under the table); its
workers are killed. DIR/results.md and DIR/results.json are rewritten after
every cluster, so an interrupted run leaves what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
import report  # noqa: E402
from workloads import BY_NAME, WORKLOADS  # noqa: E402


def _loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _wait_quiet(below: float, limit_s: float = 900.0) -> None:
    """Wait until the 1-minute load average is under ``below`` (or ``limit_s`` passed)."""
    end = time.monotonic() + limit_s
    load = _loadavg()
    while load is not None and load[0] >= below and time.monotonic() < end:
        print(f"waiting for a quiet machine: load average {load[0]} >= {below}", flush=True)
        time.sleep(15)
        load = _loadavg()
    print(f"load average {load} at the start", flush=True)


def _meta(args, impls, names):
    import torch
    try:
        commit = subprocess.run(["git", "-C", common.REPO_ROOT, "describe", "--always",
                                 "--dirty"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "?"
    except Exception:
        commit = "?"
    try:   # compiled or interpreted (DISTGRAD_PURE=1): the workers inherit this environment
        path = subprocess.run([sys.executable, "-c", "import distgrad; print(distgrad.info()"
                               "['message_path'])"], cwd=common.REPO_ROOT, capture_output=True,
                              text=True, timeout=120).stdout.strip() or "?"
    except Exception:
        path = "?"
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "message_path": path,
            "mode": "quick" if args.quick else "full", "repeats": args.repeats,
            "impls": impls, "workloads": names, "cpus": os.cpu_count(),
            "torch": torch.__version__, "commit": commit, "argv": sys.argv[1:],
            "loadavg_before": _loadavg()}


def _write(out, meta, records, impls, workloads):
    rows = report.build_rows(workloads, records, impls)
    errors = [r for r in records if not r["ok"]]
    os.makedirs(out, exist_ok=True)
    md = report.markdown(rows, impls, meta, errors)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    common.dump_json(os.path.join(out, "results.json"),
                     report.json_safe({"meta": meta, "rows": rows, "runs": records,
                                       "errors": errors}))
    return md


def _run_one(w, impl, quick, factor):
    timeout = (w.quick_timeout if quick else w.timeout) * factor
    t0 = time.perf_counter()
    try:
        res = common.run_cluster(impl, w.world_size, w.make_fn(quick), timeout=timeout,
                                 **w.cluster)
        return {"ok": True, "result": res, "wall_s": time.perf_counter() - t0}
    except Exception as e:
        err = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return {"ok": False, "error": err[-6000:], "wall_s": time.perf_counter() - t0}


def _is_resource_tracker(pid):
    """multiprocessing's helper of this driver (exits with it): not a leak."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return True  # already gone


def _leftover_workers(marker):
    """Worker processes still alive (there should be none): kill them. Ours
    are the children still known to multiprocessing, and any process whose
    environment carries this run's marker (orphans included)."""
    left = [f"{p.name} pid={p.pid}" for p in mp.active_children()]
    for p in mp.active_children():
        p.kill()
        p.join(5)
    for pid in common.pids_with_env(marker):
        if pid != os.getpid() and not _is_resource_tracker(pid):
            left.append(f"pid={pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return left


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds run_cluster's cleanup


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None,
                    help="clusters per workload and implementation (default 3, quick 1)")
    ap.add_argument("--only", default="", help="comma list of: " + ",".join(BY_NAME))
    ap.add_argument("--impl", default="torch,distgrad", help="comma list (default both)")
    ap.add_argument("--out", default="bench-results", help="writes results.md/.json there")
    ap.add_argument("--timeout-factor", type=float, default=1.0,
                    help="multiply every workload's timeout")
    ap.add_argument("--wait-quiet", type=float, default=None, metavar="LOAD",
                    help="before starting, wait (up to 15 min) until the 1-minute load average "
                         "is below LOAD (the issue's quiet machine: 1)")
    args = ap.parse_args(argv)
    if args.wait_quiet is not None:
        _wait_quiet(args.wait_quiet)
    args.repeats = args.repeats or (1 if args.quick else 3)
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    names = [s.strip() for s in args.only.split(",") if s.strip()] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; known: {', '.join(BY_NAME)}")
    workloads = [w for w in WORKLOADS if w.name in names]
    signal.signal(signal.SIGTERM, _on_sigterm)
    marker = f"DISTGRAD_BENCH_RUN={os.getpid()}-{time.time_ns()}"
    os.environ["DISTGRAD_BENCH_RUN"] = marker.split("=", 1)[1]  # inherited by workers
    meta, records, start = _meta(args, impls, names), [], time.perf_counter()
    interrupted = None
    try:
        for w in workloads:
            for rep in range(args.repeats):
                for impl in (impls if rep % 2 == 0 else impls[::-1]):
                    print(f"[{w.name}] {impl} repeat {rep + 1}/{args.repeats}: "
                          f"{w.world_size}-worker cluster ...", flush=True)
                    rec = {"workload": w.name, "impl": impl, "repeat": rep + 1,
                           "loadavg_at_start": _loadavg()}
                    rec.update(_run_one(w, impl, args.quick, args.timeout_factor))
                    records.append(rec)
                    status = "ok" if rec["ok"] else "FAILED: " + \
                        rec["error"].strip().splitlines()[-1][:300]
                    print(f"[{w.name}] {impl} {status} ({rec['wall_s']:.1f}s)", flush=True)
                    if rec["ok"] and rec["result"].get("shutdown_warning"):
                        print(f"[{w.name}] {impl} WARNING: "
                              f"{rec['result']['shutdown_warning'][:500]}", flush=True)
                    meta["wall_s"] = time.perf_counter() - start
                    _write(args.out, meta, records, impls, workloads)
    except KeyboardInterrupt as e:
        interrupted = str(e) or "KeyboardInterrupt"
        print(f"interrupted ({interrupted}); writing what was measured", flush=True)
    meta["leaked_workers"] = _leftover_workers(marker)
    meta["loadavg_after"] = _loadavg()
    meta["wall_s"] = time.perf_counter() - start
    if interrupted:
        meta["interrupted"] = interrupted
    md = _write(args.out, meta, records, impls, workloads)
    print("\n" + md)
    print(f"wrote {os.path.join(args.out, 'results.md')} and results.json")
    if meta["leaked_workers"]:
        print(f"WARNING: killed leftover workers {meta['leaked_workers']}", flush=True)
    return 0 if any(r["ok"] for r in records) and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
