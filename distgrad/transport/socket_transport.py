"""Stream sockets from the standard library, read by a leader/followers pool.

One connection per pair of workers, opened at start-up by the lower rank after
a handshake (:mod:`.handshake`): a Unix domain socket between workers of one
host (same boot, hostname and network namespace, learnt from the listening
address), TCP between hosts. Messages are length-prefixed frame lists
(:mod:`.framing`).

Threads and hand-offs, the point of this module:

* **Sending** happens on the thread that makes the call, under the peer's
  write lock, with ``sendmsg`` and the frames as separate iovecs. A thread
  that is reading (the leader, or a caller reading its own reply) never blocks
  on a full socket: what does not fit is queued and flushed when the socket
  drains; any other thread waits for that one peer only.
* **Receiving**: the pool's leader waits on every socket (``epoll`` with
  one-shot registrations where available, so one thread reads a socket at a
  time and in order); what it reads is handled in order on that thread (the
  agent's bookkeeping), and work it read (a request to run, a reply to
  complete) is run by that same thread once it passed the leader role on
  (:mod:`.leader`).
* **A caller waiting for a reply** reads its own connection when nobody else
  is reading it (:meth:`SocketTransport.read_until`), so the reply wakes the
  caller directly.

Heartbeats catch silent peers, a closed connection is a lost peer at once,
frames are bounded (``max_message_size``), and with a cluster secret every
message is MAC'd (:mod:`.auth`) or, with ``encrypt``, encrypted (:mod:`.crypto`)
before anything is handed up. Same-host frames of ``shm_threshold`` bytes and
more go through reused shared-memory segments (:mod:`.shm`).

Platforms: ``epoll`` (Linux) drives the leader; elsewhere ``selectors``'
default poller with a lock takes its place (``poll``/``kqueue``). Without
``AF_UNIX``, same-host peers use TCP; without ``/dev/shm``, no shared memory.
"""
from __future__ import annotations

import collections
import heapq
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from . import framing, shm
from .auth import Authenticator, AuthError
from .base import Timer, Transport, TransportHandler
from .leader import LeaderFollowers
from .opening import Opening, _Conn, host_key
from .waker import Waker

log = logging.getLogger(__name__)

_HEARTBEAT = b"\xffHB"
_GOODBYE = b"\xffBYE"
DEFAULT_MAX_MESSAGE_SIZE = 1 << 33
DEFAULT_SHM_THRESHOLD = 256 << 10
_EPOLL = hasattr(select, "epoll")
_IN = select.EPOLLIN if _EPOLL else 1
_OUT = select.EPOLLOUT if _EPOLL else 4
_ONESHOT = select.EPOLLONESHOT if _EPOLL else 0


def _default_shm_threshold() -> int:
    value = os.environ.get("DISTGRAD_SHM_THRESHOLD")
    return int(value) if value else DEFAULT_SHM_THRESHOLD


