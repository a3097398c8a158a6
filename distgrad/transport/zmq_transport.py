"""ZeroMQ over TCP.

Each worker binds one ROUTER socket for everything it receives and connects
one DEALER per peer for everything it sends (requests and replies alike).
Every message starts with a transport frame naming the sender's rank (and,
with a secret, its sequence number and MAC), so zmq identities play no part
and a connection cannot take over another worker's.
A socket monitor on each DEALER reports a closed connection at once (a crashed
peer); heartbeats catch a peer that is alive but silent. All sockets live on
one I/O thread; other threads hand it work through a deque and a wake-up
socket pair.

With a cluster secret, every message (heartbeats included) is sealed with a
MAC (see :mod:`.auth`) and nothing reaches the handler before it verified;
forged, replayed or foreign messages are dropped and logged with the sending
address. The listening address carries this worker's auth nonce.

With ``encrypt`` (needs the secret), every connection is a ZeroMQ CURVE
session (Curve25519 + XSalsa20-Poly1305): the server keypair and each
client's keypair are derived from the cluster secret (:func:`.auth.curve_keys`),
so no key is distributed; a peer without the secret cannot complete the
handshake, and one without CURVE is refused at the greeting. The listening
address carries ``#curve=1`` so that a mixed cluster fails at start-up.

Between workers on the same host (same hostname and boot id, learnt from the
listening address) frames of at least ``shm_threshold`` bytes travel through
reused /dev/shm segments instead of TCP (see :mod:`.shm`): one warm copy on the
sending thread instead of two through the kernel into a fresh buffer, and a
zero-copy view on the receiver, whose release frees the segment in place.
"""
from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import shm
from .auth import Authenticator, AuthError, curve_keys
from .base import Timer, Transport, TransportHandler
from .waker import Waker

log = logging.getLogger(__name__)

_HEARTBEAT = b"\xffHB"
_GOODBYE = b"\xffBYE"
_RANK = struct.Struct("!I")
_SNDMORE = int(zmq.SNDMORE)
_COPY_THRESHOLD = 1 << 20
_NOBLOCK = int(zmq.NOBLOCK)
_SHM_TAG = "shm"
_AUTH_TAG = "auth"
_CURVE_TAG = "curve"
DEFAULT_MAX_MESSAGE_SIZE = 1 << 33  # bytes per frame; bounds what a peer can make us allocate
# Frames at least DISTGRAD_SHM_THRESHOLD bytes (0: never) go through reused
# /dev/shm segments between same-host workers. Below ~256 KiB TCP over loopback
# is as fast and needs no segment bookkeeping (bench/rpc_bench.py).
DEFAULT_SHM_THRESHOLD = 256 << 10


def _default_shm_threshold() -> int:
    value = os.environ.get("DISTGRAD_SHM_THRESHOLD")
    return int(value) if value else DEFAULT_SHM_THRESHOLD


