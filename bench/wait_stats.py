#!/usr/bin/env python
"""How often the native wait spins, and why not: two workers, 2,000 ``rpc_sync``.

    python bench/wait_stats.py          # with DISTGRAD_SPIN_CAP_US / DISTGRAD_NATIVE_WAIT to compare

Prints one JSON line: which wait runs, microseconds per call, the caller's learned
reply-wait average and spin budget (``waiting.Budget``), and ``waiting.stats()`` over
the calls (spins asked for, refused by the gate, caught) and the callee's totals, with the
gate's view at the end (CPUs, runnable, spinners, open).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch  # noqa: E402
from mp_utils import run_workers  # noqa: E402


def _calls(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.transport import waiting
    if rank != 0:
        return None
    for i in range(200):   # warm: connections, learned budgets
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), i))
    s0 = waiting.stats()
    t0 = time.perf_counter()
    for i in range(2000):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), i))
    per_call = (time.perf_counter() - t0) / 2000 * 1e6
    s1 = waiting.stats()
    budget = rpc.api._get_current_rpc_agent().transport._reply_budget
    return {"native_wait": waiting.native_state(), "us_per_call": round(per_call, 1),
            "reply_avg_us": round(budget.avg_us, 1), "reply_budget_ns": budget.spin_ns(),
            "spins": {k: s1[k] - s0[k] for k in s1},
            "callee_spins": rpc.rpc_sync("worker1", waiting.stats),
            "gate": waiting._waitc.gate_state() if waiting.NATIVE else None}


if __name__ == "__main__":
    print(json.dumps(run_workers(_calls, world_size=2, timeout=300)[0]))
