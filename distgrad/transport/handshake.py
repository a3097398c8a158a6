"""Opening a connection between two workers: who is who, and proof of the secret.

The connecting worker (the lower rank) and the accepting one exchange, before
any message::

    client -> server   magic | client rank | server rank | flags | client challenge (16 B)
    server -> client   magic | server rank | flags | server challenge (16 B) | server proof (32 B)
    client -> server   client proof (32 B)

``flags`` say whether each side has a cluster secret and wants encryption, so
a mismatch fails at once with a message that says which. With a secret, each
proof is an HMAC under a key derived from the secret over both ranks and both
fresh challenges: a peer without the secret cannot answer, and an answer
recorded earlier never fits a new challenge. No frame of a connection is read
before its handshake succeeded. The two challenges also salt the per-direction
encryption keys (:mod:`.crypto`).

Example::

    >>> ch = client_handshake(sock, my_rank=0, peer_rank=1, secret=b"s", encrypt=False)
    >>> peer_rank, ch = server_handshake(conn, my_rank=1, secret=b"s", encrypt=False, expect={0})
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable, Collection

MAGIC = b"DGT1"
_HELLO = struct.Struct("!4sIIB16s")
_WELCOME = struct.Struct("!4sIB16s32s")
_PROOF = 32
F_SECRET, F_ENCRYPT = 1, 2


class HandshakeError(Exception):
    """The peer is not a worker of this cluster, or its settings differ."""


def _flags(secret: bytes | None, encrypt: bool) -> int:
    return (F_SECRET if secret else 0) | (F_ENCRYPT if encrypt else 0)


def _describe(flags: int) -> str:
    return (f"cluster secret {'set' if flags & F_SECRET else 'unset'} (DISTGRAD_SECRET), "
            f"encryption {'on' if flags & F_ENCRYPT else 'off'} (DISTGRAD_ENCRYPT)")


def _proof(secret: bytes | None, role: bytes, client: int, server: int, cc: bytes, sc: bytes) -> bytes:
    if not secret:
        return bytes(_PROOF)
    key = hashlib.sha256(b"distgrad-handshake|" + secret).digest()
    return hmac.new(key, role + struct.pack("!II", client, server) + cc + sc, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, my_rank: int, peer_rank: int, secret: bytes | None,
                     encrypt: bool) -> tuple[bytes, bytes]:
    """Run the connecting side; returns (client challenge, server challenge)."""
    cc = os.urandom(16)
    flags = _flags(secret, encrypt)
    sock.sendall(_HELLO.pack(MAGIC, my_rank, peer_rank, flags, cc))
    magic, rank, sflags, sc, sproof = _WELCOME.unpack(_recv_exact(sock, _WELCOME.size))
    if magic != MAGIC:
        raise HandshakeError(f"worker {peer_rank} does not speak distgrad's protocol")
    if rank != peer_rank:
        raise HandshakeError(f"expected worker {peer_rank} at this address, found worker {rank}")
    if sflags != flags:
        raise HandshakeError(f"worker {peer_rank} runs with {_describe(sflags)}; this worker with "
                             f"{_describe(flags)}")
    if not hmac.compare_digest(sproof, _proof(secret, b"S", my_rank, peer_rank, cc, sc)):
        raise HandshakeError(f"worker {peer_rank} does not know the cluster secret")
    sock.sendall(_proof(secret, b"C", my_rank, peer_rank, cc, sc))
    return cc, sc


def server_handshake(sock: socket.socket, my_rank: int, secret: bytes | None, encrypt: bool,
                     expect: Collection[int] | Callable[[int], bool]) -> tuple[int, bytes, bytes]:
    """Run the accepting side for a peer whose rank must be in ``expect`` (or for
    which ``expect(rank)`` is true, asked once its proof checked out); returns
    (peer rank, client challenge, server challenge)."""
    magic, rank, expected, cflags, cc = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
    if magic != MAGIC:
        raise HandshakeError("not a distgrad worker (bad magic)")
    flags = _flags(secret, encrypt)
    sc = os.urandom(16)
    if expected != my_rank:
        raise HandshakeError(f"a peer claiming rank {rank} expected worker {expected}, this is {my_rank}")
    sock.sendall(_WELCOME.pack(MAGIC, my_rank, flags, sc, _proof(secret, b"S", rank, my_rank, cc, sc)
                               if cflags == flags else bytes(_PROOF)))
    if cflags != flags:
        raise HandshakeError(f"a peer claiming rank {rank} runs with {_describe(cflags)}; this worker "
                             f"with {_describe(flags)}")
    if not hmac.compare_digest(_recv_exact(sock, _PROOF), _proof(secret, b"C", rank, my_rank, cc, sc)):
        raise HandshakeError(f"a peer claiming rank {rank} does not know the cluster secret")
    if not (expect(rank) if callable(expect) else rank in expect):
        raise HandshakeError(f"a peer claiming rank {rank} is not expected (already connected, or "
                             "not a lower rank of this cluster)")
    return rank, cc, sc
