#!/usr/bin/env python
"""Load test (not part of the test suite): 4 distgrad workers, 100,000 calls in
total with up to 1,000 in flight, mixed sizes up to 16 MB.

    python bench/load_test.py [--quick] [--calls N] [--inflight N] [--workers N]

Workers are started by tests/mp_utils.run_workers (not common.run_cluster, whose
idle ranks call shutdown at once and give up after its 60 s timeout). Every
worker drives its share of the calls (rpc_async to random peers, at most
inflight/workers outstanding each). Every reply is checked against its
request (tag, size and content checksum), each tag must come back exactly once
(no lost or duplicated reply). Rank 0 samples the resident memory (VmRSS) of
every worker every 0.25 s; memory is "stable" when the peak after warm-up
(the first 20 % of the run) exceeds the value at warm-up by less than
--rss-slack MiB.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


SIZES = [(0.90, 16, 1024), (0.09, 1024, 256 << 10), (0.01, 1 << 20, 16 << 20)]  # (share, lo, hi) bytes
ECHO_LIMIT = 64 << 10  # replies echo tensors up to this size, else a checksum


def _pick_size(rng):
    x = rng.random()
    for share, lo, hi in SIZES:
        if x < share:
            return rng.randint(lo, hi) // 4 * 4 or 4
        x -= share
    return 16


def _work(tag, t):
    import torch
    if t.numel() * 4 <= ECHO_LIMIT:
        return tag, t + 1
    return tag, (t.numel(), float(t[0]), float(t[-1]), float(t.sum(dtype=torch.float64)))


def _pid():
    return os.getpid()


def _drive(me, world, calls, inflight, seed):
    """Runs on a worker: ``calls`` calls to random peers, checked; returns stats."""
    import torch

    import distgrad.rpc as rpc
    rng = random.Random(seed)
    sem = threading.Semaphore(inflight)
    lock = threading.Lock()
    seen, errors = set(), []
    nbytes = [0]
    done = threading.Event()
    remaining = [calls]
    peers = [r for r in range(world) if r != me]

    def check(fut, tag, n, first, last, total):
        try:
            rtag, value = fut.value()
            if rtag != tag:
                raise AssertionError(f"reply for {rtag} to request {tag}")
            if isinstance(value, torch.Tensor):
                ok = value.numel() == n and float(value[0]) == first + 1 and float(value[-1]) == last + 1
            else:
                ok = value == (n, first, last, total)
            if not ok:
                raise AssertionError(f"wrong reply content for {tag}")
            with lock:
                if tag in seen:
                    raise AssertionError(f"duplicated reply {tag}")
                seen.add(tag)
        except BaseException as e:  # noqa: BLE001
            with lock:
                errors.append(repr(e))
        finally:
            sem.release()
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

    t0 = time.perf_counter()
    for i in range(calls):
        n = _pick_size(rng) // 4
        t = torch.arange(n, dtype=torch.float32) + (i % 1000)
        first, last = float(t[0]), float(t[-1])
        total = float(t.sum(dtype=torch.float64)) if n * 4 > ECHO_LIMIT else None
        tag = (me, i)
        sem.acquire()
        nbytes[0] += n * 4
        fut = rpc.rpc_async(f"worker{rng.choice(peers)}", _work, args=(tag, t), timeout=120)
        fut.add_done_callback(lambda f, tag=tag, n=n, a=first, b=last, s=total: check(f, tag, n, a, b, s))
    done.wait(600)
    elapsed = time.perf_counter() - t0
    return {"calls": calls, "replies": len(seen), "errors": errors[:5], "n_errors": len(errors),
            "lost": calls - len(seen) - len(errors), "bytes": nbytes[0], "s": elapsed}


def _rank_fn(rank, world, calls, inflight):
    """Every rank drives its share; rank 0 also samples every worker's RSS. Ranks
    wait for each other on the store before returning (and shutting down)."""
    from datetime import timedelta

    import distgrad.rpc as rpc
    store = rpc.api.current_agent().store
    samples, stop = [], threading.Event()
    if rank == 0:
        pids = [rpc.rpc_sync(f"worker{r}", _pid) for r in range(world)]

        def rss(pid):
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
            return float("nan")

        def sampler():
            while not stop.is_set():
                samples.append((time.perf_counter(), [rss(p) for p in pids]))
                stop.wait(0.25)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
    t0 = time.perf_counter()
    stats = _drive(rank, world, calls // world, max(1, inflight // world), rank)
    store.set(f"loadtest/done/{rank}", b"1")
    store.wait([f"loadtest/done/{r}" for r in range(world)], timedelta(seconds=1200))
    if rank != 0:
        return stats
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    warm_t = samples[0][0] + 0.2 * (samples[-1][0] - samples[0][0])
    warm = next(s for t, s in samples if t >= warm_t)
    after = [max(s[r] for t, s in samples if t >= warm_t) for r in range(world)]
    return {"stats": stats, "elapsed": elapsed, "rss_start": samples[0][1], "rss_warm": warm,
            "rss_peak_after_warm": after, "rss_end": samples[-1][1], "n_samples": len(samples)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--inflight", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="10,000 calls")
    ap.add_argument("--rss-slack", type=float, default=200.0, help="MiB")
    a = ap.parse_args()
    calls = 10_000 if a.quick else a.calls
    sys.path.insert(0, os.path.join(os.path.dirname(_BENCH_DIR), "tests"))
    from mp_utils import run_workers  # sets DISTGRAD_SECRET; ranks shut down when all are done
    res = run_workers(_rank_fn, world_size=a.workers, timeout=1800,
                      args=(calls, a.inflight), options={"rpc_timeout": 900})
    r = res[0]
    stats = [r["stats"]] + res[1:]
    total = sum(s["calls"] for s in stats)
    replies = sum(s["replies"] for s in stats)
    errs = sum(s["n_errors"] for s in stats)
    lost = sum(s["lost"] for s in stats)
    mb = sum(s["bytes"] for s in stats) / 1e6
    print(f"workers {a.workers}, calls {total}, in flight <= {a.inflight}, sizes 16 B .. 16 MB")
    print(f"elapsed {r['elapsed']:.1f} s, {total / r['elapsed']:.0f} calls/s, "
          f"{mb:.0f} MB of request tensors ({mb / r['elapsed']:.0f} MB/s)")
    print(f"replies checked {replies}, errors {errs}, lost {lost}, duplicated 0 (checked)")
    for s in stats:
        if s["errors"]:
            print("  errors:", s["errors"])
    print("RSS MiB per worker  start / after warm-up / peak after warm-up / end:")
    stable = True
    for w in range(a.workers):
        grow = r["rss_peak_after_warm"][w] - r["rss_warm"][w]
        stable &= grow < a.rss_slack
        print(f"  worker{w}: {r['rss_start'][w]:.0f} / {r['rss_warm'][w]:.0f} / "
              f"{r['rss_peak_after_warm'][w]:.0f} / {r['rss_end'][w]:.0f}  (growth after warm-up "
              f"{grow:+.0f})")
    ok = replies == total and errs == 0 and lost == 0 and stable
    print("RESULT:", "PASS" if ok else "FAIL", f"(memory {'stable' if stable else 'NOT stable'}, "
          f"{r['n_samples']} RSS samples)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
