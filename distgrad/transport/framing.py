"""Length-prefixed messages on a stream socket.

A message is a list of frames. On the wire::

    count (u32) | length of each frame (u64 each) | frame bytes, in order

:func:`pack_header` makes the prefix; the sender passes it and the frames to
``sendmsg`` as separate iovecs (the frames are never copied into a message).
:class:`FrameReader` parses what arrives: small frames are cut out of one
reusable read buffer (one ``recv_into`` usually brings a whole small message),
a large frame gets its own buffer and the rest of it is read straight into it
with ``recv_into``: received tensors are built on these buffers, no copy.
Counts and lengths are checked against the reader's bounds before anything is
allocated, so a peer cannot make a worker reserve memory it did not send.

Example::

    >>> a, b = socket.socketpair()
    >>> send_frames(a, [b"envelope", b"tensor bytes"])
    >>> FrameReader(1 << 20).read(b)
    [[bytearray(b'envelope'), bytearray(b'tensor bytes')]]
"""
from __future__ import annotations

import select
import socket
import struct
from collections.abc import Sequence

import torch

_COUNT = struct.Struct("!I")
MAX_FRAMES = 1 << 16          # frames per message (a message has 1 + its tensors)
_IOV_MAX = 512                # iovecs per sendmsg (the platform allows at least 1024)
_BUF = 256 << 10              # reusable read buffer
_DIRECT = 32 << 10            # frames from this size are read into their own buffer
_SMALL = 4 << 10              # below this, frames are joined into one send
_SENDMSG = hasattr(socket.socket, "sendmsg")


class FrameError(Exception):
    """The stream broke the framing rules (a bound exceeded, a torn message)."""


def pack_header(frames: Sequence) -> bytes:
    """The prefix of a message made of ``frames``."""
    n = len(frames)
    return struct.pack(f"!I{n}Q", n, *[memoryview(f).nbytes for f in frames])


def _views(frames: Sequence) -> list[memoryview]:
    out = [memoryview(pack_header(frames))]
    for f in frames:
        v = memoryview(f)
        if v.nbytes:
            out.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return out


def coalesce(frames: Sequence) -> list[memoryview]:
    """The iovecs of one message; runs of small frames joined into one (fewer iovecs
    cost less than the copy of a few KB). (:func:`_views` and :func:`pack_header`,
    inlined: this runs once per message sent.)"""
    sizes = []
    views = []
    total = 0
    small = True
    for f in frames:
        v = memoryview(f)
        n = v.nbytes
        sizes.append(n)
        if n:
            total += n
            views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
            if n >= _SMALL:
                small = False
    head = struct.pack(f"!I{len(sizes)}Q", len(sizes), *sizes)
    if (len(views) <= 1 or small and len(head) < _SMALL) and total + len(head) < _DIRECT:
        views.insert(0, head)
        return [memoryview(b"".join(views))]
    views.insert(0, memoryview(head))
    return views


