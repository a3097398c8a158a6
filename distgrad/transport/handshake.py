"""Opening a connection between two workers: who is who, and proof of the secret.

The connecting worker (the lower rank, or a joiner) and the accepting one
exchange, before any message::

    client -> server   magic | client rank | server rank | flags | client challenge (16 B)
    server -> client   magic | server rank | flags | server challenge (16 B)
    client -> server   client proof (32 B)
    server -> client   verdict (1 B) | server proof (32 B)

The client proves first: the server sends nothing that depends on the secret
before the client proved it knows it, so a stranger who connects learns only a
random challenge, never a value against which to test guesses at the secret
offline. Only once the client's proof checked out (verdict ``OK``) does the
server prove its own; otherwise it sends the verdict ``BAD_PROOF`` (the client
knows its own proof was wrong: nothing new) or ``NOT_EXPECTED``, and closes.

``flags`` say whether each side has a cluster secret, wants encryption and (on
this connection: TCP) authenticates every byte of tensors
(``DISTGRAD_MAC_TENSORS``, :mod:`.auth`), so a mismatch fails at once with a
message that says which. With a secret, each
proof is an HMAC, over both ranks and both fresh challenges, under a key from
``secret``: the transport passes the secret stretched by scrypt
(:func:`stretch`, once per process), so each guess at the secret costs the
guesser a scrypt, and an answer recorded earlier never fits a new challenge.
The whole handshake has one deadline (``deadline``, a monotonic time): a peer
that drips bytes cannot hold it longer. No frame of a connection is read before its handshake succeeded. The
two challenges also salt the connection's per-direction keys: the encryption keys
(:mod:`.crypto`) or, without encryption, the MAC keys (:meth:`.auth.Authenticator.bind`),
so each connection, even a second one between the same two processes, has keys of its own.

Example::

    >>> ch = client_handshake(sock, my_rank=0, peer_rank=1, secret=b"s", encrypt=False)
    >>> peer_rank, cc, sc = server_handshake(conn, 1, b"s", False, expect={0})
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection

from .strength import secret_bits

MAGIC = b"DGT2"
_HELLO = struct.Struct("!4sIIB16s")
_WELCOME = struct.Struct("!4sIB16s")
_PROOF = 32
_VERDICT = struct.Struct("!B32s")
OK, BAD_PROOF, NOT_EXPECTED = 1, 2, 3
F_SECRET, F_ENCRYPT, F_MAC_ALL = 1, 2, 4
HANDSHAKE_SECONDS = float(os.environ.get("DISTGRAD_HANDSHAKE_TIMEOUT", "5"))
GOOD_SECRET_HINT = 'python -c "import secrets; print(secrets.token_hex(32))"'

log = logging.getLogger("distgrad.transport.handshake")


class HandshakeError(Exception):
    """The peer is not a worker of this cluster, or its settings differ."""


class Refused(HandshakeError):
    """The server answered with a verdict other than OK: retrying will not help."""


# -- the secret -------------------------------------------------------------------
_stretched: dict[bytes, bytes] = {}
_stretch_lock = threading.Lock()


def stretch(secret: bytes) -> bytes:
    """The key every other key derives from (the transport's, the store's seals):
    scrypt over the secret (n=2**14, r=8: some 16 MiB and tens of ms), computed
    once per process and secret. Warns, once, when the secret looks weaker than
    128 bits (:func:`~distgrad.transport.strength.secret_bits`: dictionary words
    count as words; the estimate is made once, and its work is bounded whatever
    the secret's length).

    Example::

        >>> key = stretch(b"4f1c...")   # 32 bytes; the same key every call in this process
        >>> key == stretch(b"4f1c...")
        True
    """
    with _stretch_lock:
        key = _stretched.get(secret)
        if key is None:
            from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
            bits = secret_bits(secret)
            if bits < 128:
                log.warning("the cluster secret (DISTGRAD_SECRET) looks weaker than 128 bits "
                            "(%d characters, some %d bits counting words as words and what a "
                            "guesser tries first): anyone who reaches a worker or reads the "
                            "store can try guesses at it. Make a good one with: %s",
                            len(secret), bits, GOOD_SECRET_HINT)
            key = Scrypt(salt=b"distgrad-secret-v2", length=32, n=2 ** 14, r=8, p=1).derive(secret)
            _stretched[secret] = key
        return key


# -- the exchange -----------------------------------------------------------------
def _flags(secret: bytes | None, encrypt: bool, mac_all: bool = False) -> int:
    return (F_SECRET if secret else 0) | (F_ENCRYPT if encrypt else 0) | (F_MAC_ALL if mac_all else 0)


def _describe(flags: int) -> str:
    return (f"cluster secret {'set' if flags & F_SECRET else 'unset'} (DISTGRAD_SECRET), "
            f"encryption {'on' if flags & F_ENCRYPT else 'off'} (DISTGRAD_ENCRYPT), "
            f"tensor bytes on TCP {'' if flags & F_MAC_ALL else 'not '}authenticated "
            "(DISTGRAD_MAC_TENSORS)")


def _proof(secret: bytes | None, role: bytes, client: int, server: int, cc: bytes, sc: bytes) -> bytes:
    if not secret:
        return bytes(_PROOF)
    key = hashlib.sha256(b"distgrad-handshake|" + secret).digest()
    return hmac.new(key, role + struct.pack("!II", client, server) + cc + sc, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("the handshake did not finish in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise HandshakeError("the handshake did not finish in time") from None
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise HandshakeError("the handshake did not finish in time") from None


def client_handshake(sock: socket.socket, my_rank: int, peer_rank: int, secret: bytes | None,
                     encrypt: bool, deadline: float | None = None,
                     mac_all: bool = False) -> tuple[bytes, bytes]:
    """Run the connecting side; returns (client challenge, server challenge).
    Raises :class:`Refused` when the server judged this side's proof or rank
    (retrying will not help), HandshakeError or OSError otherwise."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS if deadline is None else deadline
    cc = os.urandom(16)
    flags = _flags(secret, encrypt, mac_all)
    _send(sock, _HELLO.pack(MAGIC, my_rank, peer_rank, flags, cc), deadline)
    magic, rank, sflags, sc = _WELCOME.unpack(_recv_exact(sock, _WELCOME.size, deadline))
    if magic != MAGIC:
        raise Refused(f"worker {peer_rank} does not speak distgrad's protocol")
    if rank != peer_rank:
        raise Refused(f"expected worker {peer_rank} at this address, found worker {rank}")
    if sflags != flags:
        raise Refused(f"worker {peer_rank} runs with {_describe(sflags)}; this worker with "
                      f"{_describe(flags)}")
    _send(sock, _proof(secret, b"C", my_rank, peer_rank, cc, sc), deadline)
    verdict, sproof = _VERDICT.unpack(_recv_exact(sock, _VERDICT.size, deadline))
    if verdict == BAD_PROOF:
        raise Refused(f"worker {peer_rank} refused this worker's proof: the two have different "
                      "cluster secrets (DISTGRAD_SECRET)")
    if verdict != OK:
        raise Refused(f"worker {peer_rank} does not expect worker {my_rank} (already connected, "
                      "or not a member of its group)")
    if not hmac.compare_digest(sproof, _proof(secret, b"S", my_rank, peer_rank, cc, sc)):
        raise Refused(f"worker {peer_rank} does not know the cluster secret")
    return cc, sc


def server_handshake(sock: socket.socket, my_rank: int, secret: bytes | None, encrypt: bool,
                     expect: Collection[int] | Callable[[int], bool],
                     deadline: float | None = None, mac_all: bool = False) -> tuple[int, bytes, bytes]:
    """Run the accepting side for a peer whose rank must be in ``expect`` (or for
    which ``expect(rank)`` is true, asked once its proof checked out), all of it
    by ``deadline`` (monotonic; default: :data:`HANDSHAKE_SECONDS` from now);
    returns (peer rank, client challenge, server challenge)."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS if deadline is None else deadline
    magic, rank, expected, cflags, cc = _HELLO.unpack(_recv_exact(sock, _HELLO.size, deadline))
    if magic != MAGIC:
        raise HandshakeError("not a distgrad worker (bad magic)")
    flags = _flags(secret, encrypt, mac_all)
    sc = os.urandom(16)
    if expected != my_rank:
        raise HandshakeError(f"a peer claiming rank {rank} expected worker {expected}, this is {my_rank}")
    _send(sock, _WELCOME.pack(MAGIC, my_rank, flags, sc), deadline)
    if cflags != flags:
        raise HandshakeError(f"a peer claiming rank {rank} runs with {_describe(cflags)}; this worker "
                             f"with {_describe(flags)}")
    if not hmac.compare_digest(_recv_exact(sock, _PROOF, deadline),
                               _proof(secret, b"C", rank, my_rank, cc, sc)):
        _send_quietly(sock, _VERDICT.pack(BAD_PROOF, bytes(_PROOF)))
        raise HandshakeError(f"a peer claiming rank {rank} does not know the cluster secret")
    if not (expect(rank) if callable(expect) else rank in expect):
        _send_quietly(sock, _VERDICT.pack(NOT_EXPECTED, bytes(_PROOF)))
        raise HandshakeError(f"a peer claiming rank {rank} is not expected (already connected, or "
                             "not a lower rank of this cluster)")
    _send(sock, _VERDICT.pack(OK, _proof(secret, b"S", rank, my_rank, cc, sc)), deadline)
    return rank, cc, sc


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.settimeout(0.5)
        sock.sendall(data)
    except OSError:
        pass
