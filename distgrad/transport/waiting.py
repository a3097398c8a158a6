"""Waiting for a socket: a short spin where it pays, then sleep in the kernel.

A thread that expects bytes soon (a caller waiting for its reply, the pool's leader
just after traffic) looks at its descriptor again, calling ``sched_yield()`` between
looks, for a budget of a few microseconds, and then sleeps for the rest of its
timeout. A receiver already looking when the bytes land costs the sender no wake-up
and itself no wake-up latency. Every other wait sleeps at once: an idle worker uses
no CPU.

* **The gate** (:func:`may_spin`): a thread spins only while the host has a free
  core: the CPUs of this process's affinity mask against the runnable count (4th
  field of ``/proc/loadavg``, read at most once a millisecond), with a host-wide
  count of distgrad spinners (this user's) kept in a small file under ``/dev/shm``
  (:data:`NSLOTS` slots of ``pid << 32 | millisecond timestamp``; a slot older than
  :data:`STALE_MS` is a dead spinner's and is taken over). No ``/proc/loadavg`` or no
  ``/dev/shm``: no spin at all.
* **The budget** (:class:`Budget`): about 2 x the running average of how long such
  waits took + 5 us, capped at ``DISTGRAD_SPIN_CAP_US`` (default 30: a sleep and a
  wake-up on a quiet host), and none while the average is above the cap.
  ``DISTGRAD_SPIN_US`` forces a fixed budget instead.
* **The forms**: :func:`wait_fd` and :func:`epoll_wait_spin` are the native ones
  (``_waitc.c``, the GIL released for the whole wait) where that extension was built
  from the current source and ``DISTGRAD_PURE`` and ``DISTGRAD_NATIVE_WAIT=0`` are
  unset; else the Python forms below, which spin only under ``DISTGRAD_SPIN_US`` (a
  Python spin takes the GIL at each look).

Example::

    >>> import socket
    >>> a, b = socket.socketpair()
    >>> wait_fd(b.fileno(), 0, 0)
    False
    >>> a.send(b"x") and wait_fd(b.fileno(), 20_000, 100)
    True
"""
from __future__ import annotations

import math
import os
import select
import struct
import threading
import time

NSLOTS = 64          #: spinner slots in the shared file
SLOT_STRIDE = 64     #: bytes per slot (a cache line each)
STALE_MS = 20        #: a slot not refreshed for this long is a dead spinner's
SLOTS_PATH = f"/dev/shm/distgrad-spinners-{os.getuid()}" if hasattr(os, "getuid") else ""
LOADAVG_PATH = "/proc/loadavg"
_LOADAVG_EVERY_NS = 1_000_000
_POLL_TYPE = type(select.poll()) if hasattr(select, "poll") else ()


def parse_us(name: str, raw: str | None, top: float = 1e6) -> float | None:
    """The value of the environment variable ``name`` (``raw``) in microseconds, None
    when unset or blank; a ValueError naming the variable when it is not a number
    between 0 and ``top``.

    Example::

        >>> parse_us("DISTGRAD_SPIN_CAP_US", "30"), parse_us("DISTGRAD_SPIN_CAP_US", "")
        (30.0, None)
    """
    if raw is None or not raw.strip():
        return None
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 <= us <= top:
        raise ValueError(f"{name} must be a number of microseconds between 0 and "
                         f"{top:.0f}, not {raw!r}")
    return us


def _env_us(name: str, default: float | None, top: float = 1e6) -> float | None:
    us = parse_us(name, os.environ.get(name), top)
    return default if us is None else us