class SocketTransport(Opening, Transport):
    """See the module docstring.

    Example::

        >>> t = SocketTransport(rank=0)
        >>> addr = t.listen("127.0.0.1")          # publish addr, learn the others'
        >>> t.start(handler, {1: addr_of_worker1})
        >>> t.send(1, [b"frame"])
    """

    def __init__(self, rank: int, heartbeat_interval: float = 0.5, heartbeat_deadline: float = 4.0,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE, shm_threshold: int | None = None,
                 secret: bytes | None = None, encrypt: bool = False, num_threads: int = 16) -> None:
        if encrypt and not secret:
            raise ValueError("encryption (DISTGRAD_ENCRYPT / encrypt=True) derives its keys from "
                             "the cluster secret: set DISTGRAD_SECRET")
        self.rank = rank
        self.encrypt = bool(encrypt)
        self._secret = secret
        self._auth = Authenticator(secret, rank) if secret and not encrypt else None
        self.max_message_size = max_message_size if max_message_size > 0 else 1 << 62
        self.shm_threshold = _default_shm_threshold() if shm_threshold is None else shm_threshold
        self.host_id = host_key()
        self._shm_peers: dict[int, str] = {}
        self._shm_writer = shm.ShmWriter(rank)
        self._shm_reader = shm.ShmReader()
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_deadline = heartbeat_deadline
        self._tcp: socket.socket | None = None
        self._unix: socket.socket | None = None
        self._unix_name = ""
        self._addresses: dict[int, str] = {}
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._peers: set[int] = set()
        self._last_recv: dict[int, float] = {}
        self._last_sent: dict[int, float] = {}
        self._lost: set[int] = set()
        self._lose_lock = threading.Lock()
        self._inbox: collections.deque = collections.deque()
        self._timers: list[Timer] = []
        self._tlock = threading.Lock()
        self._waker = Waker()
        self._wake_pending = False
        self._tls = threading.local()
        self._handler: TransportHandler | None = None
        self._poller = None
        self._plock = threading.Lock()  # non-epoll pollers are not thread safe
        self._running = False
        self._closing = False
        self._handshakes = 0
        self._last_beat = time.monotonic()
        self._next_beat = 0.0
        self._inbox_lock = threading.Lock()
        # The handler's in-order part (on_message, on_peer_lost, timers) runs under
        # one lock: each connection is read in order by one thread at a time, but
        # several threads read several connections at once, and the agent's
        # bookkeeping (RRef forks, autograd reports) expects one event at a time
        self._dispatch = threading.RLock()
        self._tick_lock = threading.Lock()
        # With epoll every idle pool thread waits in it at once (the kernel hands each
        # ready socket to one of them): no thread ever wakes another on the common
        # path. Elsewhere (or DISTGRAD_SHARED_POLL=0) one leader waits and hands its
        # role to a follower before it runs what it read.
        shared = _EPOLL and os.environ.get("DISTGRAD_SHARED_POLL", "1") != "0"
        self.pool = LeaderFollowers(self._lead, num_threads, name=f"distgrad-{rank}",
                                    shared=self._wake if shared else None)
        # per peer: messages and bytes sent, received; messages through shared memory
        # sent, received
        self.stats: dict[int, list[int]] = collections.defaultdict(lambda: [0] * 6)
        # write batches (one sendmsg each, unless the socket was full) and the messages
        # they carried; reads and the messages they brought (``batches[2:]``)
        self.batches = [0, 0, 0, 0]

    # -- set-up ------------------------------------------------------------
    def _add(self, conn: _Conn) -> None:
        self._conns[conn.peer] = conn
        self._by_fd[conn.fd] = conn

    def _open_poller(self) -> None:
        wake = self._waker.fileno()
        if _EPOLL:
            self._poller = select.epoll()
            self._poller.register(wake, _IN)
            for ls in (self._tcp, self._unix):
                if ls is not None:
                    ls.setblocking(False)
                    self._poller.register(ls.fileno(), _IN)
            for conn in self._conns.values():
                self._poller.register(conn.fd, _IN | _ONESHOT)
        else:
            import selectors
            self._poller = selectors.DefaultSelector()
            self._poller.register(wake, selectors.EVENT_READ)
            for ls in (self._tcp, self._unix):
                if ls is not None:
                    ls.setblocking(False)
                    self._poller.register(ls, selectors.EVENT_READ)
            for conn in self._conns.values():
                self._poller.register(conn.sock, selectors.EVENT_READ)

    def _arm(self, conn: _Conn, out: bool = True) -> None:
        """Re-register ``conn`` for what it waits for now (read unless a caller owns
        it; write while its queue is not empty, unless ``out`` is False and a
        sender holds the write lock: that sender flushes, or arms it on release)."""
        with conn.alock:
            if conn.lost:
                return
            out = bool(conn.outq) and (out or not conn.wlock.locked())
            mask = (0 if conn.owned else _IN) | (_OUT if out else 0)
            try:
                if _EPOLL:
                    self._poller.modify(conn.fd, mask | _ONESHOT if mask else 0)
                else:
                    import selectors
                    ev = (selectors.EVENT_READ if mask & _IN else 0) | \
                        (selectors.EVENT_WRITE if mask & _OUT else 0)
                    with self._plock:
                        if ev:
                            self._poller.modify(conn.sock, ev)
                        else:
                            self._poller.unregister(conn.sock)
                            self._poller.register(conn.sock, selectors.EVENT_READ)
            except (OSError, ValueError, KeyError):
                pass

    # -- any thread --------------------------------------------------------
    def send(self, peer: int, frames: Sequence) -> None:
        if peer == self.rank:  # loopback: copy, as a socket would, and deliver in order
            body = [bytearray(memoryview(f)) for f in frames]
            self._inbox.append((self.rank, body))
            self._wake()
            return
        conn = self._conns.get(peer)
        if conn is None or conn.lost:
            return
        nbytes = sum(memoryview(f).nbytes for f in frames)
        st = self.stats[peer]
        if peer in self._shm_peers:  # the copy into shared memory runs here, on the sender
            packed = self._shm_writer.pack(frames, self.shm_threshold, peer)
            if packed is not None:
                frames = packed
                st[4] += 1
        self._send(conn, frames)
        st[0] += 1
        st[1] += nbytes

    def _send(self, conn: _Conn, frames: Sequence) -> None:
        # Every message goes through ``conn.deferred`` and whoever holds the write
        # lock sends it, in order. A reading thread never waits for that lock: its
        # holder may be waiting for the peer to read, and the peer for this thread
        # to read (both sides sending big messages at once). Each holder checks the
        # queue again after releasing the lock, so nothing queued is left behind.
        # A send nested inside the holder's own (an RRef freed by the garbage collector
        # during a write sends its delete) only queues: the holder's loop sends it next.
        reading = getattr(self._tls, "reading", False)
        conn.deferred.append(frames)
        me = threading.get_ident()
        if conn.wowner == me:
            return
        if reading:
            if not conn.wlock.acquire(False):
                return
        else:
            conn.wlock.acquire()
        conn.wowner = me
        arm = False
        failed = None
        while True:
            try:
                if conn.deferred and not conn.lost:
                    arm |= self._write(conn, reading)
            except OSError as e:
                failed = e
            if conn.lost or failed:
                conn.deferred.clear()
            self._last_sent[conn.peer] = time.monotonic()
            conn.wowner = 0
            conn.wlock.release()
            if failed or not conn.deferred or not conn.wlock.acquire(False):
                break
            conn.wowner = me
        if failed:
            self._lose(conn.peer, f"connection failed: {failed}", graceful=False)
        elif arm:
            self._arm(conn)

    def _write(self, conn: _Conn, reading: bool) -> bool:
        """Seal every message queued for ``conn`` and send them all with one
        ``sendmsg`` (write lock held: messages other threads queued meanwhile go
        with this thread's); returns whether the poller must flush the rest (a
        reading thread never blocks on a full socket)."""
        deferred, cipher, auth, peer = conn.deferred, conn.cipher, self._auth, conn.peer
        views: list = []
        n = 0
        while deferred:  # a send nested in coalesce (an RRef's delete) joins this batch
            frames = deferred.popleft()
            if cipher is not None:
                frames = cipher.seal(list(frames))
            elif auth is not None:
                frames = auth.seal(peer, list(frames), shm.parsed_frames(frames))
            views += framing.coalesce(frames)
            n += 1
        self.batches[0] += 1
        self.batches[1] += n
        if conn.outq:
            conn.outq.extend(views)
        else:
            conn.outq.extend(framing.send_some(conn.sock, views))
        if not conn.outq:
            return False
        if reading:
            return True
        self._flush_blocking(conn)
        return False

    def _flush_blocking(self, conn: _Conn) -> None:
        """Send ``conn``'s queue, waiting for the peer to drain it (write lock held)."""
        while conn.outq and not conn.lost:
            conn.outq[:] = framing.send_some(conn.sock, conn.outq)
            if conn.outq:
                framing.wait_writable(conn.sock, 0.2)

    def uses_shm(self, peer: int) -> bool:
        """Whether large frames to ``peer`` go through shared memory."""
        return peer in self._shm_peers

    def link_info(self, peer: int) -> dict:
        """How this worker reaches ``peer``: ``link`` ("unix", "tcp", or "none"
        before start-up), ``remote_address`` (the peer's TCP address, as
        ``host:port``; "" over a Unix socket), ``shm`` (whether large frames may go
        through shared memory) and the messages that did, each way.

        Example::

            >>> t.link_info(1)
            {'link': 'tcp', 'remote_address': '10.0.0.2:41234', 'shm': False,
             'shm_messages_sent': 0, 'shm_messages_received': 0}
        """
        conn = self._conns.get(peer)
        link, remote = "none", ""
        if conn is not None:
            unix = conn.sock.family == getattr(socket, "AF_UNIX", None)
            link = "unix" if unix else "tcp"
            if not unix:
                try:
                    host, port = conn.sock.getpeername()[:2]
                    remote = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                except OSError:  # lost
                    remote = "?"
        st = self.stats[peer] if peer in self.stats else [0] * 6
        return {"link": link, "remote_address": remote, "shm": peer in self._shm_peers,
                "shm_messages_sent": st[4], "shm_messages_received": st[5]}

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._inbox.append((None, fn))
        self._wake()

    def call_later(self, delay: float, fn: Callable[[], None], wake: bool = True) -> Timer:
        timer = Timer(time.monotonic() + delay, fn)
        with self._tlock:
            heapq.heappush(self._timers, timer)
        if timer.when < self._next_beat and not getattr(self._tls, "reading", False):
            self._wake()  # due before the pollers' next periodic wake-up
        return timer

    def on_io_thread(self) -> bool:
        """Whether this thread is reading (the leader, or a caller reading its reply):
        it must not block nor run user code."""
        return getattr(self._tls, "reading", False)

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._waker.wake()

    # -- reading -------------------------------------------------------------
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
                return self._poller.poll(wait, 1)
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
        if conn.reader.received != before:  # an empty read (the heartbeat's look) is no news
            self._last_recv[peer] = time.monotonic()
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
                body = self._auth.open(peer, body, shm.parsed_frames(body[1:]))
        except AuthError as e:
            self._reject(peer, str(e))
            return
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
            st[3] += sum(memoryview(b).nbytes for b in body)
            with self._dispatch:
                w = self._handler.on_message(peer, body)
        except Exception:
            log.exception("worker %d: error handling a message from worker %d", self.rank, peer)
            return
        if w is not None:
            work.append(w)

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
                   claimed: bool = False) -> bool:
        """Read ``peer``'s connection on this thread until ``done()`` (a caller waiting
        for its reply), when nobody else is reading it. Returns False at once when
        someone is (the reader completes the waiter), True once ``done()`` or the
        peer is lost. Requests read on the way go to the pool; other replies read
        on the way are completed on this thread (no wake-up each), after it gave
        the reading role back (their futures' callbacks may send and wait)."""
        conn = self._conns.get(peer)
        tls = self._tls
        if not claimed and not self.claim(peer):
            return False
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            later: list = []
            tls.reading = True
            try:
                poll = conn.poll.poll
                while not done() and not conn.lost and self._running:
                    if end is not None and time.monotonic() > end:
                        break
                    # the reply is often there already (the peer ran while this thread
                    # was sending): look before sleeping
                    if poll(0) or poll(100):
                        work: list = []
                        self._read(conn, work)
                        for item in work:
                            if getattr(item[0], "inline", False):
                                later.append(item)
                            else:
                                self.pool.submit(item[0], *item[1])
                        if later:
                            break
            finally:
                tls.reading = False
                self.release(peer)
            if not later:
                return True
            for fn, args in later:
                self._guard(lambda fn=fn, args=args: fn(*args))
            if done() or conn.lost or not self._running \
                    or (end is not None and time.monotonic() > end):
                return True
            if not self.claim(peer):
                return False  # someone else reads it now: they complete the waiter

    # -- liveness --------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        deadline = self.heartbeat_deadline
        stalled = now - self._last_beat - self.heartbeat_interval
        self._last_beat = now
        if stalled > self.heartbeat_interval:
            # this process did not run for a while (starved, stopped): peers'
            # silence over that time is not theirs to answer for
            for p in self._last_recv:
                self._last_recv[p] += stalled
        tick = getattr(self._handler, "on_tick", None)
        if tick is not None:
            with self._dispatch:
                self._guard(lambda: tick(now))
        if self._shm_peers:
            for peer, names in self._shm_writer.expire().items():
                conn = self._conns.get(peer)
                if conn is not None and not conn.lost:
                    self._send(conn, [shm.names_frame(names)])
        for peer, conn in self._conns.items():
            if conn.lost:
                continue
            silent = now - self._last_recv[peer]
            if silent > deadline and not conn.owned and conn.rlock.acquire(False):
                try:  # read what already arrived before calling anyone silent
                    work: list = []
                    self._read(conn, work)
                    for fn, args in work:
                        self.pool.submit(fn, *args)
                finally:
                    conn.rlock.release()
                silent = now - self._last_recv[peer] if not conn.lost else 0
            if silent > deadline:
                self._lose(peer, f"no heartbeat for {silent:.1f} s", graceful=False)
                continue
            if now - self._last_sent[peer] >= self.heartbeat_interval:
                self._send(conn, [_HEARTBEAT])

    def _lose(self, peer: int, reason: str, graceful: bool) -> None:
        with self._lose_lock:
            if peer in self._lost:
                return
            self._lost.add(peer)
        conn = self._conns.get(peer)
        if conn is not None:
            conn.lost = True
            try:
                if _EPOLL:
                    self._poller.unregister(conn.fd)
                elif self._poller is not None:
                    with self._plock:
                        self._poller.unregister(conn.sock)
            except (OSError, ValueError, KeyError, AttributeError):
                pass
            try:  # wakes a caller reading it; the fd stays open (no reuse) until close()
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        prefix = self._shm_peers.get(peer)
        if prefix is not None:  # its segments, and ours it held
            self._shm_reader.forget_prefix(prefix)
            shm.remove_prefix(prefix)
            self._shm_writer.peer_lost(peer)
        if self._closing:
            return
        with self._dispatch:
            self._guard(lambda: self._handler.on_peer_lost(peer, reason, graceful))

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while True:
            with self._tlock:
                if not timers or timers[0].when > now:
                    return
                t = heapq.heappop(timers)
            if not t.cancelled:
                with self._dispatch:
                    self._guard(t.fn)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("worker %d: error on the transport's reading thread", self.rank)

    # -- closing -----------------------------------------------------------------
    def close(self, linger: float = 1.0) -> None:
        """Say goodbye to every peer (flushing for at most ``linger`` s), stop reading,
        close the sockets. The pool's threads finish what they run."""
        # From here on a peer that closes is no news: it may have heard our goodbye
        # and left before we finished saying it to everyone
        self._closing = True
        if self._running:
            for conn in list(self._conns.values()):
                if not conn.lost:
                    self._goodbye(conn, linger)
        self._running = False
        self._wake()
        self.pool.shutdown(wait=False)
        end = time.monotonic() + 2
        while self.pool.readers() and time.monotonic() < end:
            time.sleep(0.002)
        for conn in self._conns.values():
            conn.lost = True
            try:
                # FIN after the goodbye, and nothing left unread: closing a socket with
                # unread bytes resets the connection, and the peer could lose the goodbye
                conn.sock.shutdown(socket.SHUT_WR)
                while conn.sock.recv(1 << 16):
                    pass
            except OSError:
                pass
            try:
                conn.sock.close()
            except OSError:
                pass
        for ls in (self._tcp, self._unix):
            if ls is not None:
                ls.close()
        if self._unix_name and not self._unix_name.startswith("@"):
            try:
                os.unlink(self._unix_name)
            except OSError:
                pass
        if self._poller is not None:
            self._poller.close()
        self._shm_writer.cleanup()
        self._waker.close()

    def _goodbye(self, conn: _Conn, linger: float) -> None:
        frames = [_GOODBYE]
        with conn.wlock:
            conn.wowner = threading.get_ident()  # a nested send only queues
            try:
                for msg in [*conn.deferred, frames]:  # queued messages go before it
                    if conn.cipher is not None:
                        msg = conn.cipher.seal(list(msg))
                    elif self._auth is not None:
                        msg = self._auth.seal(conn.peer, list(msg), shm.parsed_frames(msg))
                    conn.outq.extend(framing.coalesce(msg))
                conn.deferred.clear()
                end = time.monotonic() + max(linger, 0.05)
                while conn.outq and time.monotonic() < end:
                    conn.outq[:] = framing.send_some(conn.sock, conn.outq)
                    if conn.outq:
                        framing.wait_writable(conn.sock, max(0.0, end - time.monotonic()))
            except OSError:
                pass
