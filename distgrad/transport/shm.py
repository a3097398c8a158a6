"""Same-host shared-memory path for large frames.

The sender writes a large frame into a fresh file under ``/dev/shm`` (one copy,
done on the sending thread, not the I/O thread) and sends only its name and
size; the receiver maps the file (no copy) and unlinks it at once, so the
memory lives exactly as long as the received buffer is referenced and nothing
is left behind once the message is delivered. Files of messages never
delivered (a peer died mid-flight) are removed by name prefix when either side
sees the other go, and by the sender when it closes.

Only used between workers that share a host *and* a boot (hostname + boot id,
exchanged through the listening address at rendezvous); otherwise frames go
over TCP.
"""
from __future__ import annotations

import glob
import itertools
import mmap
import os
import socket
import struct

SHM_DIR = "/dev/shm"
MARK = b"\xffSHM"
_ENTRY = struct.Struct("!IQ")  # frame index, size; followed by the name
_PREFIX = "distgrad-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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


class ShmWriter:
    """Writes large frames of one process into named /dev/shm files."""

    def __init__(self, rank: int) -> None:
        self.prefix = owner_prefix(os.getpid(), rank)
        self._ids = itertools.count()

    def pack(self, frames, threshold: int) -> list | None:
        """Frames with every frame >= ``threshold`` bytes moved to shm, or None if none is."""
        out = None
        entries = []
        for i, f in enumerate(frames):
            mv = memoryview(f)
            if mv.nbytes < threshold:
                continue
            if out is None:
                out = list(frames)
            name = self.write(mv)
            entries.append(_ENTRY.pack(i, mv.nbytes) + struct.pack("!H", len(name)) + name)
            out[i] = b""
        if out is None:
            return None
        return [MARK + b"".join(entries), *out]

    def write(self, mv: memoryview) -> bytes:
        name = f"{self.prefix}{next(self._ids)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            done = 0
            while done < len(mv):
                done += os.write(fd, mv[done:])
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return name.encode()

    def cleanup(self) -> None:
        """Remove this process's files that no receiver took (call at close)."""
        remove_prefix(self.prefix)


def unpack(body: list) -> list:
    """Replace the shm references of a received message by mapped buffers."""
    desc = bytes(body[0])
    frames = body[1:]
    pos, end = len(MARK), len(desc)
    entries = []
    while pos < end:
        i, size = _ENTRY.unpack_from(desc, pos)
        pos += _ENTRY.size
        (n,) = struct.unpack_from("!H", desc, pos)
        pos += 2
        name = desc[pos:pos + n].decode()
        pos += n
        entries.append((i, size, name))
    try:
        for i, size, name in entries:
            if "/" in name or not name.startswith(_PREFIX) or i >= len(frames):
                raise ValueError(f"bad shared-memory reference {name!r}")
            frames[i] = _map(os.path.join(SHM_DIR, name), size)
    finally:
        for _, _, name in entries:
            if "/" not in name and name.startswith(_PREFIX):
                _unlink(os.path.join(SHM_DIR, name))
    return frames


def _map(path: str, size: int) -> memoryview:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"shared-memory file {path} has the wrong size")
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
    return memoryview(m)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_prefix(prefix: str) -> None:
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        _unlink(path)
