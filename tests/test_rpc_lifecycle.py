"""Lifecycle: graceful and bounded shutdown, debug info, threads, dead peers."""
import os
import signal
import threading
import time

import pytest
import torch
from mp_utils import SLOW, run_workers

import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(180)

_started = {}


def slow_echo(x, delay):
    time.sleep(delay)
    return x


def held_echo(x, delay):
    """``x``, ``delay`` s after :func:`go` was called on this worker (up to 60 s)."""
    _started.setdefault("go", threading.Event()).wait(60)
    time.sleep(delay)
    return x


def go():
    _started.setdefault("go", threading.Event()).set()


def call_back_slowly(to, value, delay):
    """Runs on worker1: start a slow call to ``to`` and return at once."""
    _started["fut"] = rpc.rpc_async(to, held_echo, args=(value, delay))
    return True


def _distgrad_threads():
    return [t.name for t in threading.enumerate() if "distgrad" in t.name]


def _lifecycle(rank, world_size):
    if rank == 0:
        assert rpc.is_available()
        assert rpc.get_worker_info() == rpc.WorkerInfo("worker0", 0)
        assert rpc.get_worker_info(None).name == "worker0"
        rpc.rpc_sync(1, torch.add, args=(1, 1))
        info = rpc._get_debug_info()
        for key in ("agent.num_pending_requests", "agent.thread_pool_size", "agent.num_idle_threads",
                    "num_owner_rrefs", "peer.worker1"):
            assert key in info, (key, info)
        assert info["agent.num_pending_requests"] == 0 and info["agent.thread_pool_size"] == 16
        assert info["peer.worker1"]["messages_sent"] >= 1 and info["peer.worker1"]["bytes_received"] > 0
        # our own slow call to worker1, and worker1's slow call to us, both in flight:
        # held until go() (a caller stalled past a fixed delay found its own call answered)
        mine = rpc.rpc_async(1, held_echo, args=("mine", 1.0))
        assert rpc.rpc_sync(1, call_back_slowly, args=(0, "theirs", 1.5))
        assert rpc._get_debug_info()["agent.num_pending_requests"] == 1
        t0 = time.monotonic()
        go()                        # theirs, served here, ends 1.5 s after this
        rpc.rpc_sync(1, go)         # mine 1 s after this
        rpc.shutdown()
        elapsed = time.monotonic() - t0
        # it waited for the calls in flight (1 s and more); the upper bound a hang guard
        assert 0.8 < elapsed < 15 * SLOW, elapsed
        assert mine.wait() == "mine"   # answered before shutdown returned
        assert _distgrad_threads() == [], _distgrad_threads()
        with pytest.raises(RuntimeError, match="not been initialized"):
            rpc._get_debug_info()
        rpc.shutdown()  # twice: quiet
        return elapsed
    if rank == 1:
        deadline = time.monotonic() + 10 * SLOW
        while "fut" not in _started and time.monotonic() < deadline:
            time.sleep(0.01)
        return _started["fut"].wait()  # worker0 answered although it was shutting down
    # rank 2: shutdown bounded by its timeout while its own call is still running
    fut = rpc.rpc_async(1, slow_echo, args=("late", 3.0 * SLOW))
    time.sleep(0.2)
    t0 = time.monotonic()
    rpc.shutdown(timeout=1.0)
    elapsed = time.monotonic() - t0
    # at its 1 s timeout, not when its call ends (3 s x SLOW, from 0.2 s before t0):
    # as much slack as that allows
    assert elapsed < 2.5 * SLOW, elapsed
    with pytest.raises(RuntimeError, match="shut down|lost|worker"):
        fut.wait()
    assert _distgrad_threads() == [], _distgrad_threads()
    return "bounded"


def test_graceful_and_bounded_shutdown():
    out = run_workers(_lifecycle, world_size=3, timeout=120)  # 22 s at load average 5
    assert out[1:] == ["theirs", "bounded"]


def sleeper(delay):
    time.sleep(delay)
    return delay


def release():
    _started["released"] = True


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def _pending_to_dead_peer(rank, world_size):
    if rank == 2:
        time.sleep(60)  # killed long before
        return None
    if rank == 1:
        rref = rpc.remote(2, torch.ones, args=(3,))
        assert rref.to_here().tolist() == [1.0] * 3
        fut = rpc.rpc_async(2, sleeper, args=(30,))
        with pytest.raises(rpc.WorkerLostError) as ei:
            fut.wait()
        assert ei.value.worker_name == "worker2" and "worker2" in str(ei.value)
        with pytest.raises(rpc.WorkerLostError, match="worker2"):
            rref.to_here()
        del rref
        deadline = time.monotonic() + 20
        while "released" not in _started and time.monotonic() < deadline:
            time.sleep(0.01)  # worker0 still talks to us after the loss
        return "ok" if "released" in _started else "not released"
    time.sleep(0.5)  # worker1's calls are in flight
    futs = [rpc.rpc_async("worker2", sleeper, args=(30,)) for _ in range(5)]
    t0 = time.monotonic()
    with pytest.raises(rpc.WorkerLostError, match="worker2") as ei:
        rpc.rpc_sync("worker2", sleeper, args=(30,), timeout=0) if rpc.rpc_async("worker2", die) else None
    assert isinstance(ei.value, RuntimeError) and ei.value.worker_name == "worker2"
    for f in futs:
        with pytest.raises(rpc.WorkerLostError, match="worker2"):
            f.wait()
    assert time.monotonic() - t0 < 15 * SLOW  # at the loss, not at the 60 s call timeout
    # later calls fail at once
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rpc.rpc_sync("worker2", sleeper, args=(0,))
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rpc.rpc_async("worker2", sleeper, args=(0,)).wait()
    assert "worker2" in rpc._get_debug_info()["agent.lost_workers"]
    # the survivors still talk
    assert rpc.rpc_sync("worker1", release) is None
    return "ok"


def test_pending_calls_to_killed_peer_fail():
    out = run_workers(_pending_to_dead_peer, world_size=3, timeout=120, graceful=False,
                      expect_exit={2})
    assert out == ["ok", "ok", None]
