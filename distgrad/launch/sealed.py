"""Entries distgrad keeps in the rendezvous store: plain data, sealed with the secret.

The store (torch's TCPStore at MASTER_ADDR:MASTER_PORT, torchrun's agent store,
``distgrad store``, a ``file://`` FileStore) is unauthenticated: whoever reaches
it may write any key. So nothing distgrad reads from it is unpickled, and
nothing in it is believed without the cluster secret. Every value distgrad
writes is::

    b"DGS1" | tag (32 bytes) | JSON

where the JSON can express nothing but data, and ``tag`` is an HMAC-SHA256
under a key derived with HKDF from ``DISTGRAD_SECRET`` stretched by scrypt
(:func:`store_key`: a guess at the secret costs a scrypt) over the attempt id, the
full key name and the JSON: a value moved to another key, or replayed in
another attempt (a torchrun restart; for a static group's exchange, another
rendezvous at all: see :func:`distgrad.launch.rendezvous.exchange`), fails the
check like a forged one. An entry that fails it is ignored (one warning naming
the key, per key) and remembered, so that a start that then cannot complete
says which entries were tampered with (:class:`StoreTamperedError`). An entry
that passes it (or, without a secret, any entry) that is not well-formed raises
:class:`ProtocolError` naming the key, the store and what was wrong.

Without a secret the tag is 32 zero bytes and nothing can be authenticated;
still nothing is unpickled.

Counters (``store.add``) are plain integers that cannot carry a tag: distgrad
reads them as liveness and ordering hints only (a join count, a lease, a
ledger's length), never as something that chooses an address or a rank's
entry.

Example::

    >>> seal = StoreSeal(b"s3cret", "the rendezvous store at tcp://10.0.0.1:29500")
    >>> raw = seal.seal("distgrad/0.1/worker/1", {"name": "w1", "address": "tcp://..."})
    >>> seal.open("distgrad/0.1/worker/1", raw)["name"]
    'w1'
    >>> seal.open("distgrad/0.1/worker/2", raw) is None     # moved: fails the check
    True
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import ProtocolError, StoreTamperedError
from ..transport.handshake import stretch

log = logging.getLogger(__name__)
MAGIC = b"DGS1"
TAG_BYTES = 32
_ZERO_TAG = bytes(TAG_BYTES)


def attempt_id() -> str:
    """The attempt this process belongs to: torchrun's restart count (``0`` outside
    torchrun); the same on every worker of one attempt."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def store_key(secret: bytes) -> bytes:
    """The key that seals store entries: HKDF (SHA-256) over the cluster secret
    stretched by scrypt (:func:`~distgrad.transport.handshake.stretch`, once per
    process, shared with the transport), apart from every transport key (its own
    ``info``). Whoever reads a sealed entry and tests guesses at the secret
    against its tag pays a scrypt per guess, as against the handshake."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"distgrad-store-v2").derive(stretch(secret))


def _framed(*parts: bytes) -> bytes:
    return b"".join(struct.pack("!I", len(p)) + p for p in parts)


class StoreSeal:
    """Seals the values one worker writes to the store and opens those it reads.

    ``where`` names the store in messages; ``attempt`` (default :func:`attempt_id`)
    is bound into every tag. :meth:`bound` gives a seal for a narrower attempt that
    shares this one's record of tampered keys and warnings."""

    def __init__(self, secret: bytes | None, where: str, attempt: str | None = None,
                 worker: str | None = None) -> None:
        self._key = store_key(secret) if secret else None
        self.where = where
        self.attempt = attempt_id() if attempt is None else attempt
        self.worker = worker
        self.tampered: dict[str, str] = {}   # full key -> what was wrong (the latest)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @property
    def authenticated(self) -> bool:
        """Whether entries are checked (a cluster secret is set)."""
        return self._key is not None

    def bound(self, extra: str) -> StoreSeal:
        """A seal whose attempt is this one's plus ``extra`` (same key, same record)."""
        other = StoreSeal(None, self.where, f"{self.attempt}|{extra}", self.worker)
        other._key, other.tampered, other._warned, other._lock = (self._key, self.tampered,
                                                                  self._warned, self._lock)
        return other

    def _tag(self, key: str, body: bytes) -> bytes:
        if self._key is None:
            return _ZERO_TAG
        return hmac.new(self._key, _framed(self.attempt.encode(), key.encode(), body),
                        hashlib.sha256).digest()

    def seal(self, key: str, value: Any) -> bytes:
        """``value`` (JSON data) as the store holds it under the full key name ``key``."""
        body = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
        return MAGIC + self._tag(key, body) + body

    def open(self, key: str, raw: bytes, check: Callable[[Any], str | None] | None = None) -> Any:
        """The value sealed under ``key``; None when it fails authentication (then it
        is ignored: warned once per key, remembered in ``tampered``). Raises
        ProtocolError when an authentic entry (without a secret: any entry) is not
        well-formed; ``check(value)`` returns what is wrong with it, or None."""
        raw = bytes(raw)
        head = len(MAGIC) + TAG_BYTES
        if self._key is not None:
            if len(raw) < head or raw[:len(MAGIC)] != MAGIC:
                return self.reject(key, f"not a distgrad entry ({_preview(raw)})")
            tag = raw[len(MAGIC):head]
            if tag == _ZERO_TAG:
                return self.reject(key, "not authenticated: written by a process without the "
                                        "cluster secret (DISTGRAD_SECRET unset there?) or forged")
            if not hmac.compare_digest(tag, self._tag(key, raw[head:])):
                return self.reject(key, "failed authentication: forged, altered, replayed from "
                                        "another key or attempt, or written with another secret")
        elif len(raw) < head or raw[:len(MAGIC)] != MAGIC:
            raise self.malformed(key, f"not a distgrad entry ({_preview(raw)})")
        elif raw[len(MAGIC):head] != _ZERO_TAG:
            # a peer sealed it: the group runs with a secret this worker lacks (without a
            # secret nothing is authenticated, so failing at once costs no protection)
            raise self.malformed(key, "it was sealed by a worker that requires the cluster secret "
                                      "(DISTGRAD_SECRET) and this worker has none: set the same "
                                      "DISTGRAD_SECRET on every worker")
        try:
            value = json.loads(raw[head:].decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise self.malformed(key, f"not valid JSON: {e}") from None
        problem = check(value) if check is not None else None
        if problem is not None:
            raise self.malformed(key, problem)
        with self._lock:
            self.tampered.pop(key, None)
        return value

    def reject(self, key: str, what: str) -> None:
        """Record that the entry under ``key`` cannot be used (warned once per key);
        returns None, for :meth:`open`."""
        with self._lock:
            self.tampered[key] = what
            first = key not in self._warned
            self._warned.add(key)
        if first:
            log.warning("%s: ignored store entry %r in %s: %s",
                        f"worker {self.worker}" if self.worker else "distgrad", key, self.where, what)
        return None

    def malformed(self, key: str, what: str) -> ProtocolError:
        """The ProtocolError for a malformed entry under ``key``."""
        return ProtocolError(f"{self._who()}store entry {key!r} in {self.where} is malformed: {what}",
                             self.worker)

    def tampered_error(self, what: str, keys: dict[str, str] | None = None) -> StoreTamperedError:
        """The error of a start that could not complete because entries were tampered
        with: ``what`` failed, then each key and what was wrong with it."""
        with self._lock:
            keys = dict(self.tampered if keys is None else keys)
        listed = "; ".join(f"{k}: {v}" for k, v in sorted(keys.items()))
        return StoreTamperedError(f"{self._who()}{what}: the entries of {self.where} were tampered "
                                  f"with ({listed})", self.worker, keys)

    def _who(self) -> str:
        return f"worker {self.worker!r}: " if self.worker else ""


def _preview(raw: bytes) -> str:
    return f"{len(raw)} bytes starting {raw[:8]!r}"


def is_int(value: Any, low: int, high: int) -> bool:
    """``value`` is a JSON integer (not a bool) in ``[low, high)``."""
    return type(value) is int and low <= value < high


def expect(value: Any, **fields: type) -> str | None:
    """What is wrong with ``value`` as a JSON object of exactly ``fields`` (name:
    type); None when nothing is. For :meth:`StoreSeal.open`'s ``check``.

    Example::

        >>> expect({"name": "w1", "address": 3}, name=str, address=str)
        "expected {'name': str, 'address': str}, found {'name': 'w1', 'address': 3}"
    """
    if isinstance(value, dict) and set(value) == set(fields) and all(
            type(value[k]) is t for k, t in fields.items()):
        return None
    text = repr(value)
    found = text if len(text) <= 80 else text[:77] + "..."
    want = ", ".join(f"{k!r}: {t.__name__}" for k, t in fields.items())
    return f"expected {{{want}}}, found {found}"
