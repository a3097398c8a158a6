"""A send that fails with something other than an OSError (issue 26).

The thread holding a peer's write lock seals and sends every message queued for
that peer, other threads' included. An error while sealing (here injected into
``framing.coalesce``) must neither keep the lock (every later send to the peer
would wait for it forever) nor drop the batch silently: every message of the
batch is reported, so each call fails at once with an error naming the peer,
and a reply that could not go is replaced by an error reply. An interruption
while writing (KeyboardInterrupt) may cut a message on the wire: the peer is
lost, the lock is free and the interruption reaches the caller.
"""
import threading
import time

import pytest
from mp_utils import SLOW, run_workers

from distgrad.transport import framing

pytestmark = pytest.mark.timeout(120)


def _echo(x):
    return x


def _poisoned(marker):
    """``framing.coalesce`` that fails for a message carrying ``marker``."""
    real = framing.coalesce

    def coalesce(frames):
        if any(marker in bytes(memoryview(f)) for f in frames):
            raise ValueError("injected seal failure")
        return real(frames)
    return coalesce, real


def _poison_replies():  # worker1: its replies carrying b"POISON-REPLY" cannot be sealed
    framing.coalesce = _poisoned(b"POISON-REPLY")[0]
    return True


def _outcome(fut, bound=10.0):
    """How an rpc_async future ended within ``bound`` seconds."""
    end = time.monotonic() + bound
    while not fut.done() and time.monotonic() < end:
        time.sleep(0.01)
    if not fut.done():
        return ("hung", "")
    try:
        return ("value", fut.wait())
    except Exception as e:  # noqa: BLE001 - reported
        return (type(e).__name__, str(e))


def _seal_fails(rank, world_size):
    import distgrad.rpc as rpc
    from distgrad.rpc.api import current_agent
    if rank != 0:
        return None
    seen = {}
    # a reply worker1 cannot seal comes back as an error, not as a timeout
    assert rpc.rpc_sync("worker1", _poison_replies, timeout=30)
    t0 = time.monotonic()
    try:
        seen["reply"] = ("value", rpc.rpc_sync("worker1", _echo, args=("POISON-REPLY",),
                                               timeout=30 * SLOW))
    except Exception as e:  # noqa: BLE001 - reported
        seen["reply"] = (type(e).__name__, str(e))
    seen["reply_s"] = time.monotonic() - t0

    # two threads' calls queued in one batch, while this thread holds the write lock
    conn = current_agent().transport._conns[1]
    calls = {}

    def call(tag):
        try:
            calls[tag] = rpc.rpc_async("worker1", _echo, args=(tag,), timeout=5)
        except BaseException as e:  # noqa: BLE001 - reported
            calls[tag] = e
    tags = ["POISON-CALL-a", "POISON-CALL-b"]
    threads = [threading.Thread(target=call, args=(tag,), daemon=True) for tag in tags]

    def queued():
        return sum(any(b"POISON-CALL" in bytes(memoryview(f)) for f in m) for m in list(conn.deferred))
    bad, real = _poisoned(b"POISON-CALL")
    conn.wlock.acquire()
    try:
        for th in threads:
            th.start()
        end = time.monotonic() + 20
        while queued() < 2 and time.monotonic() < end:
            time.sleep(0.01)
        seen["queued"] = queued()
        framing.coalesce = bad
    finally:
        conn.wlock.release()  # the next holder seals both
    for th in threads:
        th.join(10)
    framing.coalesce = real
    seen["threads_done"] = [not th.is_alive() for th in threads]
    free = conn.wlock.acquire(timeout=5)
    seen["lock_free"] = free
    if free:
        conn.wlock.release()
    else:  # (the code before the fix) let the process go on and report
        conn.wowner = 0
        conn.wlock.release()
    seen["calls"] = {tag: _outcome(c) if hasattr(c, "wait") else ("raised", repr(c))
                     for tag, c in calls.items()}
    # the connection still works
    seen["after"] = [rpc.rpc_sync("worker1", _echo, args=("after",), timeout=30),
                     rpc.rpc_async("worker1", _echo, args=("after too",), timeout=30).wait()]
    return seen


def test_a_batch_that_cannot_be_sealed_fails_its_calls_and_frees_the_lock():
    seen = run_workers(_seal_fails, world_size=2, timeout=100)[0]
    kind, text = seen["reply"]
    assert kind in ("DistgradError", "RuntimeError"), seen["reply"]
    assert "could not send its reply to worker worker0" in text and "injected seal failure" in text
    assert seen["reply_s"] < 25 * SLOW  # an error reply, not the call's timeout (30 s x SLOW)
    assert seen["queued"] == 2
    assert seen["threads_done"] == [True, True] and seen["lock_free"], seen
    for tag in ("POISON-CALL-a", "POISON-CALL-b"):
        kind, text = seen["calls"][tag]
        assert kind == "DistgradError", seen["calls"]
        assert "could not be sent to worker worker1 (rank 1)" in text, text
        assert "injected seal failure" in text, text
    assert seen["after"] == ["after", "after too"]


def test_an_interrupted_write_loses_the_peer_and_frees_the_lock(monkeypatch):
    from test_transport import _pair
    a, b, ha, hb = _pair(0, heartbeat_interval=60.0, heartbeat_deadline=120.0)
    try:
        hb.wait_for(0)
        conn = a._conns[1]

        def interrupted(sock, views):
            raise KeyboardInterrupt
        monkeypatch.setattr(framing, "send_some", interrupted)
        with pytest.raises(KeyboardInterrupt):
            a.send(1, [b"cut"])
        monkeypatch.undo()
        assert not conn.wlock.locked() and conn.wowner == 0
        with ha.cond:
            assert ha.cond.wait_for(lambda: ha.lost, 10)
        assert ha.lost[0][0] == 1 and "interrupted" in ha.lost[0][1], ha.lost
        a.send(1, [b"later"])  # a lost peer: dropped at once, never waits for the lock
    finally:
        a.close(0)
        b.close(0)
