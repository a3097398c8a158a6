"""Failure detection on real processes: kill -9, SIGSTOP, workers dying during a
distributed backward, shutdown with dead peers. Every test is bounded.

Each test returns measured latencies; run with ``-s`` to see them printed.
"""
import logging
import os
import signal
import threading
import time

import pytest
import torch
from mp_utils import SLOW, run_workers

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(90)

_state = {}

# The heartbeats these tests run with (the defaults): a silent peer with a steady history
# is lost HB_DEADLINE (the failure detector's floor) after the last byte it sent, and it
# sends one every HB_INTERVAL. A crash is seen at once, from the closed connection.
_DEFAULTS = rpc.TensorPipeRpcBackendOptions()
HB_DEADLINE, HB_INTERVAL = _DEFAULTS.heartbeat_deadline, _DEFAULTS.heartbeat_interval


# -- functions the workers run ----------------------------------------------------
def sleeper(delay, value=None):
    time.sleep(delay)
    return value if value is not None else delay


def getpid():
    return os.getpid()


def mark_done():
    _state["done"] = True


def is_valid(cid):
    return dist_autograd._is_valid_context(cid)


def _error_log():
    """Collect ERROR records (e.g. "error on the transport's reading thread") of this process."""
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))
    h = H(logging.ERROR)
    logging.getLogger("distgrad").addHandler(h)
    return records


def _outside(fn, *args):
    """Run ``fn`` on a fresh thread, outside any dist-autograd context: an RPC made
    inside ``with context()`` would carry the context and recreate it on the callee."""
    out = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    th.join()
    return out[0] if out else None


def _valid_on(worker, cid):
    return _outside(rpc.rpc_sync, worker, is_valid, (cid,))


def _wait_true(fn, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.02)
    return fn()


def _all_fail_lost(futs, name):
    for f in futs:
        with pytest.raises(rpc.WorkerLostError, match=name) as ei:
            f.wait()
        assert ei.value.worker_name == name


