#!/usr/bin/env python
"""What rank 0's store in a process of its own costs (issue 42, item 3).

    python bench/store_process.py [--ops 3000] [--rounds 3]

For each way of hosting the store, the latency of a small ``get`` and of an
``add`` (the median of ``--rounds`` rounds of ``--ops`` operations each), seen
from rank 0 (its own client) and from another client (as the other ranks see
it), and how long hosting takes:

* ``in rank 0``: torch's server in the hosting process (``DISTGRAD_STORE_PROCESS=0``,
  and how every release before issue 42 hosted it);
* ``own process``: the keeper (``launch/keeper.py``): rank 0 a client of the
  server directly, the other ranks through the capping front (``launch/front.py``).

Also the keeper's memory: resident, proportional (shared pages split among the
processes that map them) and private, from /proc/<pid>/smaps_rollup.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, _ROOT)

import torch.distributed as dist  # noqa: E402

from distgrad.launch import keeper  # noqa: E402
from distgrad.launch.listen import host_store  # noqa: E402


def _latency(store, ops: int, rounds: int) -> tuple[float, float]:
    store.set("k", b"v" * 64)
    for _ in range(200):
        store.get("k")
    gets, adds = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(ops):
            store.get("k")
        gets.append((time.perf_counter() - t) / ops * 1e6)
        t = time.perf_counter()
        for _ in range(ops):
            store.add("n", 1)
        adds.append((time.perf_counter() - t) / ops * 1e6)
    return statistics.median(gets), statistics.median(adds)


def _memory(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and "kB" in line)
    except OSError:
        return "?"
    kb = {k: int(v.split()[0]) for k, v in fields.items()}
    private = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    return (f"RSS {kb.get('Rss', 0) / 1024:.0f} MiB, PSS {kb.get('Pss', 0) / 1024:.0f} MiB, "
            f"private {private / 1024:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args()
    td = timedelta(seconds=60)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    for own, port in ((False, args.port), (True, args.port + 1)):
        t = time.perf_counter()
        store = host_store("127.0.0.1", port, None, td, multi_tenant=True, own_process=own)
        hosted = time.perf_counter() - t
        other = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=td,
                              wait_for_workers=False)
        mine = _latency(store, args.ops, args.rounds)
        theirs = _latency(other, args.ops, args.rounds)
        name = "own process" if own else "in rank 0"
        print(f"{name:12}: hosting {hosted:.2f} s; rank 0 get {mine[0]:.0f} us, add {mine[1]:.0f} us; "
              f"another rank get {theirs[0]:.0f} us, add {theirs[1]:.0f} us")
        if own:
            print(f"{'':12}  the store's process: {_memory(keeper._live[port].proc.pid)}")
            del other
            keeper.let_go(store)


if __name__ == "__main__":
    main()
