"""Message authentication for the transport: no frame is handed up (and so
nothing is unpickled) before its sender proved it knows the cluster secret.

Every message from worker S to worker R carries a first frame
``seq (8 bytes) || tag (16 bytes)`` where ``tag`` is a keyed BLAKE2b MAC over
the sequence number, the length of every frame and the content of every
frame up to ``FULL_MAC_LIMIT`` bytes (larger frames - bulk tensor bytes - are
covered by length only, unless ``mac_bulk`` is set; they are raw data and are
never unpickled). The key of the direction S->R is derived from the secret,
both ranks and a nonce R chose at start-up and keeps in memory, so messages
recorded in an earlier session never verify again, and sequence numbers must
grow, so a message is never accepted twice.

Example::

    >>> a, b = Authenticator(b"s3cret", 0), Authenticator(b"s3cret", 1)
    >>> a.set_peer_nonce(1, b.nonce); b.set_peer_nonce(0, a.nonce)
    >>> frames = a.seal(1, [b"header", b"meta"])
    >>> b.open(0, frames)
    [b'header', b'meta']
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

FULL_MAC_LIMIT = 64 * 1024  # wire.pickler.SNAPSHOT_BYTES copies tensors below it at call time
_SEQ = struct.Struct("!Q")
TAG_BYTES = 16


class AuthError(Exception):
    """A message failed authentication (wrong secret, replay, tampering)."""


def secret_from_env() -> bytes | None:
    """The cluster secret from ``DISTGRAD_SECRET`` (None when unset or empty)."""
    value = os.environ.get("DISTGRAD_SECRET", "")
    return value.encode() if value else None


class Authenticator:
    """Seals outgoing and opens incoming messages of one worker."""

    def __init__(self, secret: bytes, rank: int, mac_bulk: bool = False) -> None:
        if not secret:
            raise ValueError("an empty secret authenticates nothing")
        self._secret = hashlib.blake2b(secret, digest_size=32, person=b"distgrad-v1").digest()
        self.rank = rank
        self.nonce = os.urandom(16)
        self.mac_bulk = mac_bulk
        self._send_keys: dict[int, bytes] = {}
        self._recv_keys: dict[int, bytes] = {}
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}

    def _key(self, sender: int, receiver: int, nonce: bytes) -> bytes:
        return hmac.new(self._secret, b"%d>%d|" % (sender, receiver) + nonce, hashlib.sha256).digest()

    def set_peer_nonce(self, peer: int, nonce: bytes) -> None:
        """Learn the nonce ``peer`` published; keys for both directions follow."""
        self._send_keys[peer] = self._key(self.rank, peer, nonce)
        self._recv_keys[peer] = self._key(peer, self.rank, self.nonce)

    def _tag(self, key: bytes, seq: int, frames) -> bytes:
        mac = hashlib.blake2b(key=key[:32], digest_size=TAG_BYTES)
        mac.update(_SEQ.pack(seq))
        mac.update(struct.pack("!I", len(frames)))
        for f in frames:
            n = memoryview(f).nbytes
            mac.update(_SEQ.pack(n))
            if n <= FULL_MAC_LIMIT or self.mac_bulk:
                mac.update(f)
        return mac.digest()

    def seal(self, peer: int, frames: list) -> list:
        """``frames`` with the authentication frame in front."""
        seq = self._send_seq.get(peer, 0) + 1
        self._send_seq[peer] = seq
        return [_SEQ.pack(seq) + self._tag(self._send_keys[peer], seq, frames), *frames]

    def open(self, peer: int, frames: list) -> list:
        """The frames without the authentication frame; raises AuthError when forged,
        replayed or from a worker this one has no key for."""
        key = self._recv_keys.get(peer)
        if key is None:
            raise AuthError(f"no key for worker {peer}")
        if not frames or memoryview(frames[0]).nbytes != _SEQ.size + TAG_BYTES:
            raise AuthError("missing authentication frame")
        head = bytes(frames[0])
        seq = _SEQ.unpack_from(head)[0]
        body = frames[1:]
        if not hmac.compare_digest(head[_SEQ.size:], self._tag(key, seq, body)):
            raise AuthError("bad authentication tag")
        if seq <= self._recv_seq.get(peer, 0):
            raise AuthError(f"replayed message (sequence {seq})")
        self._recv_seq[peer] = seq
        return body
