"""Authenticated encryption of every frame (``encrypt=True`` / ``DISTGRAD_ENCRYPT=1``).

Each direction of a connection has its own AES-256-GCM key, derived with HKDF
(SHA-256) from the cluster secret, salted with both challenges of that
connection's handshake (:mod:`.handshake`) and bound to the two ranks: no key
is ever sent, and keys differ per connection and per start-up. A message gets
a first frame holding its sequence number; frame ``i`` is encrypted under the
nonce (sequence number, ``i``), with the sequence number and every frame's
length as associated data, so frames cannot be swapped, cut, replayed or
reordered. Each message must carry the sequence number after the last one
accepted (:class:`~.auth.SequenceGap` otherwise: a message was deleted), as with
the MAC of :mod:`.auth`, which encryption replaces (GCM's tag authenticates every byte of every frame).

Example::

    >>> a = FrameCipher(b"s", 0, 1, cc, sc); b = FrameCipher(b"s", 1, 0, cc, sc)
    >>> b.open(a.seal([b"envelope", b"tensor bytes"]))
    [b'envelope', b'tensor bytes']
"""
from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import framing
from .auth import AuthError, SequenceGap

_INTO = hasattr(AESGCM, "decrypt_into")  # cryptography >= 45
_SEQ = struct.Struct("!Q")


def _flat(f):
    v = memoryview(f)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")
_NONCE = struct.Struct("!QI")
TAG = 16


def _key(secret: bytes, sender: int, receiver: int, salt: bytes) -> AESGCM:
    hk = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt,
              info=b"distgrad-aead %d>%d" % (sender, receiver))
    return AESGCM(hk.derive(secret))


class FrameCipher:
    """Seals what this worker sends to one peer and opens what it receives from it."""

    def __init__(self, secret: bytes, me: int, peer: int, client_challenge: bytes,
                 server_challenge: bytes) -> None:
        salt = client_challenge + server_challenge
        self._send = _key(secret, me, peer, salt)
        self._recv = _key(secret, peer, me, salt)
        self._send_seq = 0
        self._recv_seq = 0

    @staticmethod
    def _aad(head: bytes, sizes: list[int]) -> bytes:
        return head + struct.pack(f"!{len(sizes)}Q", *sizes)

    def seal(self, frames: list) -> list:
        """``frames`` encrypted, behind a sequence-number frame (callers serialize seals)."""
        seq = self._send_seq + 1
        head = _SEQ.pack(seq)
        aad = self._aad(head, [memoryview(f).nbytes for f in frames])
        enc = self._send.encrypt
        out = [head, *[enc(_NONCE.pack(seq, i), _flat(f), aad) for i, f in enumerate(frames)]]
        self._send_seq = seq  # (only once sealed: a seal that raised uses no number)
        return out

    def send_mark(self) -> int:
        """The last sequence number sealed: :meth:`rewind` to it when the messages
        sealed after it are never sent."""
        return self._send_seq

    def rewind(self, mark: int) -> None:
        """Forget the messages sealed after :meth:`send_mark` gave ``mark``."""
        self._send_seq = mark

    def open(self, frames: list) -> list:
        """The plaintext frames; raises AuthError when anything was forged or replayed, SequenceGap
        when a message before it is missing."""
        if len(frames) < 2 or memoryview(frames[0]).nbytes != _SEQ.size:
            raise AuthError("missing sequence frame")
        head = bytes(frames[0])
        seq = _SEQ.unpack(head)[0]
        if seq <= self._recv_seq:
            raise AuthError(f"replayed message (sequence {seq})")
        sizes = [memoryview(f).nbytes - TAG for f in frames[1:]]
        if min(sizes) < 0:
            raise AuthError("a frame shorter than its tag")
        aad = self._aad(head, sizes)
        out = []
        try:
            for i, f in enumerate(frames[1:]):
                nonce = _NONCE.pack(seq, i)
                if _INTO:  # straight into the (writable) buffer tensors are built on
                    buf = framing.alloc(sizes[i])
                    self._recv.decrypt_into(nonce, _flat(f), aad, buf)
                else:
                    buf = bytearray(self._recv.decrypt(nonce, _flat(f), aad))
                out.append(buf)
        except InvalidTag:
            raise AuthError("bad authentication tag") from None
        if seq != self._recv_seq + 1:
            raise SequenceGap(f"{seq - self._recv_seq - 1} message(s) missing before "
                              f"sequence {seq}: deleted on the path")
        self._recv_seq = seq
        return out
