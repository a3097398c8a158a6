"""The door of a worker's listening sockets: connections not yet authenticated.

Anyone who can reach a listening socket can connect, so no connection may hold
the door: each handshake runs on a short-lived thread of its own (none blocks
the accept loop) under one deadline for the whole handshake
(:data:`.handshake.HANDSHAKE_SECONDS`), and the gate bounds how many wait at
once: ``per_source`` from one source (an IP address; a Unix socket's peer uid),
``total`` in all. Under pressure the *oldest* unauthenticated connection is
dropped, never the newest: a stranger's connection has held its place longer
than a worker's, which finishes its handshake within milliseconds of
connecting. A dropped connection is shut down; its thread sees the end and
leaves. Refusals are logged at a bounded rate (:class:`RateLog`).

Example::

    >>> gate = Gate(total=128, per_source=64)
    >>> gate.serve(sock, lambda s: handshake(s), name="distgrad-handshake-1")
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable


def source_of(sock: socket.socket) -> str:
    """Who is at the other end, as far as the kernel says: the peer IP address
    (TCP), or ``uid:N`` from SO_PEERCRED (a Unix socket)."""
    try:
        if sock.family == getattr(socket, "AF_UNIX", None):
            cred = getattr(socket, "SO_PEERCRED", None)
            if cred is None:
                return "unix"
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, cred,
                                                            struct.calcsize("3i")))
            return f"uid:{uid}"
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


class Gate:
    """Runs handshakes concurrently, bounded per source and in all, dropping the
    oldest waiting connection when a bound is reached."""

    def __init__(self, total: int = 128, per_source: int = 64) -> None:
        self.total, self.per_source = total, per_source
        self._lock = threading.Lock()
        self._waiting: collections.OrderedDict[socket.socket, str] = collections.OrderedDict()
        self.dropped = 0

    def serve(self, sock: socket.socket, handshake: Callable[[socket.socket], None], name: str) -> None:
        """Run ``handshake(sock)`` on a thread of its own (it owns ``sock``: closes
        it on failure), making room first if a bound is reached."""
        source = source_of(sock)
        with self._lock:
            same = [s for s, src in self._waiting.items() if src == source]
            if len(same) >= self.per_source:
                self._drop(same[0])
            elif len(self._waiting) >= self.total:
                self._drop(next(iter(self._waiting)))
            self._waiting[sock] = source
        try:
            threading.Thread(target=self._run, args=(sock, handshake), daemon=True, name=name).start()
        except RuntimeError:  # no thread to be had: refuse this one
            self.done(sock)
            sock.close()

    def _run(self, sock: socket.socket, handshake: Callable[[socket.socket], None]) -> None:
        try:
            handshake(sock)
        finally:
            self.done(sock)

    def done(self, sock: socket.socket) -> None:
        """``sock``'s handshake ended (either way): it no longer waits."""
        with self._lock:
            self._waiting.pop(sock, None)

    def _drop(self, sock: socket.socket) -> None:
        self._waiting.pop(sock, None)
        self.dropped += 1
        try:
            sock.shutdown(socket.SHUT_RDWR)  # its thread's recv returns: it closes and leaves
        except OSError:
            pass

    def drop_all(self) -> None:
        """Shut every waiting connection (the transport closes)."""
        with self._lock:
            for sock in list(self._waiting):
                self._drop(sock)


class RateLog:
    """Warnings at a bounded rate: a burst of ``burst``, then one every
    ``interval`` seconds (a token bucket); what was held back is counted in the
    next one that goes out."""

    def __init__(self, logger: logging.Logger, burst: int = 20, interval: float = 5.0) -> None:
        self.logger, self.burst, self.interval = logger, burst, interval
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args) -> None:
        """Log ``msg % args`` if the bucket has a token; else count it as held back."""
        now = time.monotonic()
        with self._lock:
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.interval)
            self._at = now
            if self._tokens < 1:
                self._held += 1
                return
            self._tokens -= 1
            held, self._held = self._held, 0
        if held:
            msg += " (and %d more held back since the last such warning)"
            args = (*args, held)
        self.logger.warning(msg, *args)
