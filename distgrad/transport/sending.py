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

import logging
import threading
import time
from collections.abc import Sequence

from . import framing, shm
from .opening import _Conn

log = logging.getLogger("distgrad.transport.socket_transport")

_HEARTBEAT = b"\xffHB"
_GOODBYE = b"\xffBYE"
_SOON_MAX_BYTES = 64 << 10   # send_soon: larger messages go at once


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
        nbytes = 0
        for f in frames:  # (a loop, not sum() over a generator: this runs per message)
            nbytes += memoryview(f).nbytes
        st = self.stats[peer]
        if peer in self._shm_peers:  # the copy into shared memory runs here, on the sender
            packed = self._shm_writer.pack(frames, self.shm_threshold, peer)
            if packed is not None:
                frames = packed
                st[4] += 1
        self._send(conn, frames)
        st[0] += 1
        st[1] += nbytes

    def send_soon(self, peer: int, frames: Sequence) -> None:
        """Send ``frames`` to ``peer`` with the next message this worker sends it, and
        at the latest at the transport's next periodic tick (``heartbeat_interval`` / 2):
        a one-way message nobody waits for (a context's release) then costs no
        ``sendmsg``, no timer and no wake-up of its own on either side. Order is kept:
        it goes before anything sent to ``peer`` after it.

        Example::

            >>> t.send_soon(1, frames)   # goes with the next call to worker 1
        """
        conn = self._conns.get(peer)
        nbytes = 0
        for f in frames:
            nbytes += memoryview(f).nbytes
        if peer == self.rank or conn is None or conn.lost or nbytes > _SOON_MAX_BYTES:
            self.send(peer, frames)
            return
        st = self.stats[peer]
        st[0] += 1
        st[1] += nbytes
        conn.deferred.append(frames)   # (the tick sends what is still queued then)

    def _send(self, conn: _Conn, frames: Sequence | None) -> None:
        # Every message goes through ``conn.deferred`` and whoever holds the write
        # lock sends it, in order. A reading thread never waits for that lock: its
        # holder may be waiting for the peer to read, and the peer for this thread
        # to read (both sides sending big messages at once). Each holder checks the
        # queue again after releasing the lock, so nothing queued is left behind.
        # A send nested inside the holder's own (an RRef freed by the garbage collector
        # during a write sends its delete) only queues: the holder's loop sends it next.
        reading = getattr(self._tls, "reading", False)
        if frames is not None:   # (None: send what is queued: the tick, see send_soon)
            conn.deferred.append(frames)
        me = threading.get_ident()
        if conn.wowner == me:
            return
        if reading:
            if not conn.wlock.acquire(False):
                return
        else:
            conn.wlock.acquire()
        popped: list = []  # the batch being sealed (see _write)
        while True:
            try:
                self._drain(conn, reading, me, popped)
                return
            except BaseException as e:  # noqa: BLE001 - re-raised below unless an Exception
                if conn.wowner == me:  # the lock is still this thread's: let go of it
                    conn.wowner = 0
                    conn.wlock.release()
                self._send_broke(conn, popped, e)
                if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the caller's
                    if conn.outq:  # (what others queued meanwhile goes with the next send
                        self._arm(conn)  # or heartbeat)
                    raise
            # the connection stays: send what other threads queued meanwhile
            if conn.lost or not conn.deferred or not conn.wlock.acquire(False):
                if conn.outq:
                    self._arm(conn)
                return

    def _drain(self, conn: _Conn, reading: bool, me: int, popped: list) -> None:
        """Send what is queued for ``conn`` (write lock held; released here), again
        while more arrives and the lock is free."""
        conn.wowner = me
        arm = False
        failed = None
        while True:
            try:
                if conn.deferred and not conn.lost:
                    arm |= self._write(conn, reading, popped)
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

    def _send_broke(self, conn: _Conn, popped: list, err: BaseException) -> None:
        """Something other than an OSError raised while this thread held ``conn``'s
        write lock (released by now). Raised while sealing a batch (``popped``
        holds its messages, none of them sent): the stream is whole, the
        connection stays, and the handler's ``on_send_failed`` hears of every
        message of the batch, whichever thread queued it (their calls fail).
        Raised while writing (a KeyboardInterrupt in a large send): part of a
        message may be on the wire, so the peer is lost, as on a broken
        connection (every call to it fails)."""
        peer = conn.peer
        if not popped:
            log.error("worker %d: sending to worker %d was interrupted (%r): the connection "
                      "is closed", self.rank, peer, err)
            self._lose(peer, f"a send was interrupted: {err!r}", graceful=False)
            return
        log.error("worker %d: %d message(s) to worker %d could not be sealed and were not "
                  "sent: %r", self.rank, len(popped), peer, err, exc_info=err)
        # the frames the handler gave (no shared-memory descriptor); transport frames
        # (heartbeats, goodbye, segment drops) are nobody's to report
        messages = [m[shm.parsed_frames(m) - 1:] for m in popped
                    if not (len(m) == 1 and bytes(memoryview(m[0])[:1]) == b"\xff")]
        popped.clear()
        report = getattr(self._handler, "on_send_failed", None)
        if messages and report is not None:
            self._guard(lambda: report(peer, messages, err))

    def _write(self, conn: _Conn, reading: bool, popped: list) -> bool:
        """Seal every message queued for ``conn`` and send them all with one
        ``sendmsg`` (write lock held: messages other threads queued meanwhile go
        with this thread's); returns whether the poller must flush the rest (a
        reading thread never blocks on a full socket). ``popped`` holds the
        messages taken off the queue until they are all sealed (what an error
        while sealing leaves unsent: see _send_broke); empty once they are."""
        deferred, cipher, auth, peer = conn.deferred, conn.cipher, self._auth, conn.peer
        views: list = []
        n = 0
        mark = (cipher.send_mark() if cipher is not None else
                auth.send_mark(peer) if auth is not None else 0)
        try:
            while deferred:  # a send nested in coalesce (an RRef's delete) joins this batch
                frames = deferred.popleft()
                popped.append(frames)
                if cipher is not None:
                    frames = cipher.seal(list(frames))
                elif auth is not None:
                    f0 = frames[0]  # shm.parsed_frames, inlined for the common bytes envelope
                    full = ((2 if f0[:4] == shm.MARK else 1) if type(f0) is bytes
                            else shm.parsed_frames(frames))
                    frames = (auth.seal(peer, list(frames), full, True) if conn.mac_all
                              else auth.seal(peer, list(frames), full))
                views += framing.coalesce(frames)
                n += 1
        except BaseException:
            # none of the batch is sent: its sequence numbers are not used (the
            # receiver takes a gap for a message deleted on the path)
            if cipher is not None:
                cipher.rewind(mark)
            elif auth is not None:
                auth.rewind(peer, mark)
            raise
        popped.clear()
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
                        msg = self._auth.seal(conn.peer, list(msg), shm.parsed_frames(msg),
                                              conn.mac_all)
                    conn.outq.extend(framing.coalesce(msg))
                conn.deferred.clear()
                end = time.monotonic() + max(linger, 0.05)
                while conn.outq and time.monotonic() < end:
                    conn.outq[:] = framing.send_some(conn.sock, conn.outq)
                    if conn.outq:
                        framing.wait_writable(conn.sock, max(0.0, end - time.monotonic()))
            except OSError:
                pass
            except Exception as e:  # noqa: BLE001 - a seal that fails must not stop close()
                log.error("worker %d: could not say goodbye to worker %d: %r", self.rank,
                          conn.peer, e)
            finally:
                conn.wowner = 0
