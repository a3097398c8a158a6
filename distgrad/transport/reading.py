"""The reading half of :class:`~.socket_transport.SocketTransport` (a mixin;
the state it uses lives on the transport).

Pool threads wait in the poller (:mod:`.leader`); the one the kernel hands a
ready socket reads everything it has (:class:`~.framing.FrameReader`), opens
each message (MAC or decryption, shared memory), hands it to the agent's
``on_message`` in order and returns the work it read: several messages from
one read are served without a wake-up each when they are reply completions;
every request gets a thread of its own (the reader runs the first). A
caller waiting for its reply reads its own connection (:meth:`Reading.claim`,
:meth:`Reading.read_until`); what else it reads on the way goes to the pool:
each request as a task of its own (one may wait for what the next one does),
the reply completions together as one.

Example::

    >>> if t.claim(1):                 # before sending a small request to worker 1
    ...     t.send(1, frames)
    ...     t.read_until(1, lambda: reply_arrived(), claimed=True)
"""
from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable

from . import framing, shm, waiting
from .auth import AuthError
from .opening import _Conn
from .sending import _GOODBYE

log = logging.getLogger("distgrad.transport.socket_transport")

_EPOLL = hasattr(select, "epoll")
_IN = select.EPOLLIN if _EPOLL else 1
_OUT = select.EPOLLOUT if _EPOLL else 4
_ONESHOT = select.EPOLLONESHOT if _EPOLL else 0


def _spin_seconds(raw: str | None) -> float:
    """``DISTGRAD_SPIN_US``: a fixed spin budget for every wait that expects bytes soon,
    instead of the learned one (:mod:`.waiting`); 0 never spins. Unset: learned where
    the native wait runs, else 0 (sleep at once: an idle worker uses no CPU)."""
    return (waiting.parse_us("DISTGRAD_SPIN_US", raw) or 0.0) / 1e6


SPIN_S = _spin_seconds(os.environ.get("DISTGRAD_SPIN_US"))
# between two looks while spinning: let another process on this core run (where the
# platform has no sched_yield, a spin is a plain busy loop)
_yield = getattr(os, "sched_yield", None) or (lambda: None)
_wait_fd = waiting.wait_fd
_epoll_wait_spin = waiting.epoll_wait_spin
_NATIVE = waiting.NATIVE
_perf = time.perf_counter


def _ms(wait: float) -> int:
    """A timeout in seconds as the waits take it: milliseconds, rounded up."""
    return min(2**31 - 1, math.ceil(wait * 1000))


