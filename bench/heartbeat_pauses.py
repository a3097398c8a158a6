#!/usr/bin/env python
"""The longest silences live workers show each other under load (not part of the
test suite): the measurement behind the failure detector's floor
(``heartbeat_deadline``, docs/architecture.md, "Failures").

    python bench/heartbeat_pauses.py [--workers 3] [--seconds 60] [--hogs-per-core 2]
                                     [--nice 19] [--py-loop] [--gil-hold 0.0]

Starts ``--hogs-per-core`` busy processes per core (at normal priority), then
``--workers`` distgrad workers under ``nice --nice``, with heartbeats that never
lose anyone (deadline 10,000 s). Each worker keeps calling a random peer (a
small ``rpc_sync`` every 50 ms) on one thread; with ``--py-loop`` another thread
runs a pure-Python busy loop the whole time; with ``--gil-hold S`` it runs, every
few seconds, one C call that holds the GIL for about S s (``sum(range(n))``, n
calibrated here: no heartbeat can go out meanwhile). Each worker records every
silence of at least a quarter second between two authenticated messages from
each peer (what the detector samples), and prints the longest, the 99th
percentile and their count.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH_DIR)
for _p in (_ROOT, os.path.join(_ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _noop(x):
    return x


def _calibrate(seconds: float) -> int:
    n = 1_000_000
    t0 = time.perf_counter()
    sum(range(n))
    per = (time.perf_counter() - t0) / n
    return max(1, int(seconds / per))


def _worker(rank, world_size, cfg):
    import distgrad.rpc as rpc
    os.nice(cfg["nice"])
    transport = rpc._get_current_rpc_agent().transport
    gaps: dict[int, list[float]] = {}
    detector = transport._detector
    sample = detector.sample

    def record(peer, gap):
        gaps.setdefault(peer, []).append(gap)
        sample(peer, gap)
    detector.sample = record
    stop = time.monotonic() + cfg["seconds"]
    done = threading.Event()

    def busy():
        x = 0
        while not done.is_set():
            x += 1
    threads = []
    if cfg["py_loop"]:
        threads.append(threading.Thread(target=busy, daemon=True))
    for th in threads:
        th.start()
    n = _calibrate(cfg["gil_hold"]) if cfg["gil_hold"] else 0
    rng = random.Random(rank)
    calls = 0
    next_hold = time.monotonic() + 2 + rank
    while time.monotonic() < stop:
        peer = rng.choice([r for r in range(world_size) if r != rank])
        assert rpc.rpc_sync(peer, _noop, args=(calls,), timeout=0) == calls
        calls += 1
        if n and time.monotonic() >= next_hold:
            sum(range(n))   # holds the GIL throughout
            next_hold = time.monotonic() + 3
        time.sleep(0.05)
    done.set()
    out = {}
    for peer, g in gaps.items():
        g = sorted(g)
        out[peer] = {"n": len(g), "max": g[-1], "p99": g[int(0.99 * (len(g) - 1))],
                     "deadline": detector.deadline(peer)}
    return {"calls": calls, "gaps": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--hogs-per-core", type=int, default=2)
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--py-loop", action="store_true")
    ap.add_argument("--gil-hold", type=float, default=0.0)
    args = ap.parse_args()
    from mp_utils import run_workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hogs_per_core * cores)]
    try:
        cfg = {"nice": args.nice, "seconds": args.seconds, "py_loop": args.py_loop,
               "gil_hold": args.gil_hold}
        t0 = time.monotonic()
        out = run_workers(_worker, world_size=args.workers, timeout=args.seconds + 120, args=(cfg,),
                          options={"heartbeat_deadline": 10_000.0})
        load = os.getloadavg()[0]
    finally:
        for h in hogs:
            h.send_signal(signal.SIGKILL)
        for h in hogs:
            h.wait()
    worst = max((g["max"] for o in out for g in o["gaps"].values()), default=0.0)
    print(json.dumps({"cores": cores, "hogs": len(hogs), "load_1min": round(load, 1),
                      "wall_s": round(time.monotonic() - t0, 1), "args": vars(args),
                      "workers": out, "longest_silence_s": round(worst, 3)}, indent=1))


if __name__ == "__main__":
    main()