def _switch(name: str) -> bool:
    """A boolean environment switch (default on); anything but 0/1/true/false/yes/no/on/off
    is a ValueError."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, not {os.environ[name]!r}")


#: DISTGRAD_SPIN_US: a fixed budget for every expecting wait (None: learned)
FORCED_US = _env_us("DISTGRAD_SPIN_US", None)
#: DISTGRAD_SPIN_CAP_US: the learned budget's cap
CAP_US = _env_us("DISTGRAD_SPIN_CAP_US", 30.0, 10_000)
#: DISTGRAD_NATIVE_WAIT (default 1): 0 keeps the Python forms even where _waitc is built
NATIVE_WANTED = _switch("DISTGRAD_NATIVE_WAIT")


def may_spin(ncpu: int, runnable: int, spinners: int) -> bool:
    """The gate's decision: ``runnable`` (from ``/proc/loadavg``) counts the asking
    thread and the ``spinners`` too; a thread may spin when the CPUs left after every
    other runnable thread exceed the spinners already counted.

    Example::

        >>> may_spin(2, 1, 0), may_spin(2, 3, 0), may_spin(2, 2, 1), may_spin(2, 3, 2)
        (True, False, True, False)
    """
    others = max(0, runnable - 1 - spinners)
    return spinners < ncpu - others


def budget_us(avg_us: float, cap_us: float) -> float:
    """The learned budget: 2 x the average + 5 us, at most ``cap_us``; 0 when the
    average is above the cap (replies slower than a sleep and a wake-up: sleep).

    Example::

        >>> budget_us(4.0, 30.0), budget_us(20.0, 30.0), budget_us(31.0, 30.0)
        (13.0, 30.0, 0.0)
    """
    if avg_us > cap_us:
        return 0.0
    return min(cap_us, 2.0 * avg_us + 5.0)


class Budget:
    """The spin budget of one kind of wait, learned from how long such waits took
    until the descriptor was ready (sleeping ones included, so it re-learns when
    replies get faster). ``spin_ns()`` is 0 for the Python forms unless
    ``DISTGRAD_SPIN_US`` forces a budget.

    Example::

        >>> b = Budget(cap_us=30.0, forced_us=None, native=True)
        >>> for _ in range(50): b.note(0.000004)
        >>> 12_000 < b.spin_ns() < 14_000
        True
    """

    __slots__ = ("avg_us", "cap_us", "forced_ns", "native")

    def __init__(self, cap_us: float | None = None, forced_us: float | None = -1.0,
                 native: bool | None = None) -> None:
        self.cap_us = CAP_US if cap_us is None else cap_us
        forced = FORCED_US if forced_us == -1.0 else forced_us
        self.forced_ns = None if forced is None else int(forced * 1000)
        self.native = NATIVE if native is None else native
        self.avg_us = self.cap_us + 1.0   # start asleep: spin once replies prove fast

    def note(self, waited_s: float) -> None:
        """One wait of this kind took ``waited_s`` until ready (or its timeout)."""
        self.avg_us += (waited_s * 1e6 - self.avg_us) * 0.125

    def spin_ns(self) -> int:
        if self.forced_ns is not None:
            return self.forced_ns
        if not self.native:
            return 0
        return int(budget_us(self.avg_us, self.cap_us) * 1000)


class _Gate:
    """The Python form of the gate (the same file and decision as ``_waitc.c``): the
    slots are read and written with ``pread``/``pwrite`` under an exclusive ``lockf`` of
    the file (and a lock for this process's threads), never mapped: a mapping of a file
    another process truncates, or of a full /dev/shm, would raise SIGBUS. Any error
    reading or writing the file: no spin."""

    def __init__(self) -> None:
        self.ok = False
        self.lock = threading.Lock()

    def setup(self, slots_path: str, loadavg_path: str) -> bool:
        self.ok = False
        lfd = sfd = -1
        try:
            import fcntl
            self.ncpu = len(os.sched_getaffinity(0))
            lfd = os.open(loadavg_path, os.O_RDONLY | os.O_CLOEXEC)
            sfd = os.open(slots_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            st = os.fstat(sfd)
            if not (st.st_uid == os.getuid() and (st.st_mode & 0o170000) == 0o100000):
                raise OSError("not this user's regular file")
            # blocks reserved now: a full /dev/shm fails here (no spin), not at a write
            os.posix_fallocate(sfd, 0, NSLOTS * SLOT_STRIDE)
        except (OSError, AttributeError, ImportError):   # not Linux, or not usable: no spin
            for fd in (lfd, sfd):
                if fd >= 0:
                    os.close(fd)
            return False
        self.sfd, self.lfd, self.fcntl = sfd, lfd, fcntl
        self.run, self.run_at = 0, 0
        self.ok = True
        return True

    def runnable(self) -> int:
        t = time.monotonic_ns()
        if self.run_at and t - self.run_at < _LOADAVG_EVERY_NS:
            return self.run
        field = os.pread(self.lfd, 127, 0).split(b" ")[3]
        self.run, self.run_at = int(field.split(b"/")[0]), t
        return self.run

    def _slots(self) -> list:
        data = os.pread(self.sfd, NSLOTS * SLOT_STRIDE, 0).ljust(NSLOTS * SLOT_STRIDE, b"\0")
        return [struct.unpack_from("=Q", data, i * SLOT_STRIDE)[0] for i in range(NSLOTS)]

    def _slot(self, i: int) -> int:
        return struct.unpack("=Q", os.pread(self.sfd, 8, i * SLOT_STRIDE).ljust(8, b"\0"))[0]

    def _write(self, i: int, v: int) -> None:
        os.pwrite(self.sfd, struct.pack("=Q", v), i * SLOT_STRIDE)

    def _live(self, v: int, now_ms: int) -> bool:
        return v != 0 and (now_ms - v) & 0xFFFFFFFF <= STALE_MS

    def state(self) -> tuple:
        if not self.ok:
            return (0, -1, 0, False)
        self.run_at = 0
        run = self.runnable()
        now_ms = (time.monotonic_ns() // 1_000_000) & 0xFFFFFFFF
        try:
            live = sum(self._live(v, now_ms) for v in self._slots())
        except OSError:
            return (self.ncpu, -1, 0, False)
        return (self.ncpu, run, live, may_spin(self.ncpu, run, live))

    def claim(self) -> tuple | None:
        if not self.ok or not may_spin(self.ncpu, self.runnable(), 0):
            return None   # no free core even before counting spinners: no file access
        with self.lock:
            try:
                self.fcntl.lockf(self.sfd, self.fcntl.LOCK_EX)
            except OSError:
                return None
            try:
                now_ms = (time.monotonic_ns() // 1_000_000) & 0xFFFFFFFF
                slots = self._slots()
                if not may_spin(self.ncpu, self.runnable(), sum(self._live(v, now_ms) for v in slots)):
                    return None
                mine = (os.getpid() & 0xFFFFFFFF) << 32 | now_ms or 1
                for i, v in enumerate(slots):
                    if not self._live(v, now_ms):
                        self._write(i, mine)
                        return (i, mine)
                return None
            except OSError:
                return None
            finally:
                self.fcntl.lockf(self.sfd, self.fcntl.LOCK_UN)

    def release(self, slot: int, mine: int) -> None:
        with self.lock:
            try:
                self.fcntl.lockf(self.sfd, self.fcntl.LOCK_EX)
            except OSError:
                return
            try:
                if self._slot(slot) == mine:
                    self._write(slot, 0)
            except OSError:
                pass
            finally:
                self.fcntl.lockf(self.sfd, self.fcntl.LOCK_UN)


_GATE = _Gate()
_COUNTS = [0, 0, 0]   # the Python form's spins: asked for, refused by the gate, caught


def _spin(look, spin_ns: int, timeout_ms: int):
    """Look (``look(0)``) with a yield between looks for at most ``spin_ns`` (within the
    timeout) where the gate is open; returns what the last look found, and the
    timeout left for the sleep."""
    start = time.monotonic_ns()
    if timeout_ms >= 0:
        spin_ns = min(spin_ns, timeout_ms * 1_000_000)
    if spin_ns <= 0:
        return None, timeout_ms
    claimed = _GATE.claim()
    _COUNTS[0] += 1
    if claimed is None:
        _COUNTS[1] += 1
        return None, timeout_ms
    found = None
    try:
        stop = start + spin_ns
        while True:
            found = look(0)
            if found or time.monotonic_ns() >= stop:
                break
            os.sched_yield()
    finally:
        _GATE.release(*claimed)
    if found:
        _COUNTS[2] += 1
    if timeout_ms < 0:
        return found, -1
    return found, max(0, math.ceil(timeout_ms - (time.monotonic_ns() - start) / 1e6))


def _py_wait_fd(fd, spin_ns: int, timeout_ms: int) -> bool:
    """Wait until ``fd`` (a descriptor, an object with ``fileno()``, or, in this form
    only, a ``select.poll`` object already watching one) is readable: spin for at most
    ``spin_ns`` where the gate is open, then sleep for the rest of ``timeout_ms``
    (negative: no limit). Returns whether it is readable (or hung up, or closed).
    A signal's handler runs during the wait; one that raises ends it."""
    if isinstance(fd, _POLL_TYPE):
        poll = fd.poll
    else:
        p = select.poll()
        p.register(fd, select.POLLIN)
        poll = p.poll
    found, left = _spin(poll, spin_ns, timeout_ms)
    if found:
        return True
    return bool(poll(left))   # (select's poll retries after EINTR once handlers ran)


def _py_epoll_wait_spin(epoll, spin_ns: int, timeout_ms: int, maxevents: int = -1) -> list:
    """``epoll.poll`` (``epoll``: a ``select.epoll``, or its descriptor) after a spin of at most ``spin_ns``
    where the gate is open; the timeout in milliseconds (negative: no limit). Returns
    ``[(fd, events), ...]`` exactly like ``select.epoll.poll``: one-shot registrations
    fire once, in the spin or in the sleep."""
    if maxevents != -1 and maxevents < 1:
        raise ValueError(f"maxevents must be greater than 0, got {maxevents}")
    if not hasattr(epoll, "poll"):   # a descriptor: the same epoll set, through a copy
        dup = select.epoll.fromfd(os.dup(epoll if type(epoll) is int else epoll.fileno()))
        try:
            return _py_epoll_wait_spin(dup, spin_ns, timeout_ms, maxevents)
        finally:
            dup.close()
    found, left = _spin(lambda t: epoll.poll(t, maxevents), spin_ns, timeout_ms)
    if found:
        return found
    return epoll.poll(left / 1000 if left >= 0 else -1, maxevents)


def setup_gate(slots_path: str = SLOTS_PATH, loadavg_path: str = LOADAVG_PATH) -> bool:
    """Open the gate's files (for both forms; tests pass their own). False, and no
    spinning at all, where either is missing (no ``/proc`` or no ``/dev/shm``)."""
    ok = _GATE.setup(slots_path, loadavg_path) if slots_path else False
    if _waitc is not None:
        ok = _waitc.setup_gate(slots_path, loadavg_path) and ok
    return ok


def _load_native():
    """The built ``_waitc``, or None with why (see :func:`native_state`)."""
    from .. import _build
    if not NATIVE_WANTED:
        return None, "DISTGRAD_NATIVE_WAIT=0"
    why = _build.native_why(__package__ + "._waitc")
    if why is not None:
        return None, why
    try:
        from . import _waitc
    except ImportError as e:
        return None, f"could not load ({e})"
    return _waitc, None


_waitc, WHY_NOT = _load_native()
NATIVE = _waitc is not None
wait_fd = _waitc.wait_fd if NATIVE else _py_wait_fd
epoll_wait_spin = _waitc.epoll_wait_spin if NATIVE else _py_epoll_wait_spin
GATE_OPEN = setup_gate()


def stats() -> dict:
    """What this process's spins did: ``asked`` (a wait with a budget), ``refused``
    (the gate was shut: it slept at once), ``caught`` (the descriptor became ready
    while it spun: a wake-up saved); the rest spun their budget and then slept.

    Example::

        >>> set(stats()) == {"asked", "refused", "caught"}
        True
    """
    counts = _waitc.stats() if NATIVE else _COUNTS
    return dict(zip(("asked", "refused", "caught"), counts))


def native_state() -> str:
    """``"native"`` where the waits run in C, else ``"python (<why>)"``; for
    :func:`distgrad.info`.

    Example::

        >>> native_state().split(" ")[0] in ("native", "python")
        True
    """
    return "native" if NATIVE else f"python ({WHY_NOT})"


__all__ = ["Budget", "budget_us", "epoll_wait_spin", "may_spin", "native_state", "parse_us",
           "setup_gate", "stats",
           "wait_fd"]
