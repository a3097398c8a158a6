"""Small calls kept in flight: the plainest test of the CPU a message costs (issue 27).

Rank 0 keeps ``inflight`` calls ``rpc_async(peer, torch.add, (ones(4), 1))``
outstanding per peer until ``calls`` calls returned (spread over the peers in
turn), and reports calls per second and the CPU seconds (user + system) that
every process of the cluster spent per call over that time, busy polling
included. ``run_all.py --only small_calls_1,small_calls_3`` runs it against 1
and 3 peers beside torch.
"""
from __future__ import annotations

import threading
import time

import common
import torch


def small_calls_workload(rpc, peers: int = 1, calls: int = 3000, inflight: int = 32,
                         quick: bool = False) -> dict:
    """Rank 0's body (see the module docstring)."""
    if quick:
        calls //= 3
    names = [f"worker{r}" for r in range(1, peers + 1)]
    x = torch.ones(4)
    for name in names:  # warm: connections, the pools' threads
        for _ in range(50):
            rpc.rpc_sync(name, torch.add, args=(x, 1))
    lock = threading.Lock()
    done = threading.Event()
    state = {"sent": 0, "back": 0, "bad": 0}

    def issue(name: str) -> None:
        with lock:
            if state["sent"] >= calls:
                return
            state["sent"] += 1
        fut = rpc.rpc_async(name, torch.add, args=(x, 1))
        fut.add_done_callback(lambda f, name=name: back(f, name))

    def back(fut, name: str) -> None:
        try:
            ok = fut.value().tolist() == [2.0] * 4
        except Exception:  # noqa: BLE001 - counted, reported
            ok = False
        with lock:
            state["back"] += 1
            state["bad"] += not ok
            finished = state["back"] >= calls
        if finished:
            done.set()
        else:
            issue(name)

    before = common.cluster_cpu_seconds(rpc, names)
    t0 = time.perf_counter()
    for name in names:
        for _ in range(inflight):
            issue(name)
    if not done.wait(300):
        raise TimeoutError(f"small calls: {state['back']} of {calls} returned in 300 s")
    wall = time.perf_counter() - t0
    after = common.cluster_cpu_seconds(rpc, names)
    if state["bad"]:
        raise RuntimeError(f"small calls: {state['bad']} wrong replies")
    cpu = after - before
    return {f"small_{peers}_calls_per_s": calls / wall,
            f"small_{peers}_cpu_us_per_call": cpu / calls * 1e6}
