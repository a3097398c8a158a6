"""torch's refusal to mix static and dynamic members on one store.

A static group's worker (``init_rpc`` with ``world_size``) enters a ledger in
the store before it checks for a dynamic group: ``static/count`` numbers the
entries, ``static/<i>`` holds ``(name, address)``, ``static/<i>/out`` marks
one that is gone (set once: whoever sets it first counted it out). A dynamic
joiner writes itself into the member table first and reads the ledger after,
so of two that start together at least one sees the other.

An entry not marked out is taken for a live static member only while there is
evidence of it: a worker that was SIGKILLed never marks itself out, so a
dynamic joiner that finds an entry connects to its listening address, and one
that refuses the connection (nobody listens there: the process is gone) is
marked out there and then. A store that outlives its groups (``file://``,
``distgrad store``) therefore takes a dynamic group once the static one is
gone, however it ended; a live static group (its address accepts) is refused
with torch's message. No clock is compared.

Example::

    >>> slot = count_in(store, "worker0", "tcp://10.0.0.5:41234#...")
    >>> check_static_join(store, "worker0")     # RuntimeError when a dynamic group runs
    >>> count_out(store, slot)
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any
from urllib.parse import urlparse

from ..launch import rendezvous
from ..launch.sealed import StoreSeal, expect

log = logging.getLogger(__name__)
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported."
_MISSING_GRACE = 2.0  # an entry numbered but never written: its writer died in between
_PROBE_TIMEOUT = 2.0
_MAX_SCAN = 1024  # ledger entries one look reads past the watermark (the counter is anyone's)


def root(attempt: str | None = None) -> str:
    """The store prefix of this torchrun attempt (``distgrad/<restart count>/``)."""
    return f"distgrad/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') if attempt is None else attempt}/"


def _key(*parts: Any) -> str:
    return root() + "static/" + "/".join(str(p) for p in parts)


def _seal(store: Any, seal: StoreSeal | None) -> StoreSeal:
    return seal if seal is not None else rendezvous.store_seal(store)


def count_in(store: Any, name: str, address: str, seal: StoreSeal | None = None) -> int:
    """Enter the ledger as a live static member listening on ``address``; returns
    the slot to :func:`count_out` with."""
    seal = _seal(store, seal)
    slot = rendezvous.counter(store, _key("count"), 1)
    store.set(_key(slot), seal.seal(_key(slot), {"name": name, "address": address}))
    return slot


def count_out(store: Any, slot: int, seal: StoreSeal | None = None) -> bool:
    """Mark ledger entry ``slot`` gone; True when this call did (once per entry)."""
    key = _key(slot, "out")
    token = _seal(store, seal).seal(key, {"by": f"{os.getpid()}:{os.urandom(6).hex()}"})
    return store.compare_set(key, "", token) == token


def check_static_join(store: Any, name: str, table: dict) -> None:
    """A static member may not join a store where a dynamic group runs: RuntimeError
    with torch's message (``table``: the dynamic group's members, see membership)."""
    if table:
        raise RuntimeError(f"{MIXED} (worker {name!r} has world_size set; the dynamic group on "
                           f"this store has {sorted(n for n, _, _ in table.values())})")


def live_static_member(store: Any, seal: StoreSeal | None = None) -> str | None:
    """The name of a static member that may still live on this store (None when
    none): entries whose address refuses a connection, or that were never written
    (or fail authentication), are marked out here (see the module docstring). The
    ledger's counter is anyone's to move: at most ``_MAX_SCAN`` entries are looked at."""
    seal = _seal(store, seal)
    count = rendezvous.counter(store, _key("count"), 0)
    done_key = _key("done")
    ours = _get(store, done_key) or b""   # the watermark as read (forged: rewritten)
    mark = seal.open(done_key, ours, _check_done) if ours else None
    done = mark["done"] if mark is not None else 0  # entries 1..done are all out
    end = min(count, done + _MAX_SCAN)
    if end < count:
        log.warning("the static ledger's counter %s reads %d, %d past the entries counted out: "
                    "looking at %d of them (was it moved by another writer of %s?)",
                    _key("count"), count, count - done, _MAX_SCAN, seal.where)
    grace: list[float] = []
    for slot in range(done + 1, end + 1):
        if not _is_out(store, slot, seal):
            entry = _entry(store, slot, seal, grace)
            if entry is not None and _listening(entry["address"]):
                _advance(store, seal, ours, done, slot - 1)
                return entry["name"]
            if count_out(store, slot, seal):
                log.info("static member %s (ledger entry %d) is gone: counted out",
                         entry["name"] if entry else "(never written, or forged)", slot)
    _advance(store, seal, ours, done, end)
    return None


def _advance(store: Any, seal: StoreSeal, ours: bytes, done: int, to: int) -> None:
    """Move the watermark from ``done`` (read as ``ours``) to ``to``: every entry up to
    it is out. Forward only, best effort: when another joiner moved it first, it stays."""
    if to > done:
        key = _key("done")
        store.compare_set(key, ours, seal.seal(key, {"done": to}))


def _check_done(value: Any) -> str | None:
    problem = expect(value, done=int)
    return problem if problem is not None or value["done"] >= 0 else "a negative watermark"


def _get(store: Any, key: str) -> bytes | None:
    return rendezvous.peek(store, key)


def _is_out(store: Any, slot: int, seal: StoreSeal) -> bool:
    """Whether entry ``slot`` was counted out (a marker that fails authentication is
    no marker: its seal warned)."""
    key = _key(slot, "out")
    raw = _get(store, key)
    return raw is not None and seal.open(key, raw, lambda v: expect(v, by=str)) is not None


def _entry(store: Any, slot: int, seal: StoreSeal, grace: list[float]) -> dict | None:
    """Ledger entry ``slot`` (None when it is never written within the grace, shared by
    every entry of one look in ``grace``, or fails authentication)."""
    key = _key(slot)
    while not store.check([key]):
        if not grace:
            grace.append(time.monotonic() + _MISSING_GRACE)
        if time.monotonic() >= grace[0]:
            return None
        time.sleep(0.05)
    raw = _get(store, key)
    return None if raw is None else seal.open(key, raw, rendezvous.check_pair)


def _listening(address: str) -> bool:
    """Whether a process listens on a transport address (``tcp://host:port#...``).
    Only a refused connection says no: a timeout or an unreachable host might be
    a live member behind a slow network, so it counts as live."""
    url = urlparse(address.split("#", 1)[0])
    if url.hostname is None or url.port is None:
        return True
    try:
        with socket.create_connection((url.hostname, url.port), timeout=_PROBE_TIMEOUT):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
