"""Fan-out workload: many concurrent rpc_async calls from one worker to three.

Rank 0 of a 4-worker cluster keeps ``calls`` (64) ``rpc_async`` calls in
flight per round, spread round-robin over worker1..worker3; each call sends a
256 KB float32 tensor to ``rpc_bench.identity``, which sends it back. A round
issues all calls, then waits for all of them. calls/s = calls / round time,
median over the rounds. Run it through ``bench/run_all.py --only fanout``.
"""
from __future__ import annotations

import statistics
import time

import common

CALLS = 64
NBYTES = 256 * 1024
PEERS = 3


def fanout_workload(rpc, quick=False, calls=CALLS, nbytes=NBYTES, peers=PEERS):
    """Runs on worker0 with the implementation's rpc module; returns a dict."""
    import rpc_bench  # importable name for the RPC target
    import torch

    dsts = [common.worker_name(r) for r in range(1, peers + 1)]
    x = torch.ones(nbytes // 4, dtype=torch.float32)

    def one_round():
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(dsts[i % peers], rpc_bench.identity, args=(x,))
                for i in range(calls)]
        outs = [f.wait() for f in futs]
        dt = time.perf_counter() - t0
        assert all(o.shape == x.shape for o in outs)
        return dt

    warm, rounds, cap_s = (2, 8, 5.0) if quick else (5, 30, 20.0)
    for _ in range(warm):
        one_round()
    times, start = [], time.perf_counter()
    cpu0 = common.cluster_cpu_seconds(rpc, dsts)
    while len(times) < rounds and (len(times) < 3 or time.perf_counter() - start < cap_s):
        times.append(one_round())
    cpu = common.cluster_cpu_seconds(rpc, dsts) - cpu0
    med = statistics.median(times)
    return {
        "fanout_cpu_us_per_call": cpu / (calls * len(times)) * 1e6,
        "fanout_calls_per_s": calls / med,
        "fanout_round_ms": med * 1e3,
        "fanout_MBps": 2 * calls * nbytes / med / 1e6,
        "fanout_rounds": len(times),
        "fanout_calls": calls,
        "fanout_bytes": nbytes,
    }
