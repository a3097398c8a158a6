"""No callback of an RPC future runs inside ``wait()`` on the waiting thread, whoever
registered it (issue 43, "Futures").

torch completes every reply on its RPC thread pool: ``markCompleted`` wakes the
waiters, then runs the callbacks there. A waiter may therefore hold, while it waits,
a lock that a callback takes (``with lock: fut.wait()``): ``wait()`` returns, the
waiter releases the lock, the callback gets it.

distgrad's ``RpcFuture.wait()`` reads its own reply on the waiting thread. It used
to complete the future there too whenever no callback had been registered through
``RpcFuture.then`` / ``add_done_callback``; a callback registered in C++
(``torch.futures.collect_all``, which ``wait_all`` uses too) is invisible to those,
so it ran inside ``wait()``, on the waiting thread, and could not take the lock.

Each case here: worker0 starts a call whose reply leaves only once the callbacks are
registered (worker1 waits for ``_release``), registers a callback ``cb`` that takes
a lock ``L`` (with a timeout), then waits with ``L`` held. ``cb`` must run on another
thread and get ``L``. Cases: ``then``, ``add_done_callback``, ``collect_all([f])``
with ``then`` / ``add_done_callback``, ``collect_all`` of two futures, a ``then`` on a
``collect_all`` of a ``then``; an RRef's method call (``rref.rpc_async().m()``) and
its creation future (``rref._get_future()``). ``wait_all`` (the waiter waits in
C++, through a collected future): the callback must not run on the waiting thread
(no lock held: torch runs a callback registered before ``wait_all``'s own first, so
a lock held across ``wait_all`` would block it under torch as well).

The completion that a ``wait()`` hands off is one that thread blocks on: it must not
queue behind callbacks that themselves wait for it (the callback pool full of them),
``WorkerPool.submit_now``.
"""
import threading
import time

import pytest
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(180)

_GO: dict = {}   # worker1: the reply of call ``key`` leaves once _release(key) came
_ROUNDS = 2


def _release(key):
    _GO.setdefault(key, threading.Event()).set()


def _gated(key, x):
    # the reply must not leave before worker0 registered its callback and entered
    # wait(): a callback added to a future already done runs at once on the thread
    # that adds it (torch's rule, which this test does not test)
    assert _GO.setdefault(key, threading.Event()).wait(30), "never released"
    time.sleep(0.3)  # the reply arrives while worker0 waits in wait(), holding the lock
    return x + 1


class _Box:
    def __init__(self, key=None, x=0):
        if key is not None:
            _gated(key, 0)
        self.x = x

    def plus(self, key, y):
        return _gated(key, self.x + y - 1)


_FUTURE_CASES = ("then", "add_done_callback", "collect_all.then", "collect_all.add_done_callback",
                 "collect_all of two", "collect_all of a then", "wait_all")
_RREF_CASES = ("rref.rpc_async().plus, collect_all.then", "rref.rpc_async().plus, then",
               "rref._get_future(), collect_all.add_done_callback")


def _one(rpc, case, key, lock, seen):
    """Start ``case``'s call and register ``cb``; returns (what to wait on, how, value it gives)."""
    import torch

    def cb(_f):
        rec = {"thread": threading.get_ident(), "locked": lock.acquire(timeout=3)}
        if rec["locked"]:
            lock.release()
        seen.append(rec)

    if case.startswith("rref.rpc_async()"):
        rref = rpc.remote("worker1", _Box, args=(None, 10))
        rref._get_future().wait()  # created: the method call below is the one that waits
        f = rref.rpc_async().plus(key, 1)
        expect = 11
    elif case.startswith("rref._get_future()"):
        rref = rpc.remote("worker1", _Box, args=(key, 0))
        f = rref._get_future()
        expect = None
    else:
        f = rpc.rpc_async("worker1", _gated, args=(key, 1))
        expect = 2
    if case.endswith(", then") or case == "then":
        f.then(cb)
    elif case == "add_done_callback":
        f.add_done_callback(cb)
    elif case.endswith("collect_all.then") or case == "wait_all":
        torch.futures.collect_all([f]).then(cb)
    elif case.endswith("collect_all.add_done_callback"):
        torch.futures.collect_all([f]).add_done_callback(cb)
    elif case == "collect_all of two":
        f2 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
        f2.wait()
        torch.futures.collect_all([f2, f]).then(cb)
    elif case == "collect_all of a then":
        torch.futures.collect_all([f.then(lambda g: g.value())]).then(cb)
    else:
        raise AssertionError(case)
    assert not f.done(), case  # registered before the reply (which waits for _release)
    return f, expect


