"""Message authentication for the transport: no frame is handed up (and so
nothing is unpickled) before its sender proved it knows the cluster secret.

Every message from worker S to worker R carries a first frame
``seq (8 bytes) || full (4 bytes) || tag (16 bytes)`` where ``tag`` is a keyed
BLAKE2b MAC over the sequence number, ``full``, the length of every frame and
the content of the first ``full`` frames. The transport sends a message's
*envelope* first (everything that is ever parsed: header, meta and payload
pickles, the shared-memory descriptor), so it is always covered in full; the
frames after it are raw tensor bytes, never parsed: on a Unix socket (one
host: the kernel carries the bytes) they are covered by length only (hashing
them cost ~100 us per 100 KB). On TCP (bytes that cross a network) the
transport seals and opens with ``every=True`` unless ``DISTGRAD_MAC_TENSORS=0``
(a trusted fabric): every frame is covered in full, the tensor bytes at memory
speed by Poly1305 under a one-time key derived from the direction's key and the
sequence number, its tag folded into the BLAKE2b MAC (below :data:`BULK_POLY`
bytes of tensors, BLAKE2b covers them directly). A receiver built with
``mac_bulk`` demands every frame in full (BLAKE2b). The key of the direction
S->R is derived from the secret, both ranks, the nonces R and S chose at start-up and keep in
memory, and both fresh challenges of the handshake that opened the connection
(:meth:`Authenticator.bind`, as the encryption keys of :mod:`.crypto` are): messages
recorded in an earlier session, sealed by or for an earlier process under one of
the ranks (a dynamic group's member replaced), or sealed for another connection
between the same two processes, never verify, and a MAC key learnt on one
connection is of no use on another. Each message must carry the sequence number
after the last one accepted on its connection, so a message is never accepted
twice and none can be deleted from the stream unnoticed (:class:`SequenceGap`).

Example::

    >>> a, b = Authenticator(b"s3cret", 0), Authenticator(b"s3cret", 1)
    >>> a.set_peer_nonce(1, b.nonce); b.set_peer_nonce(0, a.nonce)
    >>> a.bind(1, cc, sc); b.bind(0, cc, sc)   # the handshake's challenges (client's, server's)
    >>> frames = a.seal(1, [b"envelope", b"tensor bytes"])
    >>> b.open(0, frames)
    [b'envelope', b'tensor bytes']
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

_HEAD = struct.Struct("!QI")  # sequence number, frames covered in full
_KEYED: dict = {}    # key -> BLAKE2b keyed with it, nothing hashed yet (copied per message)
_KEYED_MAX = 4096    # (keys of connections since closed: forgotten past this many)
_LAYOUTS: dict = {}  # frame count -> the Struct of count and sizes
TAG_BYTES = 16
AUTH_FRAME_BYTES = _HEAD.size + TAG_BYTES
BULK_POLY = 64 << 10   # tensor bytes from which Poly1305 covers them (BLAKE2b below)
_ALL = 0x80000000      # in ``full``: every frame covered, tensors by Poly1305 (every=True)


class AuthError(Exception):
    """A message failed authentication (wrong secret, replay, tampering)."""


class SequenceGap(AuthError):
    """An authenticated message whose sequence number skips one or more: a message
    sent on this connection never arrived (deleted on the path). Nothing later
    from that sender can be trusted to be whole, so the transport loses the peer."""


_from_env: list[bytes | None] = [None]


def _keyed(key: bytes):
    """A BLAKE2b keyed with ``key`` (its first 32 bytes) that nothing was fed yet."""
    if len(_KEYED) >= _KEYED_MAX:
        _KEYED.clear()
    keyed = _KEYED[key] = hashlib.blake2b(key=key[:32], digest_size=TAG_BYTES)
    return keyed


def secret_from_env() -> bytes | None:
    """The cluster secret from ``DISTGRAD_SECRET`` (None when unset or empty).

    Read once: the variable leaves ``os.environ`` at once, so no process this one
    starts (a user's subprocess, Graphviz's ``dot``) inherits it; this process
    remembers it for a later init_rpc (a new value set in between replaces it)."""
    value = os.environ.pop("DISTGRAD_SECRET", None)
    if value is not None:
        _from_env[0] = os.fsencode(value) or None  # the bytes as given, even not UTF-8
    return _from_env[0]


def clean_env(env=None) -> dict:
    """A copy of ``env`` (default ``os.environ``) without the cluster secret: the
    environment for a child process that is not a worker of the cluster."""
    out = dict(os.environ if env is None else env)
    out.pop("DISTGRAD_SECRET", None)
    return out


class Authenticator:
    """Seals outgoing and opens incoming messages of one worker."""

    def __init__(self, secret: bytes, rank: int, mac_bulk: bool = False) -> None:
        if not secret:
            raise ValueError("an empty secret authenticates nothing")
        self._secret = hashlib.blake2b(secret, digest_size=32, person=b"distgrad-v1").digest()
        self.rank = rank
        self.nonce = os.urandom(16)
        self.mac_bulk = mac_bulk
        self._peer_nonces: dict[int, bytes] = {}
        self._send_keys: dict[int, bytes] = {}
        self._recv_keys: dict[int, bytes] = {}
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}

    def _key(self, sender: int, receiver: int, nonces: bytes, challenges: bytes) -> bytes:
        label = b"%d>%d|" % (sender, receiver) if not challenges else b"%d>%d|conn|" % (sender, receiver)
        return hmac.new(self._secret, label + nonces + challenges, hashlib.sha256).digest()

    def _derive(self, peer: int, challenges: bytes) -> None:
        nonce = self._peer_nonces[peer]
        self._send_keys[peer] = self._key(self.rank, peer, nonce + self.nonce, challenges)
        self._recv_keys[peer] = self._key(peer, self.rank, self.nonce + nonce, challenges)
        self._send_seq.pop(peer, None)
        self._recv_seq.pop(peer, None)

    def set_peer_nonce(self, peer: int, nonce: bytes) -> None:
        """Learn the nonce ``peer`` published; keys for both directions follow
        (bound to no connection until :meth:`bind`, which the transport calls for
        every connection it opens).

        Each key covers both processes' nonces: a new process under a rank (a
        member that rejoined a dynamic group) gets new keys both ways, so nothing
        sealed for or by the earlier one opens, and sequence numbers start over.

        Example::

            >>> a, b = Authenticator(b"s3cret", 0), Authenticator(b"s3cret", 1)
            >>> a.set_peer_nonce(1, b.nonce); b.set_peer_nonce(0, a.nonce)
            >>> b.open(0, a.seal(1, [b"envelope"]))
            [b'envelope']
        """
        self._peer_nonces[peer] = bytes(nonce)
        self._derive(peer, b"")

    def bind(self, peer: int, client_challenge: bytes, server_challenge: bytes) -> None:
        """Keys for ``peer`` bound to the connection whose handshake exchanged these
        challenges (:mod:`.handshake`: the connecting side's, then the accepting
        side's; both workers pass them in that order), after :meth:`set_peer_nonce`.

        Both challenges are fresh for every connection, so two connections between
        the same two processes get different keys both ways: a message (or a key)
        of one is refused on the other, and sequence numbers start over.

        Example::

            >>> cc, sc = client_handshake(sock, 0, 1, secret, False)   # on worker 0
            >>> a.bind(1, cc, sc)              # worker 1, from server_handshake: b.bind(0, cc, sc)
            >>> b.open(0, a.seal(1, [b"envelope"]))
            [b'envelope']
        """
        if peer not in self._peer_nonces:
            raise AuthError(f"no nonce of worker {peer} to bind a connection's keys to")
        self._derive(peer, b"c" + bytes(client_challenge) + b"s" + bytes(server_challenge))

    @staticmethod
    def _head(key: bytes, head: bytes, full: int, frames) -> tuple:
        """(the BLAKE2b over ``head``, the frame count and sizes and the first ``full``
        frames; the frames' sizes): what both kinds of tag begin with."""
        n = len(frames)
        sizes = []
        for f in frames:
            sizes.append(memoryview(f).nbytes)
        keyed = _KEYED.get(key)
        if keyed is None:
            keyed = _keyed(key)
        mac = keyed.copy()   # (as blake2b(key=...), without setting the key up again)
        mac.update(head)
        layout = _LAYOUTS.get(n)
        if layout is None:
            layout = _LAYOUTS[n] = struct.Struct(f"!I{n}Q")
        mac.update(layout.pack(n, *sizes))
        for f in frames[:full]:
            mac.update(f)
        return mac, sizes

    @staticmethod
    def _tag(key: bytes, head: bytes, full: int, frames) -> bytes:
        """The tag of ``frames`` (the first ``full`` in full, the rest by length)."""
        return Authenticator._head(key, head, full, frames)[0].digest()

    @staticmethod
    def _tag_every(key: bytes, head: bytes, full: int, frames) -> bytes:
        """The tag of ``frames`` with every byte covered: the first ``full`` by
        BLAKE2b, the rest by Poly1305 (one-time key from ``key`` and ``head``,
        which holds the sequence number) when they are large."""
        from cryptography.hazmat.primitives.poly1305 import Poly1305
        mac, sizes = Authenticator._head(key, head, full, frames)
        if sum(sizes[full:]) >= BULK_POLY:
            one_time = hashlib.blake2b(head, key=key[:32], digest_size=32,
                                       person=b"dg-poly1305-otk").digest()
            poly = Poly1305(one_time)
            for f in frames[full:]:
                poly.update(f)
            mac.update(poly.finalize())
        else:
            for f in frames[full:]:
                mac.update(f)
        return mac.digest()

    def seal(self, peer: int, frames: list, full: int = 1, every: bool = False) -> list:
        """``frames`` with the authentication frame in front; the first ``full``
        frames (the envelope) are covered in full, the rest by length (all of
        them with ``mac_bulk``; with ``every``, the rest too, by Poly1305 when
        large: for TCP, see the module docstring)."""
        seq = self._send_seq.get(peer, 0) + 1
        full = len(frames) if self.mac_bulk else min(full, len(frames))
        if every:
            head = _HEAD.pack(seq, full | _ALL)
            out = [head + self._tag_every(self._send_keys[peer], head, full, frames), *frames]
        else:
            head = _HEAD.pack(seq, full)
            out = [head + self._tag(self._send_keys[peer], head, full, frames), *frames]
        self._send_seq[peer] = seq  # (only once sealed: a seal that raised uses no number)
        return out

    def send_mark(self, peer: int) -> int:
        """The last sequence number sealed for ``peer``: :meth:`rewind` to it when the
        messages sealed after it are never sent (the receiver expects no gap)."""
        return self._send_seq.get(peer, 0)

    def rewind(self, peer: int, mark: int) -> None:
        """Forget the messages sealed for ``peer`` after :meth:`send_mark` gave ``mark``."""
        self._send_seq[peer] = mark

    def open(self, peer: int, frames: list, min_full: int = 1, every: bool = False) -> list:
        """The frames without the authentication frame; raises AuthError when forged,
        replayed (SequenceGap when one before it is missing), from a worker this
        one has no key for, or covering fewer than ``min_full`` frames (all with
        ``mac_bulk``) in full, or (``every``: a TCP connection) not covering every byte."""
        key = self._recv_keys.get(peer)
        if key is None:
            raise AuthError(f"no key for worker {peer}")
        if not frames or memoryview(frames[0]).nbytes != AUTH_FRAME_BYTES:
            raise AuthError("missing authentication frame")
        auth = bytes(frames[0])
        head = auth[:_HEAD.size]
        seq, full = _HEAD.unpack(head)
        body = frames[1:]
        if every != bool(full & _ALL):
            raise AuthError("message does not cover every byte" if every else
                            "message covers every byte where the link does not ask it")
        if every:
            full &= ~_ALL
            if full > len(body) or not hmac.compare_digest(
                    auth[_HEAD.size:], self._tag_every(key, head, full, body)):
                raise AuthError("bad authentication tag")
        elif not hmac.compare_digest(auth[_HEAD.size:], self._tag(key, head, full, body)):
            raise AuthError("bad authentication tag")
        need = len(body) if self.mac_bulk else min(min_full, len(body))
        if full < need and not every:   # (with every, Poly1305 covered the rest)
            raise AuthError(f"message covers {full} of {len(body)} frames in full")
        last = self._recv_seq.get(peer, 0)
        if seq <= last:
            raise AuthError(f"replayed message (sequence {seq})")
        if seq != last + 1:
            raise SequenceGap(f"{seq - last - 1} message(s) missing before sequence {seq}: "
                              "deleted on the path")
        self._recv_seq[peer] = seq
        return body
