"""A reply's callback may wait for another reply read in the same read (issue 34, item 1).

worker0 chains ``f1.then(lambda f: f.value() + f2.wait())`` on two rpc_async calls to
worker1 whose replies leave worker1 back to back (a barrier), and makes one thread
read both in one read (its read is held back until both are there):

  A. a pool thread, with a request from worker1 in the same read;
  B. the main thread, waiting in rpc_sync for a reply of its own;
  P. as A, under ``torch.autograd.profiler.profile()`` (rpc_async then returns a
     future chained in C++ to the call's own, and the callback is registered on that).

torch completes every reply as a task of its own, so f2 completes while f1's
callback waits: the chain gives 3. When the completions of one read ran in turn
on one thread, f1's callback waited forever for f2, queued behind it.

Also: ``add_done_callback`` registered while the replies are being completed (the
race between a callback's registration and a thread completing replies in turn), and
what a callback sees of errors, timeouts and of a callback registered inside another.
"""
import threading
import time

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(150)

_BARRIER: list = [None]
_HOLD = [0.0]      # worker0: seconds its next read waits before reading (once)
_READ_SIZES: list = []  # worker0: messages each held-back read brought


def _noop():
    return None


def _reset(parties):
    _BARRIER[0] = threading.Barrier(parties)


def _pair(i, ping):
    _BARRIER[0].wait(20)
    if ping:  # a request to worker0 that leaves with the replies
        import distgrad.rpc as rpc
        rpc.rpc_async("worker0", _noop)
    return i


def _slow():
    _BARRIER[0].wait(20)
    time.sleep(0.3)
    return 0


def _hold_reads(t):
    """worker0: the next read (by whichever thread) waits _HOLD[0] s first, so that
    everything worker1 sends meanwhile comes in that one read; count what it brings."""
    read = t._read

    def held(conn, work):
        hold, _HOLD[0] = _HOLD[0], 0.0
        if hold:
            time.sleep(hold)
            before = len(work)
            read(conn, work)
            _READ_SIZES.append(len(work) - before + (1 if conn.owned else 0))
            return
        read(conn, work)
    t._read = held


def _chain(rank, world_size, how):
    import distgrad.rpc as rpc
    from distgrad.rpc.api import current_agent
    if rank != 0:
        return None
    _hold_reads(current_agent().transport)
    out = []
    if how == "P":   # A under the legacy profiler: rpc_async hands out a future chained in C++
        with torch.autograd.profiler.profile():
            got = _chain(rank, world_size, "A")
        return got
    for _ in range(4):
        rpc.rpc_sync("worker1", _reset, args=(2 if how == "A" else 3,))
        # the hold is armed before the calls go out: armed after them (as it was), a
        # caller stalled for the replies' round trip saw them read unheld, one per
        # read, in every round ("A": the replies leave as soon as both calls arrive)
        _HOLD[0] = 0.5
        f1 = rpc.rpc_async("worker1", _pair, args=(1, False))
        f2 = rpc.rpc_async("worker1", _pair, args=(2, how == "A"))
        chained = f1.then(lambda f, f2=f2: f.value() + f2.wait())
        done = threading.Event()
        chained.add_done_callback(lambda _, done=done: done.set())
        if how == "B":
            assert rpc.rpc_sync("worker1", _slow, timeout=30) == 0
        if not done.wait(15):
            out.append(("hung", f2.done()))
            break  # a thread of this worker is stuck for good: stop here
        out.append(chained.value())
    return out, list(_READ_SIZES)


@pytest.mark.parametrize("how", ["A", "B", "P"])
def test_reply_callback_waits_for_a_reply_read_with_it(how):
    res = run_workers(_chain, world_size=2, timeout=120, args=(how,),
                      expect_exit=set())[0]
    values, sizes = res
    assert values == [3] * 4, values
    # the shape happened: some held-back read brought both replies at once
    assert sizes and max(sizes) >= 2, sizes


def _race(rank, world_size):
    """Callbacks registered from another thread while replies of one read are being
    completed in turn: each callback waits for the next future, and every chain
    completes (a callback never runs on the thread that completes the others)."""
    import distgrad.rpc as rpc
    from distgrad.rpc.api import current_agent
    if rank != 0:
        return None
    _hold_reads(current_agent().transport)
    wrong = []
    for rnd in range(20):
        rpc.rpc_sync("worker1", _reset, args=(4,))
        futs = [rpc.rpc_async("worker1", _pair, args=(i, False)) for i in range(4)]
        _HOLD[0] = 0.2
        got = []
        done = threading.Event()

        def register(futs=futs, got=got, done=done, rnd=rnd):
            time.sleep(0.19 + 0.0005 * (rnd % 20))  # around the moment the read completes
            for i in range(3):
                futs[i].add_done_callback(
                    lambda f, nxt=futs[i + 1]: got.append(f.value() + nxt.wait()))
            futs[3].add_done_callback(lambda f: done.set())
        t = threading.Thread(target=register)
        t.start()
        t.join(20)
        ok = done.wait(15)
        deadline = time.monotonic() + 15
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        if not ok or sorted(got) != [1, 3, 5]:
            wrong.append((rnd, sorted(got)))
            break
    return wrong


