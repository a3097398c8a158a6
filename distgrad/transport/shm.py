"""Same-host shared-memory path for large frames, through reused segments.

A sender keeps a pool of *segments*: files under ``/dev/shm`` (sizes rounded up
to a power of two), each mapped once. A large frame is copied into a free
segment on the sending thread (one copy, without the GIL) and the message
carries only the segment's name and the frame's size. The receiver maps each
segment once and hands out a zero-copy view of it; when the last tensor built
on that view is gone, a finalizer clears the segment's *in-use* byte (its first
byte, in the shared mapping itself: no message, no wake-up), and the sender
may take it again. A reused segment costs one warm memcpy, where TCP costs two
copies through the kernel plus a fresh, page-faulting buffer per message.

Bounds: free segments beyond ``pool_bytes`` (least recently used first) and
those idle for ``idle_s`` are unlinked, and the receivers that mapped them are
told to forget them (a ``DROP`` frame, rare). A segment a receiver holds is
never reused until it is released. Segments in use by a lost peer are
unlinked; all of a sender's files are removed when it closes, and a receiver
removes a lost sender's files by name prefix. Names are never reused, so a
stale mapping never aliases a new segment.

Only used between workers that share a host *and* a boot (hostname + boot id,
exchanged through the listening address at rendezvous); otherwise frames go
over TCP.
"""
from __future__ import annotations

import collections
import glob
import itertools
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
import weakref

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MARK = b"\xffSHM"   # a message whose large frames are in segments
DROP = b"\xffSHD"   # sender -> receiver: forget these segments (they are gone)
_HEAD = 64          # byte 0: in use (set by the sender, cleared by the receiver); data after
_ENTRY = struct.Struct("!IQ")  # frame index, size; followed by the name
_PREFIX = "distgrad-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MIN_SEGMENT = 1 << 16
DEFAULT_POOL_BYTES = 512 << 20
DEFAULT_IDLE_S = 60.0


def host_id() -> str:
    """Hostname and boot id: equal only for processes that can share /dev/shm files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return ""
    return f"{socket.gethostname()}/{boot}"


def owner_prefix(pid: int, rank: int) -> str:
    return f"{_PREFIX}{pid}-{rank}-"


def parsed_frames(frames) -> int:
    """How many leading frames of a message its receiver parses (and the MAC must
    cover in full): the envelope, and the segment descriptor in front of it."""
    return 2 if frames and bytes(memoryview(frames[0])[:4]) == MARK else 1


def names_frame(names: list[str]) -> bytes:
    """A DROP frame listing segment names."""
    return DROP + "\0".join(names).encode()


def parse_names(frame) -> list[str]:
    data = bytes(frame)[len(DROP):]
    return data.decode().split("\0") if data else []


class _Segment:
    __slots__ = ("name", "size", "map", "array", "peer", "mapped_by", "last_used")

    def __init__(self, name: str, size: int, m: mmap.mmap) -> None:
        self.name, self.size, self.map = name, size, m
        self.array = np.frombuffer(m, dtype=np.uint8, offset=_HEAD)
        self.peer: int | None = None      # the receiver it was last lent to
        self.mapped_by: set[int] = set()  # receivers that mapped it (told on drop)
        self.last_used = time.monotonic()

    def in_use(self) -> bool:
        return self.map[0] != 0


class ShmWriter:
    """A sender's segments; see the module docstring. Thread safe."""

    def __init__(self, rank: int, pool_bytes: int = DEFAULT_POOL_BYTES,
                 idle_s: float = DEFAULT_IDLE_S) -> None:
        self.prefix = owner_prefix(os.getpid(), rank)
        self.pool_bytes, self.idle_s = pool_bytes, idle_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._by_size: dict[int, list[_Segment]] = collections.defaultdict(list)
        self.created = 0  # segments ever created (reuse shows as sends > created)
        self.failures = 0  # frames that fell back to TCP (no room in /dev/shm)

    def pack(self, frames, threshold: int, peer: int) -> list | None:
        """Frames with every frame >= ``threshold`` bytes moved to a segment lent to
        ``peer``, or None if none is that large."""
        out = None
        entries = []
        for i, f in enumerate(frames):
            mv = memoryview(f)
            if mv.nbytes < threshold:
                continue
            try:
                seg = self._take(mv.nbytes, peer)
            except OSError as e:  # /dev/shm full (64 MiB in a default container): TCP
                self._warn(e)
                continue
            if out is None:
                out = list(frames)
            src = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)
            np.copyto(seg.array[:mv.nbytes], src)  # releases the GIL
            name = seg.name.encode()
            entries.append(_ENTRY.pack(i, mv.nbytes) + struct.pack("!H", len(name)) + name)
            out[i] = b""
        if out is None:
            return None
        return [MARK + b"".join(entries), *out]

    def _take(self, nbytes: int, peer: int) -> _Segment:
        size = max(_MIN_SEGMENT, 1 << (nbytes + _HEAD - 1).bit_length())
        with self._lock:
            for seg in self._by_size.get(size, ()):
                if not seg.in_use():
                    break
            else:
                seg = None
            if seg is not None:
                self._lend(seg, peer)
                return seg
        return self._create(size, peer)

    def _lend(self, seg: _Segment, peer: int) -> None:
        seg.map[0] = 1  # before the message exists: the receiver clears it when done
        seg.peer = peer
        seg.mapped_by.add(peer)
        seg.last_used = time.monotonic()

    def _create(self, size: int, peer: int) -> _Segment:
        name = f"{self.prefix}{next(self._ids)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: writing to a tmpfs mapping past its capacity
            # is a SIGBUS, a failed fallocate an error we can fall back from.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        seg = _Segment(name, size, m)
        with self._lock:
            self._lend(seg, peer)
            self._segments[name] = seg
            self._by_size[size].append(seg)
            self.created += 1
        return seg

    def _warn(self, err: OSError) -> None:
        self.failures += 1
        if self.failures & (self.failures - 1) == 0:  # 1st, 2nd, 4th...: bounded log
            log.warning("shared memory for a large frame failed (%s; %d so far): sending it "
                        "over TCP; free space in %s or set DISTGRAD_SHM_THRESHOLD=0",
                        err, self.failures, SHM_DIR)

    def free_segments(self) -> int:
        """How many segments no receiver holds."""
        with self._lock:
            return sum(not s.in_use() for s in self._segments.values())

    def expire(self) -> dict[int, list[str]]:
        """Unlink free segments idle for ``idle_s`` or beyond ``pool_bytes`` (least
        recently used first); returns {receiver: names} to DROP."""
        limit = time.monotonic() - self.idle_s
        with self._lock:
            free = sorted((s for s in self._segments.values() if not s.in_use()),
                          key=lambda s: s.last_used)
            total = sum(s.size for s in free)
            victims = []
            for s in free:
                if s.last_used < limit or total > self.pool_bytes:
                    victims.append(s)
                    total -= s.size
            self._forget(victims)
        return self._drop(victims)

    def peer_lost(self, peer: int) -> None:
        """Segments ``peer`` held will never be released: unlink them."""
        with self._lock:
            victims = [s for s in self._segments.values() if s.peer == peer and s.in_use()]
            for s in self._segments.values():
                s.mapped_by.discard(peer)
            self._forget(victims)
        self._drop(victims)

    def _forget(self, victims: list[_Segment]) -> None:
        for seg in victims:  # (lock held)
            self._segments.pop(seg.name, None)
            self._by_size[seg.size].remove(seg)

    def _drop(self, victims: list[_Segment]) -> dict[int, list[str]]:
        tell: dict[int, list[str]] = collections.defaultdict(list)
        for seg in victims:
            _unlink(os.path.join(SHM_DIR, seg.name))
            seg.array = None
            try:
                seg.map.close()
            except BufferError:  # a frame being copied right now still views it
                pass
            for p in seg.mapped_by:
                tell[p].append(seg.name)
        return dict(tell)

    def pooled(self) -> tuple[int, int]:
        """(segments, bytes) this writer holds, lent or free."""
        with self._lock:
            return len(self._segments), sum(s.size for s in self._segments.values())

    def cleanup(self) -> None:
        """Remove every segment of this writer (call at close)."""
        with self._lock:
            segs = list(self._segments.values())
            self._forget(segs)
        self._drop(segs)
        remove_prefix(self.prefix)


