"""The reading pool (distgrad/transport/leader.py) on its own, with a fake poller.

``lead`` stands for the transport's wait on its sockets: it blocks on a queue
of "ready sockets" (lists of work) and returns one, as epoll hands each ready
socket to one waiting thread. Checked: the thread that read a piece of work
runs it (no hand-off); there is always a thread reading, even with every
other thread blocked in a task; queued work is run; shutdown stops the threads.
"""
import queue
import threading
import time

import pytest

from distgrad.transport.leader import LeaderFollowers

pytestmark = pytest.mark.timeout(60)


class FakePoller:
    def __init__(self):
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        self.pool = None

    def lead(self):
        while not self.stopped:
            if self.pool.has_tasks():
                return []
            try:
                item = self.ready.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:  # a wake-up
                continue
            return item
        return None

    def wake(self):
        self.ready.put(None)


def _pool(poller, workers, shared=True, lead=None):
    pool = LeaderFollowers(lead or poller.lead, workers, name="test",
                           shared=poller.wake if shared else None)
    poller.pool = pool
    pool.start()
    return pool


def _wait(cond, timeout=10):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


@pytest.mark.parametrize("shared", [True, False])
def test_the_reading_thread_runs_what_it_read(shared):
    poller = FakePoller()
    seen, readers = [], {}
    done = threading.Event()

    def work(i):
        seen.append((i, threading.get_ident()))
        if len(seen) == 20:
            done.set()

    def lead():
        item = poller.lead()
        if item:
            readers[item[0][1][0]] = threading.get_ident()
        return item
    pool = _pool(poller, 4, shared, lead)
    try:
        for i in range(20):
            poller.ready.put([(work, (i,))])
            time.sleep(0.002)
        assert done.wait(10)
        # every piece ran on the thread whose lead() returned it
        assert all(readers[i] == t for i, t in seen)
    finally:
        poller.stopped = True
        pool.shutdown(wait=True)


@pytest.mark.parametrize("shared", [True, False])
def test_a_thread_keeps_reading_while_every_other_is_blocked(shared):
    poller = FakePoller()
    pool = _pool(poller, 2, shared)  # 2 workers: 3 threads at most
    release = threading.Event()
    ran = []
    try:
        def block(i):
            ran.append(i)
            release.wait(20)
        for i in range(2):
            poller.ready.put([(block, (i,))])
        _wait(lambda: len(ran) == 2)
        # both workers blocked: a third thread reads, and what it reads waits, queued
        _wait(lambda: pool.readers() >= 1)
        poller.ready.put([(ran.append, ("queued",))])
        poller.ready.put([(ran.append, ("queued too",))])
        time.sleep(0.3)
        assert pool.readers() >= 1 and "queued" not in ran
        release.set()
        _wait(lambda: "queued" in ran and "queued too" in ran)
    finally:
        release.set()
        poller.stopped = True
        pool.shutdown(wait=True)


@pytest.mark.parametrize("shared", [True, False])
def test_submitted_work_runs_and_shutdown_stops(shared):
    poller = FakePoller()
    pool = _pool(poller, 3, shared)
    got = []
    try:
        for i in range(50):
            pool.submit(got.append, i)
        _wait(lambda: len(got) == 50)
        assert sorted(got) == list(range(50))
    finally:
        poller.stopped = True
        pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit(got.append, 0)


@pytest.mark.parametrize("shared", [True, False])
def test_a_reply_read_with_a_request_that_waits_for_it_is_not_stuck_behind_it(shared):
    """One read brings a request and a reply completion; the request waits for that
    reply (a function waiting on an rpc_async future). The completion must not wait
    behind the request on the reading thread: nothing here wakes an idle thread but
    a read (no periodic tick), as with an idle transport."""
    ready: queue.SimpleQueue = queue.SimpleQueue()
    pool = LeaderFollowers(ready.get, 4, name="t",
                           shared=(lambda: ready.put([])) if shared else None)
    pool.start()
    completed = threading.Event()
    got = []

    def request():  # waits for the reply read with it
        got.append(completed.wait(5))

    def completion():
        completed.set()
    completion.batchable = True  # as the agent's reply completion is
    try:
        started = threading.Event()
        ready.put([(started.set, ())])  # the steady state: another thread waits to read
        assert started.wait(20)
        _wait(lambda: pool.readers() >= (2 if shared else 1), 20)
        ready.put([(request, ()), (completion, ())])
        _wait(lambda: got, 20)
        assert got == [True]
    finally:
        for _ in range(8):
            ready.put(None)
        pool.shutdown(wait=True)