def test_callbacks_registered_while_a_read_completes():
    assert run_workers(_race, world_size=2, timeout=120)[0] == []


_GO: dict = {}   # worker1: call i's reply leaves once _release(i) came


def _release(i):
    _GO.setdefault(i, threading.Event()).set()


def _slow_plus(x):
    # the reply must not leave before the caller registered its callback: a callback
    # added to a future already done runs at once on the registering thread (torch's
    # rule), the very thread the test requires it not to run on. A bare 0.3 s sleep
    # raced that registration (a caller stalled 0.3 s saw its callback on its own thread)
    assert _GO.setdefault(x, threading.Event()).wait(30), "never released"
    time.sleep(0.3)  # the reply arrives while the caller waits in wait(), holding the lock
    return x + 1


def _callback_thread(rank, world_size):
    """A done-callback runs on a pool thread once the waiter woke, never inside wait()
    on the waiting thread: a callback may need a lock the waiter holds (torch's
    markCompleted wakes the waiters, then runs the callbacks on its pool thread)."""
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    out = []
    for i in range(3):
        lock, seen, done = threading.Lock(), {}, threading.Event()
        f = rpc.rpc_async("worker1", _slow_plus, args=(i,))

        def cb(fut, seen=seen, lock=lock, done=done):
            seen["thread"] = threading.get_ident()
            seen["locked"] = lock.acquire(timeout=10)
            if seen["locked"]:
                lock.release()
            done.set()
        f.add_done_callback(cb)
        assert not f.done()   # registered before the reply (which waits for _release)
        rpc.rpc_sync("worker1", _release, args=(i,))
        with lock:
            value = f.wait()
        out.append((value, done.wait(20) and seen["locked"], seen.get("thread") != threading.get_ident()))
    return out


def test_done_callback_never_runs_inside_wait():
    assert run_workers(_callback_thread, world_size=2, timeout=120)[0] == [
        (1, True, True), (2, True, True), (3, True, True)]


def _boom():
    raise ValueError("remote boom")


def _late(i, seconds):
    time.sleep(seconds)
    return i


def _error_of(fut):
    try:
        fut.wait()
        return None
    except Exception as e:  # noqa: BLE001 - the observation
        return f"{type(e).__name__}: {e}"


def _callback_facts(rank, world_size):
    """Errors and timeouts as a callback sees them, as under torch (checked there by
    the audit of issue 34): a then() callback that raises fails the chained future with
    its error; a remote error reaches then()'s callback as wait() raising; a timeout
    reaches add_done_callback; a callback registered from inside another future's
    callback, both replies in flight, runs."""
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    out = {}
    chained = rpc.rpc_async("worker1", _late, args=(1, 0.1)).then(lambda f: 1 / 0)
    out["raising then"] = _error_of(chained)
    seen = []
    rpc.rpc_async("worker1", _boom).then(lambda f: seen.append(_error_of(f))).wait()
    out["remote error"] = seen
    seen, done = [], threading.Event()
    rpc.rpc_async("worker1", _late, args=(1, 3.0), timeout=0.2).add_done_callback(
        lambda f: (seen.append(_error_of(f)), done.set()))
    out["timeout"] = (done.wait(20), seen)
    seen, done = [], threading.Event()
    f1 = rpc.rpc_async("worker1", _late, args=(1, 0.2))
    f2 = rpc.rpc_async("worker1", _late, args=(2, 0.4))
    f1.add_done_callback(lambda a: f2.add_done_callback(
        lambda b: (seen.append(a.value() + b.value()), done.set())))
    out["nested"] = (done.wait(20), seen)
    return out


def test_callbacks_see_errors_timeouts_and_nested_registrations():
    out = run_workers(_callback_facts, world_size=2, timeout=120)[0]
    assert out["raising then"] and "division by zero" in out["raising then"], out
    assert len(out["remote error"]) == 1 and "remote boom" in out["remote error"][0], out
    done, seen = out["timeout"]
    assert done and len(seen) == 1 and seen[0] is not None, out   # wait() raised in it
    assert out["nested"] == (True, [3]), out