class ZmqTransport(Transport):
    """pyzmq transport; see the module docstring.

    Example::

        >>> t = ZmqTransport(rank=0)
        >>> addr = t.listen("127.0.0.1")          # publish addr, learn the others
        >>> t.start(handler, {1: "tcp://127.0.0.1:5555"})
        >>> t.send(1, [b"frame"])
    """

    def __init__(self, rank: int, heartbeat_interval: float = 0.5,
                 heartbeat_deadline: float = 4.0, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
                 shm_threshold: int | None = None, secret: bytes | None = None,
                 encrypt: bool = False) -> None:
        if encrypt and not secret:
            raise ValueError("encryption (DISTGRAD_ENCRYPT / encrypt=True) derives its keys from "
                             "the cluster secret: set DISTGRAD_SECRET")
        self.rank = rank
        self.encrypt = bool(encrypt)
        self._secret = secret
        self._auth = Authenticator(secret, rank) if secret else None
        self._rank_bytes = _RANK.pack(rank)
        self._rejected: collections.Counter = collections.Counter()
        self.shm_threshold = _default_shm_threshold() if shm_threshold is None else shm_threshold
        self.host_id = shm.host_id() if self.shm_threshold > 0 else ""
        self._shm_peers: dict[int, str] = {}  # same-host peer -> its shm file prefix
        self._shm_writer = shm.ShmWriter(rank)
        self._shm_reader = shm.ShmReader()
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_deadline = heartbeat_deadline
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        if max_message_size > 0:
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        if self.encrypt:
            self._router.curve_server = True
            self._router.curve_secretkey = curve_keys(secret, "server")[1]
        self._dealers: dict[int, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, int] = {}
        self._last_recv: dict[int, float] = {}
        self._last_sent: dict[int, float] = {}
        self._lost: set[int] = set()
        self._queue: collections.deque = collections.deque()
        self._timers: list[Timer] = []
        self._after: list[Callable[[], None]] = []
        self._waker = Waker()
        self._wake_pending = False
        self._handler: TransportHandler | None = None
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None
        self._running = False
        self._closing = False
        self.stats: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])

    # -- any thread --------------------------------------------------------
    def listen(self, host: str) -> str:
        self._router.bind(f"tcp://{host}:0")
        addr = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.host_id:
            addr += f"#{_SHM_TAG}={self.host_id}|{os.getpid()}"
        if self._auth is not None:
            addr += f"#{_AUTH_TAG}={self._auth.nonce.hex()}"
        if self.encrypt:
            addr += f"#{_CURVE_TAG}=1"
        return addr

    def start(self, handler: TransportHandler, peers: Mapping[int, str]) -> None:
        self._handler = handler
        now = time.monotonic()
        for peer, full in peers.items():
            addr, *tagged = full.split("#")
            tags = dict(t.partition("=")[::2] for t in tagged)
            if self._auth is not None:
                if _AUTH_TAG not in tags:
                    raise RuntimeError(f"worker {peer} ({addr}) runs without the cluster secret "
                                       "(DISTGRAD_SECRET) while this worker has one")
                self._auth.set_peer_nonce(peer, bytes.fromhex(tags[_AUTH_TAG]))
            elif _AUTH_TAG in tags:
                raise RuntimeError(f"worker {peer} ({addr}) requires the cluster secret "
                                   "(DISTGRAD_SECRET) and this worker has none")
            if (_CURVE_TAG in tags) != self.encrypt:
                raise RuntimeError(f"worker {peer} ({addr}) runs with encryption "
                                   f"{'on' if _CURVE_TAG in tags else 'off'} and this worker with it "
                                   f"{'on' if self.encrypt else 'off'} (DISTGRAD_ENCRYPT)")
            peer_host, _, peer_pid = tags.get(_SHM_TAG, "").rpartition("|")
            if self.host_id and peer_host == self.host_id and peer_pid.isdigit():
                self._shm_peers[peer] = shm.owner_prefix(int(peer_pid), peer)
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.SNDHWM, 0)
            d.setsockopt(zmq.LINGER, 0)
            # pyzmq hands every zero-copy frame back through a Python thread (its
            # garbage collector): a wake-up per frame; below 1 MiB a memcpy is cheaper
            d.copy_threshold = _COPY_THRESHOLD
            if self.encrypt:
                d.curve_serverkey = curve_keys(self._secret, "server")[0]
                d.curve_publickey, d.curve_secretkey = curve_keys(self._secret, f"client{self.rank}")
            mon = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            d.connect(addr)
            self._dealers[peer] = d
            self._monitors[mon] = peer
            self._last_recv[peer] = now
            self._last_sent[peer] = 0.0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"distgrad-io-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def send(self, peer: int, frames: Sequence) -> None:
        if peer == self.rank:  # loopback (calls to self): copy, as a socket would, and
            body = [bytearray(memoryview(f)) for f in frames]  # deliver in queue order
            self.call_soon(lambda: self._handler.on_message(self.rank, body))
            return
        nbytes = sum(memoryview(f).nbytes for f in frames)
        if peer in self._shm_peers:
            # The copy into shared memory runs here, on the sending thread.
            frames = self._shm_writer.pack(frames, self.shm_threshold, peer) or frames
        self._queue.append((peer, frames, nbytes))
        self._wake()

    def uses_shm(self, peer: int) -> bool:
        """Whether large frames to ``peer`` go through shared memory."""
        return peer in self._shm_peers

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._queue.append((None, fn, 0))
        self._wake()

    def on_io_thread(self) -> bool:
        return threading.get_ident() == self._io_ident

    def after_batch(self, fn: Callable[[], None]) -> None:
        self._after.append(fn)

    def call_later(self, delay: float, fn: Callable[[], None], wake: bool = True) -> Timer:
        timer = Timer(time.monotonic() + delay, fn)
        self._queue.append((None, lambda: heapq.heappush(self._timers, timer), 0))
        if wake:
            self._wake()
        return timer

    def close(self, linger: float = 1.0) -> None:
        if self._thread is None:
            self._close_sockets(0)
            return
        done = threading.Event()

        def goodbye():
            self._closing = True
            for peer in self._dealers:
                if peer not in self._lost:
                    self._send_now(peer, [_GOODBYE])
            done.set()
        if self._running:
            self.call_soon(goodbye)
            done.wait(5)
        self._running = False
        self._wake()
        self._thread.join(10)
        self._close_sockets(linger)

    def _close_sockets(self, linger: float) -> None:
        for mon in self._monitors:
            mon.close(0)
        for d in self._dealers.values():
            d.close(int(linger * 1000))
        self._router.close(0)
        self._shm_writer.cleanup()
        self._waker.close()
        self._ctx.term()

    def _wake(self) -> None:
        # On the I/O thread the loop drains the queue before it polls again; a wake-up
        # byte there is a wasted syscall (and a chance to lose the GIL).
        if not self._wake_pending and not self.on_io_thread():
            self._wake_pending = True
            self._waker.wake()

    # -- I/O thread --------------------------------------------------------
    def _loop(self) -> None:
        self._io_ident = threading.get_ident()
        poller = zmq.Poller()
        router = self._router
        wake_fd = self._waker.fileno()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_fd, zmq.POLLIN)
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        monitors = self._monitors
        queue = self._queue
        timers = self._timers
        after = self._after
        monotonic = time.monotonic
        poll = poller.poll
        # Check twice per interval: a peer hears from us at least every 1.5
        # intervals, and a silent one is noticed at most interval/2 past its deadline.
        interval = self.heartbeat_interval / 2
        next_beat = monotonic()
        while self._running:
            now = monotonic()
            if now >= next_beat:
                self._heartbeat(now)
                next_beat = now + interval
            if queue:
                wait = 0
            else:
                wait = next_beat - now
                if timers and timers[0].when - now < wait:
                    wait = timers[0].when - now
                # whole milliseconds, rounded up: zmq would turn 0.4 ms into 0 and spin
                wait = math.ceil(wait * 1000) if wait > 0 else 0
            if after:  # hand-offs last: the threads they wake find the GIL free soon
                self._run_after()
                if queue:
                    wait = 0
            try:
                events = poll(wait)
            except zmq.ZMQError:
                if not self._running:
                    break
                raise
            if events:
                for sock, _ in events:
                    if sock == wake_fd:
                        self._clear_wake()
                if queue:
                    self._drain()
                for sock, _ in events:
                    if sock is router:
                        self._receive()
                    elif sock != wake_fd:
                        peer = monitors.get(sock)
                        if peer is not None:
                            self._on_monitor(sock, peer)
            elif queue:
                self._drain()
            if timers and timers[0].when <= monotonic():
                self._run_timers()
        self._run_after()

    def _clear_wake(self) -> None:
        # Read first, then reset the flag, then (the caller) drain the queue: an
        # item queued before the reset is drained now; one queued after it sees
        # the flag down and writes a new byte. Resetting first could swallow the
        # byte of a wake-up that raced in between and leave the flag up forever.
        self._waker.clear()
        self._wake_pending = False

    def _drain(self) -> None:
        q = self._queue
        now = time.monotonic()
        while q:
            peer, item, nbytes = q.popleft()
            if peer is None:
                self._guard(item)
                continue
            if peer in self._lost:
                continue
            if peer not in self._dealers:
                log.error("worker %d: no connection to worker %d", self.rank, peer)
                continue
            self._send_now(peer, item)
            self._last_sent[peer] = now
            st = self.stats[peer]
            st[0] += 1
            st[1] += nbytes

    def _send_now(self, peer: int, frames: Sequence) -> None:
        if self._auth is not None:
            frames = self._auth.seal(peer, frames, shm.parsed_frames(frames))
            frames[0] = self._rank_bytes + frames[0]
        else:
            frames = [self._rank_bytes, *frames]
        # send_multipart minus its per-frame flag enums (measurably slower)
        send = self._dealers[peer].send
        last = len(frames) - 1
        for i, f in enumerate(frames):
            send(f, _SNDMORE if i < last else 0, copy=False)

    def _reject(self, frame, why: str) -> None:
        try:
            addr = frame.get("Peer-Address")
        except Exception:  # noqa: BLE001 - older libzmq
            addr = "unknown address"
        self._rejected[addr] += 1
        n = self._rejected[addr]
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th...: a flood cannot fill the log
            log.warning("worker %d: dropped a message from %s (%s; %d so far)", self.rank, addr, why, n)

    def _receive(self) -> None:
        router = self._router
        handler = self._handler
        dealers, lost = self._dealers, self._lost
        now = time.monotonic()
        recv = router.recv
        for _ in range(1000):
            try:
                f = recv(_NOBLOCK, copy=False)  # zmq's routing id (unused)
            except zmq.Again:
                return
            frames = []
            while f.more:  # a multipart message arrives whole: these never block
                f = recv(0, copy=False)
                frames.append(f)
            # frames[0] is our transport frame
            if len(frames) < 2 or len(frames[0]) < 4:
                self._reject(f, "no transport frame")
                continue
            head = frames[0].bytes
            peer = _RANK.unpack_from(head)[0]
            if peer not in dealers or peer in lost:
                if peer not in dealers:
                    self._reject(f, f"unknown worker id {peer}")
                continue
            # Zero-copy, writable buffers: received tensors are built on them.
            body = [fr.buffer for fr in frames[1:]]
            if self._auth is not None:
                try:
                    # what the receiver parses must be covered in full
                    body = self._auth.open(peer, [head[4:], *body], shm.parsed_frames(body))
                except AuthError as e:
                    self._reject(f, f"claims to be worker {peer}: {e}")
                    continue
            elif len(head) != 4:
                self._reject(f, "authenticated message, but this worker has no secret")
                continue
            self._last_recv[peer] = now
            first = body[0]
            if len(body) == 1 and first[:1] == b"\xff":
                self._on_transport_frame(peer, first)
                continue
            try:
                if first[:4] == shm.MARK:
                    prefix = self._shm_peers.get(peer)
                    if prefix is None:
                        self._reject(frames[-1], f"worker {peer} sent shared memory, not on this host")
                        continue
                    body = self._shm_reader.unpack(prefix, body)
                st = self.stats[peer]
                st[2] += 1
                st[3] += sum(b.nbytes for b in body)
                handler.on_message(peer, body)
            except Exception:
                log.exception("worker %d: error on the I/O thread", self.rank)

    def _on_transport_frame(self, peer: int, frame) -> None:
        mark = frame[:4]
        if frame == _GOODBYE:
            self._lose(peer, "shut down", graceful=True)
        elif mark == shm.DROP:
            self._shm_reader.forget(shm.parse_names(frame))
        # else a heartbeat: its arrival was all it had to say

    def _send_drops(self, drops: Mapping[int, list]) -> None:
        for peer, names in drops.items():
            if peer not in self._lost and peer in self._dealers:
                self._send_now(peer, [shm.names_frame(names)])

    def _on_monitor(self, mon, peer: int) -> None:
        try:
            while True:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
                if msg["event"] == zmq.EVENT_DISCONNECTED and not self._closing:
                    self._lose(peer, "connection closed", graceful=False)
        except zmq.Again:
            pass

    def _heartbeat(self, now: float) -> None:
        deadline = self.heartbeat_deadline
        stalled = now - getattr(self, "_last_beat", now) - self.heartbeat_interval
        self._last_beat = now
        if stalled > self.heartbeat_interval:
            # This loop did not run for a while (the process was starved or
            # stopped): peers' silence over that time is not theirs to answer for.
            for p in self._last_recv:
                self._last_recv[p] += stalled
        if any(now - t > deadline for p, t in self._last_recv.items() if p not in self._lost):
            # This thread may itself have been starved (CPU contention, a long GIL
            # hold, SIGSTOP): read what already arrived before calling anyone silent.
            self._receive()
            now = time.monotonic()
        if self._shm_peers:
            self._send_drops(self._shm_writer.expire())
        for peer in self._dealers:
            if peer in self._lost:
                continue
            if now - self._last_recv[peer] > deadline:
                self._lose(peer, f"no heartbeat for {now - self._last_recv[peer]:.1f} s",
                           graceful=False)
                continue
            if now - self._last_sent[peer] >= self.heartbeat_interval:
                self._send_now(peer, [_HEARTBEAT])
                self._last_sent[peer] = now

    def _lose(self, peer: int, reason: str, graceful: bool) -> None:
        if peer in self._lost:
            return
        self._lost.add(peer)
        prefix = self._shm_peers.get(peer)
        if prefix is not None:  # its segments, and ours it held
            self._shm_reader.forget_prefix(prefix)
            shm.remove_prefix(prefix)
            self._shm_writer.peer_lost(peer)
        self._guard(lambda: self._handler.on_peer_lost(peer, reason, graceful))

    def _run_after(self) -> None:
        after = self._after
        i = 0
        while i < len(after):  # in order; one may add more
            self._guard(after[i])
            i += 1
        after.clear()

    def _run_timers(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0].when <= now:
            t = heapq.heappop(timers)
            if not t.cancelled:
                self._guard(t.fn)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("worker %d: error on the I/O thread", self.rank)