class Reading:
    """The pool's reading loop, message delivery, a caller reading its reply."""

    def _lead(self) -> list | None:
        """The leader's loop (see :mod:`.leader`): wait, read in order, return work."""
        tls = self._tls
        tls.reading = True
        pool = self.pool
        try:
            while self._running:
                work: list = []
                now = time.monotonic()
                wait = max(0.0, self._next_beat - now)
                if self._timers and self._timers[0].when - now < wait:
                    wait = max(0.0, self._timers[0].when - now)
                if self._inbox:
                    wait = 0.0
                events = self._poll(wait)
                for fd, ev in events:
                    conn = self._by_fd.get(fd)
                    if conn is not None:
                        self._service(conn, ev, work)
                    elif fd == self._waker.fileno():
                        # read, then lower the flag, then (below) look at the queues: a
                        # wake-up racing in between finds the flag up and its item is
                        # seen below; the reverse order could swallow its byte
                        self._waker.clear()
                        self._wake_pending = False
                    else:
                        self._accept_late(fd)
                if self._inbox and self._inbox_lock.acquire(False):
                    try:  # one thread at a time: loopback messages stay in order
                        self._drain_inbox(work)
                    finally:
                        self._inbox_lock.release()
                now = time.monotonic()
                if (now >= self._next_beat or self._timers and self._timers[0].when <= now) \
                        and self._tick_lock.acquire(False):
                    try:  # whichever thread wakes first does the periodic work
                        if now >= self._next_beat:
                            self._heartbeat(now)
                            self._next_beat = now + self.heartbeat_interval / 2
                        if self._timers and self._timers[0].when <= now:
                            self._run_timers(now)
                    finally:
                        self._tick_lock.release()
                if work or pool.has_tasks():
                    return work
            return None
        finally:
            tls.reading = False

    def _poll(self, wait: float) -> list:
        if _EPOLL:
            try:  # one ready socket per waiting thread: the others stay for the next
                # a thread back from traffic expects more soon: it may spin first
                tls = self._tls
                if wait and getattr(tls, "traffic", False):
                    budget = self._lead_budget
                    start = _perf()
                    events = _epoll_wait_spin(self._poller, budget.spin_ns(), _ms(wait), 1)
                    budget.note(_perf() - start)
                else:
                    events = _epoll_wait_spin(self._poller, 0, _ms(wait), 1)
                tls.traffic = bool(events) and events[0][0] in self._by_fd
                return events
            except (OSError, ValueError):
                if not self._running:
                    return []
                raise
        with self._plock:
            ready = self._poller.select(wait)
        return [(k.fd, (_IN if ev & 1 else 0) | (_OUT if ev & 2 else 0)) for k, ev in ready]

    def _service(self, conn: _Conn, ev: int, work: list) -> None:
        out = True
        if ev & _OUT and conn.outq:
            if conn.wlock.acquire(False):  # else its holder flushes it
                conn.wowner = threading.get_ident()
                try:
                    conn.outq[:] = framing.send_some(conn.sock, conn.outq)
                except OSError as e:
                    self._lose(conn.peer, f"connection failed: {e}", graceful=False)
                    return
                finally:
                    conn.wowner = 0
                    conn.wlock.release()
            else:
                out = False
        if ev & ~_OUT and conn.rlock.acquire(False):
            try:
                self._read(conn, work)
            finally:
                conn.rlock.release()
        self._arm(conn, out)

    def _read(self, conn: _Conn, work: list) -> None:
        """Read what ``conn`` has and hand each message up, in order (read lock held)."""
        peer = conn.peer
        before = conn.reader.received
        try:
            msgs = conn.reader.read(conn.sock)
        except EOFError:
            msgs, why = None, "connection closed"
        except framing.FrameError as e:
            msgs, why = None, f"broke the framing: {e}"
            log.warning("worker %d: worker %d %s", self.rank, peer, why)
        except OSError as e:
            msgs, why = None, f"connection failed: {e}"
        if msgs is None:
            self._lose(peer, why, graceful=False)
            return
        if not msgs and conn.reader.received != before:
            # part of a long message on its way: news for now, on credit (withdrawn
            # if the message then fails authentication); an empty read (the
            # heartbeat's look) is none
            self._last_partial[peer] = time.monotonic()
        if msgs:
            self.batches[2] += 1
            self.batches[3] += len(msgs)
        for frames in msgs:
            self._deliver(conn, frames, work)

    def _deliver(self, conn: _Conn, body: list, work: list) -> None:
        peer = conn.peer
        if conn.lost:
            return
        try:
            if conn.cipher is not None:
                body = conn.cipher.open(body)
            elif self._auth is not None:
                f1 = body[1] if len(body) > 1 else b""  # shm.parsed_frames, inlined
                body = self._auth.open(peer, body, (2 if f1[:4] == shm.MARK else 1)
                                       if type(f1) is bytearray else shm.parsed_frames(body[1:]),
                                       conn.mac_all)
        except AuthError as e:
            # the stream is not what the peer sent: a message changed, replayed or
            # deleted on the path (SequenceGap). Nothing later on it can be trusted
            # to be whole, and a call whose message or reply went missing would wait
            # for its timeout: the connection closes and every call to it fails now.
            # (Liveness counts only authenticated bytes: the credit its parts earned goes.)
            self._last_partial.pop(peer, None)
            log.warning("worker %d: a message from worker %d failed authentication (%s): the "
                        "connection is closed", self.rank, peer, e)
            self._lose(peer, f"a message from it failed authentication ({e})", graceful=False)
            return
        now = time.monotonic()   # liveness: only what authenticated
        last = self._last_recv
        if now - last.get(peer, now) >= self._pause_min:  # a pause ended: a sample
            self._pause_ended(peer, now)
        last[peer] = now
        first = body[0]
        if len(body) == 1 and first[:1] == b"\xff":
            self._on_transport_frame(peer, bytes(first))
            return
        try:
            if bytes(first[:4]) == shm.MARK:
                prefix = self._shm_peers.get(peer)
                if prefix is None:
                    self._reject(peer, "sent shared memory, not on this host")
                    return
                body = self._shm_reader.unpack(prefix, body)
                self.stats[peer][5] += 1
            st = self.stats[peer]
            st[2] += 1
            for b in body:  # (a loop, not sum() over a generator: this runs per message)
                st[3] += memoryview(b).nbytes
            with self._dispatch:
                w = self._handler.on_message(peer, body)
        except Exception:
            log.exception("worker %d: error handling a message from worker %d", self.rank, peer)
            return
        if w is not None:
            work.append(w)

    def _pause_ended(self, peer: int, now: float) -> None:
        """Tell the failure detector how long ``peer`` was silent (parts of a long
        message on their way counted as signs of life)."""
        since = max(self._last_recv.get(peer, now), self._last_partial.get(peer, 0.0))
        if now - since >= self._detector.min_gap:
            self._detector.sample(peer, now - since)

    def _reject(self, peer: int, why: str) -> None:
        log.warning("worker %d: dropped a message from worker %d (%s)", self.rank, peer, why)

    def _on_transport_frame(self, peer: int, frame: bytes) -> None:
        if frame == _GOODBYE:
            self._lose(peer, "shut down", graceful=True)
        elif frame[:4] == shm.DROP:
            self._shm_reader.forget(shm.parse_names(frame))
        # else a heartbeat: its arrival was all it had to say

    def _drain_inbox(self, work: list) -> None:
        inbox = self._inbox
        while inbox:
            peer, item = inbox.popleft()
            if peer is None:
                with self._dispatch:
                    self._guard(item)
                continue
            st = self.stats[peer]
            st[2] += 1
            try:
                with self._dispatch:
                    w = self._handler.on_message(peer, item)
            except Exception:
                log.exception("worker %d: error handling a message to itself", self.rank)
                continue
            if w is not None:
                work.append(w)

    def claim(self, peer: int) -> bool:
        """Take the reading role of ``peer``'s connection for this thread, before it
        sends a request whose reply it will read (:meth:`read_until` with
        ``claimed=True`` gives the role back); False when someone else reads it.
        Taken before the send, the reply can never wake the leader first."""
        conn = self._conns.get(peer)
        if conn is None or conn.lost or conn.poll is None or not self._running \
                or getattr(self._tls, "reading", False) or not conn.rlock.acquire(False):
            return False
        with conn.alock:
            conn.owned = True
        self._arm(conn)  # the leader stops watching it for reading
        self._tls.reading = True  # holding a reading role: its sends must not block
        return True

    def release(self, peer: int) -> None:
        """Give back a role taken with :meth:`claim` (the send failed)."""
        conn = self._conns.get(peer)
        self._tls.reading = False
        with conn.alock:
            conn.owned = False
        conn.rlock.release()
        self._arm(conn)

    def read_until(self, peer: int, done: Callable[[], bool], timeout: float | None = None,
                   claimed: bool = False, look_at: float | None = None) -> bool:
        """Read ``peer``'s connection on this thread until ``done()`` (a caller waiting
        for its reply), when nobody else is reading it. Returns False at once when
        someone is (the reader completes the waiter), True once ``done()`` or the
        peer is lost. Work read on the way goes to the pool (:meth:`_hand_off`):
        each request a task of its own, the reply completions of one read one task.
        A caller that did not claim the connection before sending (a future's
        ``wait()``) gives it back after a read that brought a request, and returns
        False: the peer is sending requests, and the pool serves those best.
        ``look_at`` (a ``time.monotonic()`` instant: the call's timeout) is when
        ``done()`` may turn true without a byte on this connection: the wait wakes
        then to look (else every 100 ms)."""
        conn = self._conns.get(peer)
        tls = self._tls
        if not claimed and not self.claim(peer):
            return False
        tls.reading = True
        try:
            poll = conn.poll.poll
            target = conn.fd if _NATIVE else conn.poll
            budget = self._reply_budget
            end = None if timeout is None else time.monotonic() + timeout
            since = _perf()
            while not done() and not conn.lost and self._running:
                if end is not None and time.monotonic() > end:
                    break
                # the reply is often there already (the peer ran while this thread
                # was sending): look before sleeping (and keep looking for the
                # budget learned from the last replies: waiting.Budget)
                slice_ms = 100
                if look_at is not None:
                    # (a timer due then completes it on another thread; whole ms, rounded up)
                    left = int((look_at - time.monotonic()) * 1000) + 1
                    if left > -100:
                        slice_ms = 1 if left < 1 else 100 if left > 100 else left
                if poll(0) or _wait_fd(target, budget.spin_ns(), slice_ms):
                    budget.note(_perf() - since)
                    work: list = []
                    self._read(conn, work)
                    since = _perf()
                    if work:
                        # not run here: this thread goes back to waiting for its
                        # reply, and a failed reply's exception would keep this
                        # caller's frames (and what they hold) alive through its traceback
                        if self._hand_off(work) and not claimed and not done():
                            # the peer sends requests on this connection while this
                            # caller waits (a future of a long call): each would cost
                            # two wake-ups (this thread's, then a pool thread's). Given
                            # back, the next is read by the pool thread it wakes, which
                            # serves it there; the reply completes the future.
                            return False
            return True
        finally:
            tls.reading = False
            self.release(peer)

    def _hand_off(self, work: list) -> bool:
        """Give the pool work read by a thread that does not run it (a caller waiting
        for its reply, the heartbeat's look at a silent peer): every request as a
        task of its own, so that no request waits behind another (one may wait for
        something the next one does, as torch serves each on its own thread); the
        reply completions (work marked ``batchable``) as one task, one wake-up.
        Returns whether ``work`` held a request."""
        submit = self.pool.submit
        batch = [w for w in work if getattr(w[0], "batchable", False)]
        if len(batch) == 1:
            submit(batch[0][0], *batch[0][1])
        elif batch:
            submit(_run_batch, batch, self.pool)
        requests = False
        for fn, args in work:
            if not getattr(fn, "batchable", False):
                submit(fn, *args)
                requests = True
        return requests


def _run_batch(work: list, pool) -> None:
    """Run reply completions read together (one pool task, one wake-up): the first
    here, the rest deferred to this thread (:meth:`.leader.LeaderFollowers.defer`)
    before it runs: completing a reply runs its future's callbacks, which may wait
    for the next reply (then another thread takes the rest)."""
    fn, args = work[0]
    if len(work) > 1:
        pool.defer(_run_batch, work[1:], pool)
    try:
        fn(*args)
    except Exception:
        log.exception("error completing a reply read by a waiting caller")


_run_batch.batchable = True  # reply completions only (see Reading._hand_off)
