#!/usr/bin/env python
"""Cost of encryption (DISTGRAD_ENCRYPT=1: AES-256-GCM per frame) on distgrad: latency and
bandwidth of rpc_sync between 2 workers, plain vs encrypted, as ratios.

    python bench/crypto_bench.py [--quick]

Both runs use the cluster secret (MAC'd messages); only encryption differs.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
for _p in (_BENCH_DIR, os.path.dirname(_BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402


def _identity(x):
    return x


def _measure(rpc, quick):
    import torch
    reps = 300 if quick else 2000
    for _ in range(50):
        rpc.rpc_sync("worker1", _identity, args=(1,))
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        rpc.rpc_sync("worker1", _identity, args=(1,))
        lat.append(time.perf_counter() - t)
    out = {"lat_p50_us": statistics.median(lat) * 1e6,
           "lat_p99_us": sorted(lat)[int(0.99 * len(lat))] * 1e6}
    for label, nbytes, n in (("64KB", 64 << 10, 200), ("1MB", 1 << 20, 60), ("16MB", 16 << 20, 10)):
        n = max(3, n // (4 if quick else 1))
        x = torch.ones(nbytes // 4)
        rpc.rpc_sync("worker1", _identity, args=(x,))
        t = time.perf_counter()
        for _ in range(n):
            rpc.rpc_sync("worker1", _identity, args=(x,))
        # request + reply carry the tensor: 2 * nbytes per call
        out[f"bw_{label}_MBps"] = 2 * nbytes * n / (time.perf_counter() - t) / 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("DISTGRAD_SECRET", "crypto-bench")
    res = {}
    for mode in ("plain", "aes-gcm"):
        os.environ["DISTGRAD_ENCRYPT"] = "1" if mode == "aes-gcm" else "0"
        res[mode] = common.run_cluster("distgrad", 2, functools.partial(_measure, quick=a.quick),
                                       timeout=600)
    keys = ["lat_p50_us", "lat_p99_us", "bw_64KB_MBps", "bw_1MB_MBps", "bw_16MB_MBps"]
    print(f"{'metric':16} {'plain':>10} {'AES-GCM':>10} {'AES-GCM/plain':>14}")
    for k in keys:
        p, c = res["plain"][k], res["aes-gcm"][k]
        print(f"{k:16} {p:10.1f} {c:10.1f} {c / p:14.2f}")


if __name__ == "__main__":
    main()
