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
import contextlib
import heapq
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from . import shm, waiting
from .auth import Authenticator
from .base import Timer, Transport, TransportHandler
from .descriptors import Acceptor, open_file_limit
from .detector import DEFAULT_THRESHOLD, HEARTBEAT_DEADLINE, HEARTBEAT_INTERVAL, PhiDetector, default_limit
from .gate import Gate, RateLog
from .handshake import stretch
from .leader import LeaderFollowers
from .opening import Opening, _Conn, host_key
from .reading import _EPOLL, _IN, _ONESHOT, _OUT, Reading
from .sending import _HEARTBEAT, Sending
from .waker import Waker

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_SIZE = 1 << 33
DEFAULT_SHM_THRESHOLD = 256 << 10


def _gate_bounds() -> tuple[int, int]:
    """The gate's bounds (in all, per source): 128 and 64, or a quarter of the
    open-file limit where that is less (at 256 descriptors: 64 and 32), so that
    strangers waiting for their handshakes never hold most of them."""
    limits = open_file_limit()
    total = 128 if limits is None or limits[0] < 0 else max(16, min(128, limits[0] // 4))
    return total, max(8, total // 2)


def _default_shm_threshold() -> int:
    value = os.environ.get("DISTGRAD_SHM_THRESHOLD")
    return int(value) if value else DEFAULT_SHM_THRESHOLD


class SocketTransport(Sending, Reading, Opening, Transport):
    """See the module docstring.

    Example::

        >>> t = SocketTransport(rank=0)
        >>> addr = t.listen("127.0.0.1")          # publish addr, learn the others'
        >>> t.start(handler, {1: addr_of_worker1})
        >>> t.send(1, [b"frame"])
    """

    def __init__(self, rank: int, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 heartbeat_deadline: float = HEARTBEAT_DEADLINE,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE, shm_threshold: int | None = None,
                 secret: bytes | None = None, encrypt: bool = False, num_threads: int = 16,
                 mac_tensors: bool | None = None, heartbeat_limit: float | None = None,
                 heartbeat_phi: float = DEFAULT_THRESHOLD) -> None:
        if encrypt and not secret:
            raise ValueError("encryption (DISTGRAD_ENCRYPT / encrypt=True) derives its keys from "
                             "the cluster secret: set DISTGRAD_SECRET")
        self.rank = rank
        self.encrypt = bool(encrypt)
        # every key (handshake proofs, MACs, encryption) derives from the secret
        # stretched by scrypt: a guess at the secret costs a scrypt
        self._secret = stretch(secret) if secret else None
        self._auth = Authenticator(self._secret, rank) if secret and not encrypt else None
        # on TCP every byte is MAC'd (tensors too) unless turned off for a trusted fabric
        self.mac_tensors = (os.environ.get("DISTGRAD_MAC_TENSORS", "1") != "0"
                            if mac_tensors is None else bool(mac_tensors))
        self.max_message_size = max_message_size if max_message_size > 0 else 1 << 62
        self.shm_threshold = _default_shm_threshold() if shm_threshold is None else shm_threshold
        if self.encrypt:  # frames in /dev/shm would be in the clear, and writable after delivery
            self.shm_threshold = 0
        self.host_id = host_key()
        self._shm_peers: dict[int, str] = {}
        self._shm_writer = shm.ShmWriter(rank)
        self._shm_reader = shm.ShmReader()
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_deadline = heartbeat_deadline
        self.heartbeat_limit = (default_limit(heartbeat_deadline) if heartbeat_limit is None
                                else heartbeat_limit)
        # when a silent peer is lost: adaptive between the deadline and the limit
        self._detector = PhiDetector(heartbeat_interval, heartbeat_deadline,
                                     self.heartbeat_limit, heartbeat_phi)
        self._pause_min = self._detector.min_gap
        self._tcp: socket.socket | None = None
        self._unix: socket.socket | None = None
        self._unix_name = ""
        self._addresses: dict[int, str] = {}
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, _Conn] = {}
        self._peers: set[int] = set()
        self._last_recv: dict[int, float] = {}   # the last authenticated message per peer
        self._last_partial: dict[int, float] = {}  # the last part of a long one, on credit
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
        self._gate = Gate(*_gate_bounds())   # connections not yet authenticated (see gate.py)
        self._refusals = RateLog(log)
        # accept() with no descriptor left sheds the queue, never spins (descriptors.py)
        self._acceptor = Acceptor(RateLog(log, burst=5, interval=10.0).warning, f"worker {rank}")
        self._admit = None  # a dynamic group's admission (see Opening.start)
        self._last_beat = time.monotonic()
        self._next_beat = 0.0
        self._inbox_lock = threading.Lock()
        # The handler's in-order part (on_message, on_peer_lost, timers) runs under
        # one lock: each connection is read in order by one thread at a time, but
        # several threads read several connections at once, and the agent's
        # bookkeeping (RRef forks, autograd reports) expects one event at a time
        self._dispatch = threading.RLock()
        self._tick_lock = threading.Lock()
        # the spin budgets (waiting.Budget) of a caller waiting for its reply and of a
        # pool thread back from traffic, learned from how long their waits took
        self._reply_budget = waiting.Budget()
        self._lead_budget = waiting.Budget()
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

    def _unwatch(self, ls: socket.socket, seconds: float) -> None:
        """Stop watching listener ``ls`` for ``seconds`` (it has connections waiting
        that no descriptor is left to accept), then watch it again."""
        def rewatch() -> None:
            if self._closing or ls.fileno() < 0:
                return
            with contextlib.suppress(OSError, ValueError, KeyError):
                if _EPOLL:
                    self._poller.modify(ls.fileno(), _IN)
                else:
                    import selectors
                    with self._plock:
                        self._poller.register(ls, selectors.EVENT_READ)
        try:
            if _EPOLL:
                self._poller.modify(ls.fileno(), 0)
            else:
                with self._plock:
                    self._poller.unregister(ls)
        except (OSError, ValueError, KeyError):
            return   # closing, or another thread unwatched it first
        self.call_later(seconds, rewatch)

    def _register(self, conn: _Conn) -> None:
        """Start reading a connection opened after start-up (a member that joined)."""
        if _EPOLL:
            self._poller.register(conn.fd, _IN | _ONESHOT)
        else:
            import selectors
            with self._plock:
                self._poller.register(conn.sock, selectors.EVENT_READ)
        self._wake()

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

    # -- liveness --------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        detector = self._detector
        stalled = now - self._last_beat - self.heartbeat_interval
        self._last_beat = now
        if stalled > self.heartbeat_interval:
            # this process did not run for a while (starved, stopped): peers'
            # silence over that time is not theirs to answer for
            for p in list(self._last_recv):
                self._last_recv[p] += stalled
            for p in list(self._last_partial):
                self._last_partial[p] += stalled
        tick = getattr(self._handler, "on_tick", None)
        if tick is not None:
            with self._dispatch:
                self._guard(lambda: tick(now))
        if self._shm_peers:
            for peer, names in self._shm_writer.expire().items():
                conn = self._conns.get(peer)
                if conn is not None and not conn.lost:
                    self._send(conn, [shm.names_frame(names)])
        for peer, conn in list(self._conns.items()):
            if conn.lost:
                continue
            silent = now - max(self._last_recv.get(peer, now), self._last_partial.get(peer, 0.0))
            deadline = detector.deadline(peer)
            if silent > deadline and not conn.owned and conn.rlock.acquire(False):
                try:  # read what already arrived before calling anyone silent
                    work: list = []
                    self._read(conn, work)
                    self._hand_off(work)
                finally:
                    conn.rlock.release()
                silent = (now - max(self._last_recv.get(peer, now), self._last_partial.get(peer, 0.0))
                          if not conn.lost else 0)
            if silent > deadline:
                self._lose(peer, detector.describe(peer, silent), graceful=False)
                continue
            if conn.deferred:   # what send_soon queued and no message took along
                self._send(conn, None)
            if now - self._last_sent.get(peer, 0.0) >= self.heartbeat_interval:
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
        for conn in list(self._conns.values()):
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
        self._gate.drop_all()
        self._acceptor.close()
        if self._unix_name and not self._unix_name.startswith("@"):
            try:
                os.unlink(self._unix_name)
            except OSError:
                pass
        if self._poller is not None:
            self._poller.close()
        self._shm_writer.cleanup()
        self._waker.close()
