"""Opening the connections of a :class:`~.socket_transport.SocketTransport`.

At start-up every worker listens (TCP; a Unix domain socket too where the
platform has one) and publishes an address carrying tags: its host key (boot
id + hostname + network namespace: two machines never share one), whether it
offers shared memory, whether it has the cluster secret and encryption. Then
the lower rank of each pair connects (Unix socket when both have the same host
key, TCP otherwise) and the two run the handshake (:mod:`.handshake`); the
higher rank accepts. A connection after start-up is refused after its
handshake, so the refusal says why, except in a dynamic group: there a joiner
connects to every member, and a member admits it when the group's table lists
its rank (``start(admit=...)``); ``forget`` frees a lost rank for a new process.

Example::

    >>> t = SocketTransport(rank=0)
    >>> t.listen("127.0.0.1")          # what the rendezvous publishes
    'tcp://127.0.0.1:41234#unix=@distgrad-...#host=...'
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping

from . import framing, netaddr, shm
from .base import TransportHandler
from .handshake import HANDSHAKE_SECONDS, HandshakeError, Refused, client_handshake, server_handshake

log = logging.getLogger("distgrad.transport.socket_transport")

_UNIX_TAG, _HOST_TAG, _SHM_TAG, _AUTH_TAG, _ENC_TAG = "unix", "host", "shm", "auth", "enc"
_CONNECT_TIMEOUT = 60.0


def host_key() -> str:
    """What two processes share only if they can reach each other's Unix sockets
    and shared memory: boot id, hostname and network namespace. Two machines
    never share a boot id; two namespaces of one machine never share the
    namespace's inode (so a test can treat them as two hosts).
    ``DISTGRAD_SAME_HOST=0`` makes every peer a remote one (TCP only, no shared
    memory: the cross-host path, for measuring it on one machine)."""
    if os.environ.get("DISTGRAD_SAME_HOST", "1") == "0":
        return ""
    base = shm.host_id() or ""
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return f"{base}/{ns}" if base else ""


class _Conn:
    __slots__ = ("peer", "sock", "fd", "wlock", "wowner", "rlock", "alock", "reader", "outq", "owned",
                 "lost", "cipher", "poll", "deferred", "mac_all")

    def __init__(self, peer: int, sock: socket.socket, max_frame: int, cipher,
                 mac_all: bool = False) -> None:
        self.peer, self.sock, self.fd = peer, sock, sock.fileno()
        self.wlock = threading.Lock()   # one sender at a time, whole messages
        self.wowner = 0                 # the thread holding wlock (0: none)
        self.rlock = threading.Lock()   # one reader at a time, in order
        self.alock = threading.Lock()   # poller registration changes
        self.reader = framing.FrameReader(max_frame)
        self.outq: list = []            # iovecs a reading thread could not send
        self.deferred: collections.deque = collections.deque()  # messages to send (see _send)
        self.owned = False              # a caller reads its own reply here
        self.lost = False
        self.cipher = cipher
        self.mac_all = mac_all          # every byte MAC'd (TCP, see auth.every_byte)
        self.poll = None                # for a caller reading its own reply
        if hasattr(select, "poll"):     # (Windows: the leader reads every reply)
            self.poll = select.poll()
            self.poll.register(self.fd, select.POLLIN)


class Opening:
    """The connection-opening half of :class:`~.socket_transport.SocketTransport`
    (a mixin: the state it uses lives on the transport)."""

    def listen(self, host: str) -> str:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((host, 0))
        self._tcp.listen(socket.SOMAXCONN)
        self._tcp.setblocking(False)   # accepted by the Acceptor (descriptors.py)
        port = self._tcp.getsockname()[1]
        addr = f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"
        if self.host_id and hasattr(socket, "AF_UNIX"):
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"distgrad-{os.getpid()}-{self.rank}-{os.urandom(6).hex()}"
            # Linux: the abstract namespace (no file to clean up, private to the
            # network namespace); elsewhere a file in the temp directory
            if os.uname().sysname == "Linux":
                self._unix_name = "@" + name
                self._unix.bind("\0" + name)
            else:
                import tempfile
                self._unix_name = os.path.join(tempfile.gettempdir(), name + ".sock")
                self._unix.bind(self._unix_name)
            self._unix.listen(socket.SOMAXCONN)
            self._unix.setblocking(False)
            addr += f"#{_UNIX_TAG}={self._unix_name}"
        if self.host_id:
            addr += f"#{_HOST_TAG}={self.host_id}"
            if self.shm_threshold > 0 and shm.host_id():
                addr += f"#{_SHM_TAG}={os.getpid()}"
        if self._secret:
            addr += f"#{_AUTH_TAG}={self._auth.nonce.hex() if self._auth else '1'}"
        if self.encrypt:
            addr += f"#{_ENC_TAG}=1"
        return addr

    def start(self, handler: TransportHandler, peers: Mapping[int, str],
              admit: Callable[[int], str | None] | None = None,
              listed: Callable[[int], bool] | None = None) -> None:
        """Connect to every peer (lower ranks connect, higher ones accept), then start reading.

        With ``admit`` (a dynamic group) this worker joins a running group: it
        connects to every peer, whatever its rank, and later connections are
        offered to ``admit(rank)``, which returns the joiner's published address
        (with its tags) to accept it, or None to refuse it; a peer this one cannot
        reach while it joins is skipped when ``listed(rank)`` says it left."""
        self._handler = handler
        self._admit = admit
        self._addresses = dict(peers)
        plan = {peer: self._plan(peer, full) for peer, full in peers.items()}
        self._peers = set(plan)
        deadline = time.monotonic() + _CONNECT_TIMEOUT
        accepted: dict[int, _Conn] = {}
        errors: list[BaseException] = []
        lower = {p for p in plan if p < self.rank} if admit is None else set()
        acceptor = threading.Thread(target=self._accept_all, args=(lower, accepted, errors, deadline),
                                    daemon=True, name=f"distgrad-accept-{self.rank}")
        acceptor.start()
        try:
            for peer in sorted(p for p in plan if p > self.rank or admit is not None):
                try:
                    self._add(self._connect(peer, *plan[peer], deadline))
                except RuntimeError:
                    if listed is None or listed(peer):
                        raise
                    self._peers.discard(peer)  # it left the group while this one joined
        finally:
            acceptor.join(max(0.0, deadline - time.monotonic()) + 1)
        if errors:
            raise errors[0]
        for conn in accepted.values():
            self._add(conn)
        missing = sorted(self._peers - set(self._conns))
        if missing:
            hint = next(filter(None, map(self._unreachable_hint, missing)), "")
            raise RuntimeError(f"worker {self.rank}: workers {missing} never connected within "
                               f"{_CONNECT_TIMEOUT:.0f} s{hint}")
        self._open_poller()
        now = time.monotonic()
        for peer in self._conns:
            self._last_recv[peer] = now
            self._last_sent[peer] = 0.0
        self._running = True
        self.pool.start()

    def _plan(self, peer: int, full: str) -> tuple[str | None, str]:
        """Check a peer's published address and choose how to reach it: (Unix
        socket name or None, TCP address)."""
        addr, *tagged = full.split("#")
        tags = dict(t.partition("=")[::2] for t in tagged)
        self._check_peer(peer, addr, tags)
        same = bool(self.host_id) and tags.get(_HOST_TAG) == self.host_id
        if same and _SHM_TAG in tags and self.shm_threshold > 0 and shm.host_id():
            self._shm_peers[peer] = shm.owner_prefix(int(tags[_SHM_TAG]), peer)
        return (tags[_UNIX_TAG] if same and _UNIX_TAG in tags and self._unix else None, addr)

    def _check_peer(self, peer: int, addr: str, tags: dict) -> None:
        if self._secret and _AUTH_TAG not in tags:
            raise RuntimeError(f"worker {peer} ({addr}) runs without the cluster secret "
                               "(DISTGRAD_SECRET) while this worker has one")
        if not self._secret and _AUTH_TAG in tags:
            raise RuntimeError(f"worker {peer} ({addr}) requires the cluster secret "
                               "(DISTGRAD_SECRET) and this worker has none")
        if (_ENC_TAG in tags) != self.encrypt:
            raise RuntimeError(f"worker {peer} ({addr}) runs with encryption "
                               f"{'on' if _ENC_TAG in tags else 'off'} and this worker with it "
                               f"{'on' if self.encrypt else 'off'} (DISTGRAD_ENCRYPT)")
        if self._auth is not None:
            self._auth.set_peer_nonce(peer, bytes.fromhex(tags[_AUTH_TAG]))

    def _unreachable_hint(self, peer: int) -> str:
        """Why ``peer`` may never connect, if it is on another host (or network
        namespace): a loopback address on either side ("" otherwise)."""
        addr, *tagged = self._addresses.get(peer, "").split("#")
        tags = dict(t.partition("=")[::2] for t in tagged)
        if not self.host_id or tags.get(_HOST_TAG, self.host_id) == self.host_id:
            return ""
        mine = self._tcp.getsockname()[0] if self._tcp is not None else ""
        return netaddr.loopback_hint(self.rank, mine, peer, addr)

    def _connect(self, peer: int, unix: str | None, addr: str, deadline: float) -> _Conn:
        while True:
            sock = self._dial(peer, unix, addr, deadline)
            try:
                cc, sc = client_handshake(sock, self.rank, peer, self._secret, self.encrypt,
                                          min(deadline, time.monotonic() + 3 * HANDSHAKE_SECONDS),
                                          mac_all=self._mac_all(sock))
                return self._conn(peer, sock, cc, sc)
            except (HandshakeError, OSError) as e:
                # dropped by the peer's gate (strangers crowd it) or torn: try again;
                # a verdict (another secret, a rank not expected) is final
                sock.close()
                if isinstance(e, Refused) or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.rank}: handshake with worker {peer} failed: "
                                       f"{e}") from e
                time.sleep(0.05)

    def _dial(self, peer: int, unix: str | None, addr: str, deadline: float) -> socket.socket:
        host, _, port = addr[len("tcp://"):].rpartition(":")
        while True:
            try:
                if unix:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    target = "\0" + unix[1:] if unix.startswith("@") else unix
                else:
                    host = host.strip("[]")
                    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                    target = (host, int(port))
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                sock.connect(target)
                return sock
            except OSError as e:
                sock.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.rank} could not connect to worker {peer} at "
                                       f"{unix or addr}: {e}{self._unreachable_hint(peer)}") from e
                time.sleep(0.05)

    def _mac_all(self, sock: socket.socket) -> bool:
        """Whether every byte on ``sock`` is MAC'd: TCP (bytes that cross a network),
        with a secret, encryption off (it covers every byte anyway), unless
        ``DISTGRAD_MAC_TENSORS=0`` (see :mod:`.auth`)."""
        return (self._auth is not None and self.mac_tensors
                and sock.family != getattr(socket, "AF_UNIX", None))

    def _conn(self, peer: int, sock: socket.socket, cc: bytes, sc: bytes) -> _Conn:
        """The connection to ``peer`` whose handshake exchanged challenges ``cc`` (the
        connecting side's) and ``sc``: its keys, encryption's or the MAC's, are bound to
        them, so no key or message of another connection works on it."""
        cipher = None
        if self.encrypt:
            from .crypto import FrameCipher
            cipher = FrameCipher(self._secret, self.rank, peer, cc, sc)
        elif self._auth is not None:
            self._auth.bind(peer, cc, sc)
        if sock.family != getattr(socket, "AF_UNIX", None):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return _Conn(peer, sock, self.max_message_size, cipher, self._mac_all(sock))

    def _accept_all(self, lower: set[int], accepted: dict, errors: list, deadline: float) -> None:
        """Accept until every lower rank connected: each handshake on a thread of
        its own through the gate (:mod:`.gate`), so no stranger holds the door."""
        listeners = [s for s in (self._unix, self._tcp) if s is not None]
        lock = threading.Lock()
        # a finished handshake wakes the loop at once (it would otherwise notice the
        # last one only at select's next timeout: 50 ms added to the group's start)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)

        def expect(rank: int) -> bool:
            with lock:
                return rank in lower and rank not in accepted

        def handshake(sock: socket.socket) -> None:
            try:
                peer, cc, sc = server_handshake(sock, self.rank, self._secret, self.encrypt, expect,
                                                mac_all=self._mac_all(sock))
                conn = self._conn(peer, sock, cc, sc)
            except (HandshakeError, OSError) as e:
                # Never fatal: anyone can connect. A peer of the cluster with
                # other settings was already refused from its address tags
                # (_check_peer), on both sides.
                self._refusals.warning("worker %d: refused a connection: %s", self.rank, e)
                sock.close()
                return
            with lock:
                accepted[peer] = conn
            with contextlib.suppress(OSError):
                wake_w.send(b"\0")

        # selectors, not select.select: past 1,023 (the open-file limit is raised at
        # start-up) select cannot watch a descriptor
        sel = selectors.DefaultSelector()
        paused: dict[socket.socket, float] = {}   # listeners out of descriptors, until
        try:
            sel.register(wake_r, selectors.EVENT_READ)
            for ls in listeners:
                sel.register(ls, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                with lock:
                    if not lower - set(accepted):
                        break
                now = time.monotonic()
                for ls, until in list(paused.items()):
                    if now >= until:
                        del paused[ls]
                        sel.register(ls, selectors.EVENT_READ)
                for key, _ in sel.select(0.05):
                    ls = key.fileobj
                    if ls is wake_r:
                        with contextlib.suppress(OSError):
                            wake_r.recv(4096)
                        continue
                    sock, pause = self._acceptor.accept(ls)
                    if pause:   # not even shedding worked: stop watching it a while
                        sel.unregister(ls)
                        paused[ls] = now + pause
                    elif sock is not None:
                        self._gate.serve(sock, handshake, f"distgrad-handshake-{self.rank}")
        except BaseException as e:  # noqa: BLE001 - reported by start()
            errors.append(e)
        finally:
            sel.close()
            wake_r.close()
            wake_w.close()

    def _accept_late(self, fd: int) -> None:
        """A connection after start-up, handshaken on a short-lived thread through
        the gate (so that a refusal says why, and no reading thread waits for a
        stranger). In a dynamic group a member that joins is admitted (see
        :meth:`start`); otherwise every peer is connected and it is refused."""
        ls = self._tcp if self._tcp is not None and fd == self._tcp.fileno() else self._unix
        if ls is None:
            return
        sock, pause = self._acceptor.accept(ls)
        if pause:   # no descriptor even to shed the queue: the poller would report it ready
            self._unwatch(ls, pause)   # again at once, for ever; look again later
            return
        if sock is None:
            return
        if self._closing:
            sock.close()
            return
        self._gate.serve(sock, self._handshake_late, f"distgrad-handshake-{self.rank}")

    def _handshake_late(self, sock: socket.socket) -> None:
        def expect(rank: int) -> bool:
            # a joiner: a rank not connected now, that the group lists (see start)
            if self._admit is None or self._closing or rank == self.rank:
                return False
            conn = self._conns.get(rank)
            if conn is not None and not conn.lost:
                return False
            full = self._admit(rank)
            if full is None:
                return False
            self.forget(rank)  # what is left of an earlier incarnation under this rank
            self._addresses[rank] = full
            self._plan(rank, full)  # its nonce and shared memory, before any message
            return True

        try:
            peer, cc, sc = server_handshake(sock, self.rank, self._secret, self.encrypt, expect,
                                                mac_all=self._mac_all(sock))
            conn = self._conn(peer, sock, cc, sc)
            now = time.monotonic()
            self._last_recv[peer], self._last_sent[peer] = now, 0.0
            with self._lose_lock:
                self._lost.discard(peer)
                self._peers.add(peer)
                self._add(conn)
            joined = getattr(self._handler, "on_peer_joined", None)
            if joined is not None:  # before anything it sends is read
                with self._dispatch:
                    self._guard(lambda: joined(peer))
            self._register(conn)
            log.debug("worker %d: worker %d joined", self.rank, peer)
        except (HandshakeError, OSError, RuntimeError) as e:
            self._refusals.warning("worker %d: refused a connection: %s", self.rank, e)
            sock.close()

    def forget(self, peer: int) -> None:
        """Drop what is left of a lost peer (its connection, counters, shared
        memory), so that its rank can connect again as a new process."""
        with self._lose_lock:
            conn = self._conns.get(peer)
            if conn is not None and not conn.lost:
                return
            self._conns.pop(peer, None)
            if conn is not None:
                self._by_fd.pop(conn.fd, None)
            self._peers.discard(peer)
            self._lost.discard(peer)
        self._shm_peers.pop(peer, None)
        self._last_recv.pop(peer, None)
        self._last_partial.pop(peer, None)
        self._detector.forget(peer)
        self._last_sent.pop(peer, None)
        if conn is not None:
            try:
                conn.sock.close()
            except OSError:
                pass