# -- kill -9 -------------------------------------------------------------------------
def _kill9(rank, world_size):
    errors = _error_log()
    if rank == 2:
        time.sleep(60)  # killed long before
        return None
    if rank == 1:
        fut = rpc.rpc_async(2, sleeper, args=(30,), timeout=0)
        _all_fail_lost([fut], "worker2")
        assert rpc.rpc_sync(0, torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
        return "ok"
    pid = rpc.rpc_sync(2, getpid)
    futs = [rpc.rpc_async(2, sleeper, args=(30,), timeout=0) for _ in range(5)]
    rref = rpc.remote(2, sleeper, args=(30,), timeout=0)
    time.sleep(0.3)  # in flight, being served
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _all_fail_lost(futs, "worker2")
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rref.to_here()
    latency = time.monotonic() - t0
    # from the closed connection, not the heartbeats: those would take at least
    # HB_DEADLINE - HB_INTERVAL after the kill; as much slack as that allows
    assert latency < min(1.0 * SLOW, HB_DEADLINE - HB_INTERVAL), latency
    t1 = time.monotonic()  # new calls fail at once
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rpc.rpc_sync("worker2", sleeper, args=(0,))
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rpc.rpc_async("worker2", sleeper, args=(0,)).wait()
    assert time.monotonic() - t1 < 1.0 * SLOW  # at once: not at a 60 s connect or call timeout
    assert rpc.rpc_sync(1, torch.mul, args=(torch.ones(2), 3)).tolist() == [3.0, 3.0]
    del rref
    t2 = time.monotonic()
    rpc.shutdown()  # graceful, with a dead peer
    shut = time.monotonic() - t2
    assert shut < 10 * SLOW, shut  # a hang guard: it waits for no lost peer
    assert not errors, errors
    return latency, shut


def test_kill9_fails_pending_calls_within_1s():
    out = run_workers(_kill9, world_size=3, timeout=60, expect_exit={2})
    latency, shut = out[0]
    print(f"\nkill -9 detection: {latency * 1000:.0f} ms; shutdown with a dead peer: {shut:.2f} s")
    assert out[1] == "ok"


# -- SIGSTOP -------------------------------------------------------------------------
def _sigstop(rank, world_size):
    errors = _error_log()
    if rank == 2:
        # Notice the stop as a jump of the clock, then talk to worker0: it forgot us,
        # so our call fails once our own heartbeat deadline passes.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            t = time.monotonic()
            time.sleep(0.05)
            if time.monotonic() - t > 2:
                break
        else:
            return "never stopped"
        with pytest.raises(rpc.WorkerLostError):
            rpc.rpc_sync(0, torch.add, args=(1, 1), timeout=20)
        return "ok"
    if rank == 1:
        assert _wait_true(lambda: "done" in _state, 30)
        return "ok"
    pid = rpc.rpc_sync(2, getpid)
    # replies come 1 s after the stop: later, after SIGCONT
    futs = [rpc.rpc_async(2, sleeper, args=(1.0, "late"), timeout=0) for _ in range(3)]
    sync_err = []

    def sync_call():
        try:
            rpc.rpc_sync(2, sleeper, args=(1.0, "late"), timeout=0)
        except Exception as e:  # noqa: BLE001
            sync_err.append(e)
    th = threading.Thread(target=sync_call)
    th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        # survivors keep working while it is stopped
        n = 0
        while not all(f.done() for f in futs) and time.monotonic() - t0 < HB_DEADLINE + 3 * SLOW:
            assert rpc.rpc_sync(1, torch.add, args=(torch.tensor([n]), 1)).item() == n + 1
            n += 1
            time.sleep(0.05)
        _all_fail_lost(futs, "worker2")
        latency = time.monotonic() - t0
        th.join(5 * SLOW)
        assert len(sync_err) == 1 and isinstance(sync_err[0], rpc.WorkerLostError), sync_err
        # by the heartbeats (these calls have no timeout): HB_DEADLINE after the stop,
        # the rest slack for a loaded machine
        assert latency < HB_DEADLINE + 2 * SLOW, latency
        assert n > 10, n
    finally:
        os.kill(pid, signal.SIGCONT)
    # its late replies arrive now, and are ignored
    time.sleep(1.5)
    for i in range(20):
        assert rpc.rpc_sync(1, torch.mul, args=(torch.tensor([i]), 2)).item() == 2 * i
    assert [f.done() for f in futs] == [True] * 3
    with pytest.raises(rpc.WorkerLostError, match="worker2"):
        rpc.rpc_sync(2, getpid)
    assert "worker2" in rpc._get_debug_info()["agent.lost_workers"]
    rpc.rpc_sync(1, mark_done)
    assert not errors, errors
    return latency


def test_sigstop_detected_by_heartbeats_at_the_floor():
    out = run_workers(_sigstop, world_size=3, timeout=75)
    print(f"\nSIGSTOP detection (default heartbeats): {out[0]:.2f} s")
    assert out[1:] == ["ok", "ok"]


# -- workers dying during a distributed backward ---------------------------------------
class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _state["in_backward"] = True
        time.sleep(20)  # killed long before
        return g


def c_stage(y):
    return y * 3


def b_stage(x):
    """On B: forward to C, then a slow backward on the way back."""
    out = rpc.rpc_sync(2, c_stage, args=(x * 2,))
    return SlowBackward.apply(out)


def in_backward():
    return "in_backward" in _state


def _chain_middle_killed(rank, world_size):
    if rank != 0:
        assert _wait_true(lambda: "done" in _state, 45) or rank == 1
        return "ok"
    pid_b = rpc.rpc_sync(1, getpid)
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync(1, b_stage, args=(x,)).sum()
        assert _valid_on(2, cid)  # C holds the context B's call made
        fut = dist_autograd.backward_async(cid, [loss])
        assert _wait_true(lambda: _outside(rpc.rpc_sync, 1, in_backward), 10)
        t0 = time.monotonic()
        os.kill(pid_b, signal.SIGKILL)
        with pytest.raises(rpc.WorkerLostError, match="worker1"):
            fut.wait()
        latency = time.monotonic() - t0
        # a hang guard: the closed connection fails it at once
        assert latency < 5 * SLOW, latency
        # C learns of B's death by itself and releases the context B's call made
        assert _wait_true(lambda: not _valid_on(2, cid), 10)
        released = time.monotonic() - t0
    assert rpc.rpc_sync(2, c_stage, args=(torch.ones(1),)).item() == 3.0
    rpc.rpc_sync(2, mark_done)
    return latency, released


def test_chain_middle_worker_killed_during_backward():
    out = run_workers(_chain_middle_killed, world_size=3, timeout=60, expect_exit={1})
    latency, released = out[0]
    print(f"\nchain A->B->C, B killed in backward: A's error after {latency * 1000:.0f} ms, "
          f"C's context released after {released:.2f} s")
    assert out[2] == "ok"


def c_slow(x):
    return SlowBackward.apply(x * 5)


def b_calls_c(x):
    return rpc.rpc_sync(2, c_stage, args=(x,)) + x


def _leaf_killed(rank, world_size):
    """A calls B and C, B calls C; C is killed during the backward."""
    if rank == 2:
        time.sleep(60)  # killed
        return None
    if rank == 1:
        assert _wait_true(lambda: "done" in _state, 45)
        assert rpc.rpc_sync(0, torch.add, args=(torch.ones(1), 1)).item() == 2.0
        return "ok"
    pid_c = rpc.rpc_sync(2, getpid)
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = (rpc.rpc_sync(1, b_calls_c, args=(x,)) + rpc.rpc_sync(2, c_slow, args=(x,))).sum()
        assert _valid_on(1, cid)
        fut = dist_autograd.backward_async(cid, [loss])
        assert _wait_true(lambda: _outside(rpc.rpc_sync, 2, in_backward), 10)
        t0 = time.monotonic()
        os.kill(pid_c, signal.SIGKILL)
        with pytest.raises(rpc.WorkerLostError, match="worker2"):
            fut.wait()
        latency = time.monotonic() - t0
        # a hang guard: the closed connection fails it at once
        assert latency < 5 * SLOW, latency
        # the survivor B released its share while A is still inside the block
        assert _wait_true(lambda: not _valid_on(1, cid), 10)
        released = time.monotonic() - t0
        assert dist_autograd._is_valid_context(cid)  # the creator's copy: until the block ends
    assert not dist_autograd._is_valid_context(cid)
    # the survivors still work, autograd included
    with dist_autograd.context() as cid2:
        y = rpc.rpc_sync(1, torch.mul, args=(x, 4.0)).sum()
        dist_autograd.backward(cid2, [y])
        assert dist_autograd.get_gradients(cid2)[x].tolist() == [4.0, 4.0]
    rpc.rpc_sync(1, mark_done)
    return latency, released


def test_worker_killed_during_backward():
    out = run_workers(_leaf_killed, world_size=3, timeout=60, expect_exit={2})
    latency, released = out[0]
    print(f"\nworker killed in backward: initiator's error after {latency * 1000:.0f} ms, "
          f"survivor's context released after {released:.2f} s")
    assert out[1] == "ok"


# -- shutdown when the store's host (rank 0) is dead --------------------------------------
def _store_host_killed(rank, world_size):
    if rank == 0:
        time.sleep(60)  # killed
        return None
    if rank == 2:
        pid0 = rpc.rpc_sync(0, getpid)
        fut = rpc.rpc_async(0, sleeper, args=(30,), timeout=0)
        time.sleep(0.2)
        os.kill(pid0, signal.SIGKILL)
        _all_fail_lost([fut], "worker0")
    else:
        assert _wait_true(lambda: 0 in rpc.api.current_agent().lost, 10)
    assert rpc.rpc_sync(3 - rank, torch.add, args=(rank, 1)) == rank + 1
    t0 = time.monotonic()
    rpc.shutdown()
    shut = time.monotonic() - t0
    assert shut < 10 * SLOW, shut  # a hang guard: it waits for no lost peer
    return shut


def test_shutdown_with_dead_store_host_is_bounded():
    out = run_workers(_store_host_killed, world_size=3, timeout=60, expect_exit={0})
    print(f"\nshutdown after rank 0 (store host) died: {max(out[1:]):.2f} s")
    assert out[0] is None