def _cases(rank, world_size, cases):
    import torch

    import distgrad.rpc as rpc
    if rank != 0:
        return None
    me = threading.get_ident()
    out = {}
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))  # connections up
    for case in cases:
        for rnd in range(_ROUNDS):
            key = f"{case}/{rnd}"
            lock, seen = threading.Lock(), []
            f, expect = _one(rpc, case, key, lock, seen)
            rpc.rpc_sync("worker1", _release, args=(key,))
            t0 = time.monotonic()
            if case == "wait_all":
                value = torch.futures.wait_all([f])[0]
            else:
                with lock:
                    value = f.wait()
            waited = time.monotonic() - t0
            deadline = time.monotonic() + 20
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            rec = seen[0] if seen else {}
            # (value, cb ran, cb ran on another thread than the waiter, cb got the lock)
            out.setdefault(case, []).append(
                (value if expect is not None else None, bool(seen), rec.get("thread") != me,
                 rec.get("locked"), round(waited, 2)))
    return out


def _check(res, cases):
    wrong = {}
    for case in cases:
        expect = 11 if case.startswith("rref.rpc_async()") else None if "_get_future" in case else 2
        got = [r[:4] for r in res.get(case, [])]
        if got != [(expect, True, True, True)] * _ROUNDS:
            wrong[case] = res.get(case)
    assert not wrong, ("(value, cb ran, cb not on the waiting thread, cb got the lock the waiter "
                       f"held, wait() s) per round: {wrong}")


def test_no_callback_runs_inside_wait_of_an_rpc_async_future():
    res = run_workers(_cases, world_size=2, timeout=150, args=(_FUTURE_CASES,))[0]
    _check(res, _FUTURE_CASES)


def test_no_callback_runs_inside_wait_of_an_rref_future():
    res = run_workers(_cases, world_size=2, timeout=150, args=(_RREF_CASES,))[0]
    _check(res, _RREF_CASES)


# -- the completion a waiter blocks on never queues behind callbacks that wait -------
def _full_pool(rank, world_size):
    """worker0 (num_worker_threads=4: 4 callback threads): four calls time out, and
    their callbacks (each on a callback thread) wait for one more call, G: the first
    in G.wait(), reading G's reply itself, the three others for a callback of G. G's
    completion must not queue behind those four (they all wait for it): it runs on a
    thread of its own. (torch runs the four callbacks in turn on its timeout thread,
    and completes G on its RPC pool.)"""
    import distgrad.rpc as rpc
    from distgrad.errors import RPCTimeoutError
    if rank != 0:
        return None
    g = rpc.rpc_async("worker1", _gated, args=("G", 41))
    g_done = threading.Event()
    g.add_done_callback(lambda _: g_done.set())
    started, lock = [], threading.Lock()

    def on_timeout(f, i):
        with lock:
            started.append((threading.current_thread().name, threading.get_ident()))
        try:
            f.wait()
        except RPCTimeoutError:
            pass
        if i == 0:
            return g.wait()
        return g.value() if g_done.wait(30) else "hung"

    # worker1 has 4 threads too: these hold them 1 s only (G and _release wait meanwhile)
    chained = [rpc.rpc_async("worker1", time.sleep, args=(1.0,), timeout=0.3).then(
        lambda f, i=i: on_timeout(f, i)) for i in range(4)]
    deadline = time.monotonic() + 30
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the first is in G.wait(), reading
    rpc.rpc_sync("worker1", _release, args=("G",))
    deadline = time.monotonic() + 60
    while not all(c.done() for c in chained) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(started), [c.value() if c.done() else "hung" for c in chained]


def test_waiter_completion_does_not_queue_behind_waiting_callbacks():
    started, values = run_workers(_full_pool, world_size=2, timeout=120,
                                  options={"num_worker_threads": 4})[0]
    # the four callbacks waited at once, each on a callback thread
    assert len({i for _, i in started}) == 4, started
    assert all(n.startswith("distgrad-cb-") for n, _ in started), started
    assert values == [42] * 4, values


def test_submit_now_runs_when_every_thread_is_busy():
    from distgrad.rpc.pool import WorkerPool
    pool = WorkerPool(2, thread_name_prefix="t")
    go, ran = threading.Event(), threading.Event()
    try:
        for _ in range(3):  # two busy threads, one more task queued behind them
            pool.submit(go.wait, 20)
        pool.submit_now(ran.set)
        assert ran.wait(10)
    finally:
        go.set()
        pool.shutdown()