def send_some(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Send as much of ``views`` as the socket takes now (one ``sendmsg`` per
    ``_IOV_MAX`` iovecs); returns what is left (empty when all went). Raises
    OSError when the connection is broken."""
    i, count = 0, len(views)
    while i < count:
        try:
            if _SENDMSG:
                n = sock.sendmsg(views[i:i + _IOV_MAX] if i or count > _IOV_MAX else views)
            else:  # Windows: no sendmsg; one send per buffer
                n = sock.send(views[i])
        except (BlockingIOError, InterruptedError):
            break
        while n:
            v = views[i]
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
            else:
                views[i] = v[n:]
                n = 0
    if i:
        del views[:i]
    return views


def send_frames(sock: socket.socket, frames: Sequence, timeout: float | None = None) -> None:
    """Send one whole message, waiting for the socket to drain as needed."""
    rest = send_some(sock, coalesce(frames))
    while rest:
        wait_writable(sock, timeout)
        rest = send_some(sock, rest)


def wait_writable(sock: socket.socket, timeout: float | None) -> bool:
    """Wait until ``sock`` takes more bytes (True) or ``timeout`` s pass (False)."""
    if not hasattr(select, "poll"):  # Windows
        return bool(select.select([], [sock], [], timeout)[1])
    p = select.poll()
    p.register(sock.fileno(), select.POLLOUT)
    return bool(p.poll(None if timeout is None else timeout * 1000))


def alloc(n: int):
    """A writable buffer of ``n`` bytes, uninitialized when large."""
    return _alloc(n)


def _alloc(n: int):
    # uninitialized (no memset of a buffer that recv_into fills anyway), writable
    return torch.empty(n, dtype=torch.uint8).numpy() if n >= _DIRECT else bytearray(n)


class FrameReader:
    """Parses the byte stream of one connection into messages (not thread safe:
    one reader at a time, which the connection's read lock ensures)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray(_BUF)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._lengths: tuple | None = None   # of the message being read
        self._frames: list = []
        self._big = None                      # the large frame being filled
        self._filled = 0
        self._eof = False
        self.received = 0                     # bytes read so far (liveness: any byte counts)

    def read(self, sock: socket.socket) -> list[list]:
        """Read what the socket has now; returns the messages it completed.

        Raises EOFError when the peer closed the stream, FrameError when it broke
        the rules, OSError when the connection failed."""
        out: list[list] = []
        if self._eof:
            raise EOFError
        while True:
            if self._big is not None:
                want = len(self._big) - self._filled
                try:
                    n = sock.recv_into(memoryview(self._big)[self._filled:], want)
                except (BlockingIOError, InterruptedError):
                    return out
                if n == 0:
                    return self._closed(out)
                self.received += n
                self._filled += n
                if n < want:
                    return out  # the socket is drained; wait for more
                self._frames.append(self._big)
                self._big = None
                self._parse(out)
                continue
            self._parse(out)
            if self._big is not None:
                continue
            if self._start == self._end:
                self._start = self._end = 0
            elif self._end == len(self._buf):  # compact: the unparsed tail to the front
                tail = self._end - self._start
                self._buf[:tail] = self._view[self._start:self._end]
                self._start, self._end = 0, tail
            space = len(self._buf) - self._end
            try:
                n = sock.recv_into(self._view[self._end:], space)
            except (BlockingIOError, InterruptedError):
                return out
            if n == 0:
                return self._closed(out)
            self.received += n
            self._end += n
            if n < space:  # drained: parse what came and let the poller say when there is more
                self._parse(out)
                if self._big is None:
                    return out

    def _closed(self, out: list[list]) -> list[list]:
        # the messages completed before the end first (a goodbye, say); EOF next time
        if not out:
            raise EOFError
        self._eof = True
        return out

    def pending(self) -> bool:
        """Whether part of a message is buffered (a torn message on close)."""
        return self._start != self._end or self._lengths is not None

    def _grow(self, size: int) -> None:
        """A read buffer of ``size`` bytes holding the unparsed bytes at its front."""
        tail = self._end - self._start
        buf = bytearray(size)
        buf[:tail] = self._view[self._start:self._end]
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, tail

    def _parse(self, out: list[list]) -> None:
        buf, view = self._buf, self._view
        while True:
            avail = self._end - self._start
            if self._lengths is None:
                if avail < 4:
                    return
                n = _COUNT.unpack_from(buf, self._start)[0]
                if not 0 < n <= MAX_FRAMES:
                    raise FrameError(f"a message of {n} frames (at most {MAX_FRAMES})")
                if avail < 4 + 8 * n:
                    if 4 + 8 * n > len(buf):  # up to MAX_FRAMES: at most 512 KiB
                        self._grow(4 + 8 * n)
                    return
                lengths = struct.unpack_from(f"!{n}Q", buf, self._start + 4)
                big = max(lengths)
                if big > self.max_frame:
                    raise FrameError(f"a frame of {big} bytes (at most {self.max_frame})")
                self._lengths = lengths
                self._frames = []
                self._start += 4 + 8 * n
                continue
            i = len(self._frames)
            if i == len(self._lengths):
                out.append(self._frames)
                self._frames, self._lengths = [], None
                continue
            size = self._lengths[i]
            avail = self._end - self._start
            if size <= avail:
                f = bytearray(size) if size < _DIRECT else _alloc(size)
                memoryview(f)[:] = view[self._start:self._start + size]
                self._start += size
                self._frames.append(f)
                continue
            if size >= _DIRECT:  # the rest goes straight into its own buffer
                f = _alloc(size)
                memoryview(f)[:avail] = view[self._start:self._end]
                self._start = self._end = 0
                self._big, self._filled = f, avail
            return
