"""The store's front door: a relay that caps who may hold a connection.

torch's TCPStore server (C++) accepts every connection and keeps it: nothing in
it bounds how many, from whom, for how long. So a store that distgrad serves
(rank 0's, in a process of its own, :mod:`.keeper`; ``distgrad store``) listens
through this front. The server itself listens on a loopback port of the same
process; the front accepts on the address the user named and relays each
connection it admits to that server, byte for byte (it knows nothing of the
store's protocol). It admits at most ``total`` connections at once and
``per_address`` from one peer address; past either bound a new connection is
closed unread (the newest goes: store clients hold their connection for the
group's life, so the oldest are the members). A connection that has said nothing
``silent_s`` seconds after it was accepted is closed: a store client speaks first
(torch's validates the moment it connects), a crowd of idle connections does not.
With no descriptor left, ``accept`` sheds the queue instead of spinning
(:class:`~distgrad.transport.descriptors.Acceptor`). Refusals are logged at a
bounded rate.

What a relay costs: a store operation crosses one more process hop (measured on
this 2-core machine: ``get`` 32-60 us direct, 105-235 us through the front; store
operations are rendezvous and membership, never on a message's path).

Example::

    >>> front = StoreFront(listener, ("127.0.0.1", backend_port), total=1024, per_address=256)
    >>> threading.Thread(target=front.serve_forever, daemon=True).start()
    >>> front.stop()
"""
from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import selectors
import socket
import time

from ..transport.descriptors import Acceptor
from ..transport.gate import RateLog

log = logging.getLogger("distgrad.launch.front")

_CHUNK = 1 << 16
_TICK = 0.5                  # how often silent connections are looked for


def source_address(sock: socket.socket) -> str:
    """The peer's address as the cap counts it (an IPv4-mapped IPv6 address as IPv4).

    Example::

        >>> source_address(accepted)   # a client at [::ffff:10.0.0.2]:51234
        '10.0.0.2'
    """
    try:
        host = str(sock.getpeername()[0])
    except OSError:
        return "?"
    return host[7:] if host.startswith("::ffff:") else host


class _End:
    """One socket of a relayed pair: what waits to be written to it, whether its
    reading side ended."""

    __slots__ = ("sock", "out", "eof", "shut", "peer", "pair", "events")

    def __init__(self, sock: socket.socket, pair: _Pair) -> None:
        self.sock, self.pair = sock, pair
        self.out = bytearray()
        self.eof = False      # it sent its FIN: nothing more to read
        self.shut = False     # our FIN sent to it
        self.peer: _End | None = None
        self.events = 0


class _Pair:
    __slots__ = ("client", "server", "address", "since", "heard", "connecting")

    def __init__(self, client: socket.socket, server: socket.socket, address: str) -> None:
        self.client, self.server = _End(client, self), _End(server, self)
        self.client.peer, self.server.peer = self.server, self.client
        self.address = address
        self.since = time.monotonic()
        self.heard = False       # the client sent something
        self.connecting = True   # the relay's connection to the server is not up yet


