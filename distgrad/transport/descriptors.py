"""File descriptors: the open-file limit, and accepting when none is left.

Every connection a listening socket accepts costs a descriptor, and so does every
file the process opens. At the common soft limit (1,024) a crowd of idle
connections can leave a worker with none: ``open()`` fails everywhere, and
``accept()`` fails with ``EMFILE`` while the waiting connection stays queued, so a
level-triggered poller reports the listener ready again at once, for ever (a
thread spinning on it). Two defences here:

* :func:`raise_open_file_limit` lifts the soft limit to the hard one at start-up
  (``init_rpc``, the store's own process), once per process, and logs it.
* :class:`Acceptor` accepts on a listening socket and, when no descriptor is left,
  sheds the queue: it closes a spare descriptor it keeps for the purpose, accepts
  each waiting connection and closes it at once, and opens the spare again. When
  even that fails (the system's table is full, ``ENFILE``; another thread took the
  spare's slot), it tells the caller to stop watching the listener for a while
  (backing off from 50 ms to a second). Either way it logs at a
  bounded rate (:class:`.gate.RateLog`).

Example::

    >>> raise_open_file_limit()            # (1024, 524288) -> (524288, 524288), logged once
    >>> acceptor = Acceptor(RateLog(log), "worker 0")
    >>> sock, pause = acceptor.accept(listener)   # None, 0.0: nothing, or shed; None, s: unwatch s
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading

try:
    import resource
except ImportError:  # Windows: no such limit to raise
    resource = None

log = logging.getLogger("distgrad.transport.descriptors")

#: ``accept()``'s errors that mean "no descriptor (or buffer) to give": the
#: connection stays queued and the listener stays ready
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_PAUSE_FIRST, _PAUSE_MOST = 0.05, 1.0
_SHED_AT_ONCE = 256   # connections dropped per shedding (then the poller says if more wait)

_raised: list = []    # (soft before, soft after) once this process raised its limit


def open_file_limit() -> tuple[int, int] | None:
    """``(soft, hard)`` RLIMIT_NOFILE, or None where the platform has no such limit.

    Example::

        >>> open_file_limit()
        (1024, 524288)
    """
    if resource is None:
        return None
    try:
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None


def raise_open_file_limit() -> tuple[int, int] | None:
    """Lift the soft open-file limit to the hard one (where the hard one is
    unlimited: 1,048,576, then macOS's 10,240), once per process; log what it did
    once (INFO when raised, DEBUG otherwise). Never raises: where the platform has
    no such limit or the kernel refuses, the limit stays. ``DISTGRAD_RAISE_NOFILE=0``
    leaves it alone (for a program that still uses ``select()``, which cannot watch
    descriptors past 1,023). Returns ``(soft before, soft now)``, or None where
    nothing is known.

    Example::

        >>> raise_open_file_limit()
        (1024, 524288)
    """
    if _raised:
        return _raised[0]
    limits = open_file_limit()
    if limits is None:
        log.debug("no open-file limit to raise on this platform")
        return None
    soft, hard = limits
    if os.environ.get("DISTGRAD_RAISE_NOFILE", "1") == "0":
        _raised.append((soft, soft))
        log.debug("open-file limit left at %d (hard %d): DISTGRAD_RAISE_NOFILE=0", soft, hard)
        return _raised[0]
    now = soft
    infinite = getattr(resource, "RLIM_INFINITY", -1)
    for target in ([hard] if hard != infinite else [1 << 20, 10240]):
        if soft != infinite and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            now = target
            break
        except (OSError, ValueError) as e:
            log.debug("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    _raised.append((soft, now))
    if now != soft:
        log.info("raised this process's open-file limit (RLIMIT_NOFILE) from %d to %d (the hard "
                 "limit): a crowd of connections cannot exhaust it as soon", soft, now)
    else:
        log.debug("open-file limit stays at %d (hard %d)", soft, hard)
    return _raised[0]


def _spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


class Acceptor:
    """``accept()`` that survives having no descriptor left (see the module
    docstring). Thread-safe: several pollers' threads may call :meth:`accept` on
    one listener at once."""

    def __init__(self, warn, who: str) -> None:
        self._warn = warn   # a RateLog's warning (msg, *args)
        self.who = who
        self._lock = threading.Lock()
        self._spare = _spare()
        self._backoff = _PAUSE_FIRST
        self.shed = 0       # connections accepted and closed for want of a descriptor

    def accept(self, listener: socket.socket) -> tuple[socket.socket | None, float]:
        """``(connection, 0.0)``; or ``(None, 0.0)``: nothing waits (another thread
        took it), or it was shed for want of a descriptor; or ``(None, seconds)``:
        not even shedding worked, stop watching ``listener`` for that long (then
        watch it again). ``listener`` must be non-blocking."""
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None, 0.0
        except OSError as e:
            if e.errno in OUT_OF_DESCRIPTORS:
                return None, self._shed(listener, e)
            self._warn("%s: accept failed: %s", self.who, e)   # EPROTO, EPERM: that one only
            return None, 0.0
        self._backoff = _PAUSE_FIRST
        return sock, 0.0

    def _shed(self, listener: socket.socket, cause: OSError) -> float:
        if not self._lock.acquire(blocking=False):
            return 0.0  # another thread sheds this queue now
        try:
            dropped, stuck = 0, None
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None
            while dropped < _SHED_AT_ONCE:
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    break
                except OSError as e:
                    stuck = e   # not even one slot (ENFILE, or the spare's was taken)
                    break
                sock.close()
                dropped += 1
            self._spare = _spare()
            self.shed += dropped
            if stuck is not None and not dropped:
                pause = self._backoff
                self._backoff = min(_PAUSE_MOST, self._backoff * 2)
                self._warn("%s: out of file descriptors (%s): new connections wait, unwatched for "
                           "%.2f s", self.who, os.strerror(stuck.errno or 0), pause)
                return pause
            self._backoff = _PAUSE_FIRST
            self._warn("%s: out of file descriptors (%s): closed %d new connections unread (%d so "
                       "far)", self.who, os.strerror(cause.errno or 0), dropped, self.shed)
            return 0.0
        finally:
            self._lock.release()

    def close(self) -> None:
        """Give the spare descriptor back."""
        with self._lock:
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None