class ShmReader:
    """A receiver's mappings of its senders' segments."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def unpack(self, prefix: str, body: list) -> list:
        """Replace the segment references of a message from the worker whose files
        start with ``prefix`` by zero-copy views; raises ValueError on a bad one."""
        desc = bytes(body[0])
        frames = body[1:]
        pos, end = len(MARK), len(desc)
        while pos < end:
            i, size = _ENTRY.unpack_from(desc, pos)
            pos += _ENTRY.size
            (n,) = struct.unpack_from("!H", desc, pos)
            pos += 2
            name = desc[pos:pos + n].decode()
            pos += n
            if "/" in name or not name.startswith(prefix) or i >= len(frames):
                raise ValueError(f"bad shared-memory reference {name!r}")
            m = self._map(name, size + _HEAD)
            # A fresh exporter per message: every view, slice or tensor made from
            # the frame keeps this array alive, so the segment is released only
            # when nothing can touch it any more.
            arr = np.frombuffer(m, np.uint8, count=size, offset=_HEAD)
            weakref.finalize(arr, _release, m).atexit = False
            frames[i] = memoryview(arr)
        return frames

    def _map(self, name: str, size: int) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(name)
        if m is None:
            # never through a link, and only a regular file of this user (the
            # sender runs as this user: see SocketTransport; the name came from
            # an authenticated message, but it must not open anything else)
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise ValueError(f"shared-memory segment {name} is not a regular file of "
                                     f"this user (mode {st.st_mode:o}, owner {st.st_uid})")
                m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
            with self._lock:
                self._maps[name] = m
        if len(m) < size:
            raise ValueError(f"shared-memory segment {name} holds {len(m)} bytes, "
                             f"the message needs {size}")
        return m

    def forget(self, names) -> None:
        """Drop mappings (views still alive keep theirs until they go)."""
        with self._lock:
            for name in names:
                self._maps.pop(name, None)

    def forget_prefix(self, prefix: str) -> None:
        with self._lock:
            for name in [n for n in self._maps if n.startswith(prefix)]:
                del self._maps[name]

    def mapped(self) -> int:
        with self._lock:
            return len(self._maps)


def _release(m: mmap.mmap) -> None:
    try:
        m[0] = 0  # the sender may reuse the segment
    except ValueError:  # closed: the sender is gone
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_prefix(prefix: str) -> None:
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        _unlink(path)
