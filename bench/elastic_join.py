#!/usr/bin/env python
"""Join and leave times of a dynamic group, torch.distributed.rpc beside distgrad.

    python bench/elastic_join.py [--joins 12] [--impls torch,distgrad] [--json out.json]

For each implementation: rank 0 starts a dynamic group (``init_rpc`` without
``world_size``, tcp:// on 127.0.0.1, rank 0 hosts the store, as torch needs);
then ``--joins`` processes join one at a time (each after the previous one's
``init_rpc`` returned), each timing its own ``init_rpc`` and doing one
``rpc_sync`` to rank 0; then they leave one at a time, each timing its own
``shutdown()``; rank 0 leaves last. Process start-up (importing torch) is not
in the figures. Prints median and max per implementation and the ratio.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rpc(impl: str):
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import distgrad.rpc as rpc
    return rpc


def _member(impl: str, rank: int, port: int, go, done, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    rpc = _rpc(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    go.wait(300)
    t0 = time.perf_counter()
    rpc.init_rpc(f"w{rank}", rank=rank, rpc_backend_options=opts)
    joined = time.perf_counter() - t0
    if rank:
        assert rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 1)).item() == 2.0
    results.put(("joined", rank, joined))
    done.wait(600)
    t0 = time.perf_counter()
    rpc.shutdown()
    results.put(("left", rank, time.perf_counter() - t0))


def run(impl: str, joins: int) -> dict:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    gos = [ctx.Event() for _ in range(joins + 1)]
    dones = [ctx.Event() for _ in range(joins + 1)]
    procs = [ctx.Process(target=_member, args=(impl, r, port, gos[r], dones[r], results), daemon=True)
             for r in range(joins + 1)]
    for p in procs:
        p.start()  # all import torch first: start-up is not measured
    time.sleep(8)
    out = {"joined": {}, "left": {}}

    def expect(kind: str, rank: int) -> None:
        deadline = time.monotonic() + 120
        while rank not in out[kind]:
            k, r, v = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[k][r] = v

    try:
        for r in range(joins + 1):
            gos[r].set()
            expect("joined", r)
        for r in list(range(1, joins + 1)) + [0]:
            dones[r].set()
            expect("left", r)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    j = [out["joined"][r] * 1e3 for r in range(1, joins + 1)]
    lv = [out["left"][r] * 1e3 for r in range(1, joins + 1)]
    return {"join_ms_median": statistics.median(j), "join_ms_max": max(j),
            "leave_ms_median": statistics.median(lv), "leave_ms_max": max(lv),
            "first_ms": out["joined"][0] * 1e3, "last_leave_ms": out["left"][0] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--joins", type=int, default=12)
    ap.add_argument("--impls", default="torch,distgrad")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("DISTGRAD_SECRET", os.urandom(16).hex())
    res = {impl: run(impl, a.joins) for impl in a.impls.split(",")}
    keys = ["join_ms_median", "join_ms_max", "leave_ms_median", "leave_ms_max", "first_ms", "last_leave_ms"]
    head = "".join(f"{i:>12s}" for i in res)
    print(f"{'metric [ms]':18s}{head}" + ("   distgrad/torch" if len(res) == 2 else ""))
    for k in keys:
        row = [res[i][k] for i in res]
        ratio = f"   {row[1] / row[0]:.2f}x" if len(row) == 2 and row[0] else ""
        print(f"{k:18s}" + "".join(f"{v:12.1f}" for v in row) + ratio)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
