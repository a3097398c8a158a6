"""The sending half of :class:`~.socket_transport.SocketTransport` (a mixin;
the state it uses lives on the transport).

The thread that makes a call sends it, under the peer's write lock. Every
message goes through the connection's queue (``conn.deferred``), and whoever
holds the write lock seals (MAC or encryption) *everything* queued and sends it
with one ``sendmsg`` (frames as separate iovecs, ``framing._IOV_MAX`` a call):
a thread that finds the lock taken appends its message and leaves, when it is a
reading thread, or waits for the holder otherwise; the holder looks at the
queue again after releasing the lock, so nothing queued stays behind. Many
messages to one peer (a fan-out, an all-to-all, replies from several pool
threads) thus cost few system calls. A reading thread never blocks on a full
socket: what does not fit waits in ``conn.outq`` for the poller.

Example::

    >>> t.send(1, [envelope, tensor_bytes])     # from any thread
    >>> t.batches                                # [batches, messages, reads, messages read]
    [1, 1, 0, 0]
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from . import framing, shm
from .opening import _Conn

_HEARTBEAT = b"\xffHB"
_GOODBYE = b"\xffBYE"


class Sending:
    """send(); the batching write path; the goodbye."""

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
