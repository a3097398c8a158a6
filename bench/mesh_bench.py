"""Many-worker workload: init_rpc and all-to-all rounds on a 32-worker cluster.

* init_rpc time: every worker records wall-clock (start, end) of its own
  ``init_rpc`` (common.INIT_TIMES); the figure is ``max(end) - max(start)``,
  from the moment the last worker entered ``init_rpc`` to the moment the last
  one left it, so the staggered start of 32 Python processes (importing torch
  on a few cores) is not counted. Rank 0's own ``init_rpc`` wall time (which
  includes waiting for the others) is reported as ``mesh_init_rank0_s``.
* all-to-all round: worker0 asks every worker (itself included) to run
  ``a2a_member``, which sends ``rpc_async(torch.add, (ones(4), 1))`` to every
  other worker and waits for all the replies; the round ends when every
  worker finished: world * (world - 1) calls. The first round (connections
  possibly still being set up) and the median of the following rounds are
  reported separately.
Run it through ``bench/run_all.py --only mesh32``.
"""
from __future__ import annotations

import importlib
import statistics
import time

import common


def a2a_member(rpc_name, world_size):
    """RPC target on every worker: call every other worker once, concurrently."""
    import torch
    rpc = importlib.import_module(rpc_name)
    me = rpc.get_worker_info().id
    t = torch.ones(4)
    futs = [rpc.rpc_async(common.worker_name(j), torch.add, args=(t, 1))
            for j in range(world_size) if j != me]
    for f in futs:
        f.wait()
    return len(futs)


def mesh_workload(rpc, world_size=32, quick=False, prefix="mesh"):
    """Runs on worker0 with the implementation's rpc module; returns a dict."""
    import mesh_bench  # importable name for the RPC target
    others = [common.worker_name(r) for r in range(1, world_size)]

    def one_round():
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(w, mesh_bench.a2a_member, args=(rpc.__name__, world_size))
                for w in others]
        n = mesh_bench.a2a_member(rpc.__name__, world_size)
        n += sum(f.wait() for f in futs)
        assert n == world_size * (world_size - 1), n
        return time.perf_counter() - t0

    first = one_round()
    cpu0 = common.cluster_cpu_seconds(rpc, others)
    rounds = [one_round() for _ in range(2 if quick else 5)]
    cpu = common.cluster_cpu_seconds(rpc, others) - cpu0
    # init times last: fetching them first would warm rank 0's connections
    times = [common.init_times()] + [rpc.rpc_sync(w, common.init_times) for w in others]
    starts, ends = [t[0] for t in times], [t[1] for t in times]
    p = prefix
    return {
        f"{p}_world_size": world_size,
        f"{p}_init_s": max(ends) - max(starts),
        f"{p}_init_spread_s": max(starts) - min(starts),
        f"{p}_a2a_first_s": first,
        f"{p}_a2a_round_s": statistics.median(rounds),
        f"{p}_a2a_rounds": len(rounds),
        f"{p}_cpu_us_per_call": cpu / (len(rounds) * world_size * (world_size - 1)) * 1e6,
    }