class StoreFront:
    """Relay connections from ``listener`` to the store's server at ``backend``,
    at most ``total`` at once and ``per_address`` from one peer address, closing
    one that says nothing for ``silent_s`` s. ``control``: a descriptor (a pipe's
    reading end) whose end stops :meth:`serve_forever` (the parent that holds the
    other end exited or let go)."""

    def __init__(self, listener: socket.socket, backend: tuple[str, int], total: int = 1024,
                 per_address: int = 256, silent_s: float = 30.0, control: int | None = None,
                 name: str = "store") -> None:
        self.listener, self.backend = listener, backend
        self.total, self.per_address = max(1, total), max(1, min(per_address, total))
        self.silent_s = silent_s
        self.name = name
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._control = control
        if control is not None:
            self._sel.register(control, selectors.EVENT_READ, "control")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pairs: set[_Pair] = set()
        self.by_address: collections.Counter = collections.Counter()
        self._refusals = RateLog(log, burst=5, interval=10.0)
        self._acceptor = Acceptor(self._refusals.warning, f"the {name}'s front")
        self._paused_until = 0.0
        self._stopping = False
        self.admitted = self.refused = self.silenced = 0
        self.server = None   # what serves behind it, held here where the caller wants it kept

    # -- the loop --------------------------------------------------------------
    def serve_forever(self) -> None:
        """Relay until :meth:`stop` or the control descriptor's end; then close every
        connection and the listener."""
        next_tick = time.monotonic() + _TICK
        try:
            while not self._stopping:
                now = time.monotonic()
                if self._paused_until and now >= self._paused_until:
                    self._paused_until = 0.0
                    self._sel.register(self.listener, selectors.EVENT_READ, "listen")
                for key, mask in self._sel.select(max(0.0, next_tick - now)):
                    what = key.data
                    if what == "listen":
                        self._accept()
                    elif what == "control":
                        if not _drain(self._control):
                            self._stopping = True
                    elif what == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._service(what, mask)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + _TICK
                    self._silence(now)
        finally:
            self._close_all()

    def stop(self) -> None:
        """Make :meth:`serve_forever` return (from any thread)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def connections(self) -> int:
        """How many connections are relayed now."""
        return len(self._pairs)

    # -- admitting -------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):   # a burst at a time; the selector says if more wait
            sock, pause = self._acceptor.accept(self.listener)
            if pause:
                self._sel.unregister(self.listener)
                self._paused_until = time.monotonic() + pause
                return
            if sock is None:
                return
            address = source_address(sock)
            if len(self._pairs) >= self.total or self.by_address[address] >= self.per_address:
                self.refused += 1
                full = "in all" if len(self._pairs) >= self.total else f"from {address}"
                self._refusals.warning("the %s refused a connection from %s: %d connections %s "
                                       "already (the most it keeps)", self.name, address,
                                       self.total if full == "in all" else self.per_address, full)
                _close(sock)
                continue
            self._relay(sock, address)

    def _relay(self, client: socket.socket, address: str) -> None:
        try:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as e:
            self._refusals.warning("the %s cannot open a connection to its server (%s): closed a "
                                   "connection from %s", self.name, e, address)
            _close(client)
            return
        client.setblocking(False)
        server.setblocking(False)
        for s in (client, server):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, server, address)
        err = server.connect_ex(self.backend)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._refusals.warning("the %s cannot reach its server: %s", self.name, os.strerror(err))
            _close(client)
            _close(server)
            return
        self._pairs.add(pair)
        self.by_address[address] += 1
        self.admitted += 1
        pair.connecting = err != 0
        self._update(pair.client)
        self._update(pair.server)

    # -- relaying --------------------------------------------------------------
    def _update(self, end: _End) -> None:
        """Watch ``end`` for what it waits for: reading while its peer has nothing
        queued (back-pressure), writing while it has something queued (or its
        connection is being made)."""
        pair = end.pair
        if end is pair.server and pair.connecting:
            want = selectors.EVENT_WRITE
        else:
            want = (0 if end.eof or end.peer.out or pair.connecting else selectors.EVENT_READ) | \
                (selectors.EVENT_WRITE if end.out else 0)
        if want == end.events:
            return
        try:
            if not end.events:
                self._sel.register(end.sock, want, end)
            elif not want:
                self._sel.unregister(end.sock)
            else:
                self._sel.modify(end.sock, want, end)
            end.events = want
        except (OSError, ValueError, KeyError):
            self._drop(pair)

    def _service(self, end: _End, mask: int) -> None:
        pair = end.pair
        if pair not in self._pairs:
            return
        if pair.connecting:
            err = end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._refusals.warning("the %s cannot reach its server: %s", self.name,
                                       os.strerror(err))
                self._drop(pair)
                return
            pair.connecting = False
            self._update(pair.client)
            self._update(pair.server)
            return
        if mask & selectors.EVENT_WRITE and end.out:
            if not self._flush(end):
                return
        if mask & selectors.EVENT_READ and not end.eof:
            try:
                data = end.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._drop(pair)
                return
            if data is not None:
                if data:
                    if end is pair.client:
                        pair.heard = True
                    end.peer.out += data
                    if not self._flush(end.peer):
                        return
                else:
                    end.eof = True
                    if not end.peer.out:
                        self._shut(end.peer)
        if pair.client.eof and pair.server.eof and not pair.client.out and not pair.server.out:
            self._drop(pair)
            return
        if pair in self._pairs:
            self._update(end)
            self._update(end.peer)

    def _flush(self, end: _End) -> bool:
        """Write what waits for ``end``; False when the pair was dropped."""
        try:
            n = end.sock.send(end.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._drop(end.pair)
            return False
        del end.out[:n]
        if not end.out and end.peer.eof:
            self._shut(end)
        return True

    def _shut(self, end: _End) -> None:
        """Pass a FIN on: ``end``'s peer will send nothing more."""
        if not end.shut:
            end.shut = True
            with contextlib.suppress(OSError):
                end.sock.shutdown(socket.SHUT_WR)

    def _silence(self, now: float) -> None:
        for pair in [p for p in self._pairs if not p.heard and now - p.since > self.silent_s]:
            self.silenced += 1
            self._refusals.warning("the %s closed a connection from %s: silent for %.0f s after "
                                   "connecting (a store client speaks first)", self.name,
                                   pair.address, now - pair.since)
            self._drop(pair)

    def _drop(self, pair: _Pair) -> None:
        if pair not in self._pairs:
            return
        self._pairs.discard(pair)
        self.by_address[pair.address] -= 1
        if not self.by_address[pair.address]:
            del self.by_address[pair.address]
        for end in (pair.client, pair.server):
            if end.events:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self._sel.unregister(end.sock)
                end.events = 0
            _close(end.sock)

    def _close_all(self) -> None:
        for pair in list(self._pairs):
            self._drop(pair)
        self._sel.close()
        self._acceptor.close()
        for s in (self.listener, self._wake_r, self._wake_w):
            _close(s)


def _drain(fd: int) -> bool:
    """Read what waits on ``fd``; False at its end."""
    try:
        return bool(os.read(fd, 4096))
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
