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
import pickle
import socket
import time
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported."
_MISSING_GRACE = 2.0  # an entry numbered but never written: its writer died in between
_PROBE_TIMEOUT = 2.0


def root(attempt: str | None = None) -> str:
    """The store prefix of this torchrun attempt (``distgrad/<restart count>/``)."""
    return f"distgrad/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') if attempt is None else attempt}/"


def _key(*parts: Any) -> str:
    return root() + "static/" + "/".join(str(p) for p in parts)


def count_in(store: Any, name: str, address: str) -> int:
    """Enter the ledger as a live static member listening on ``address``; returns
    the slot to :func:`count_out` with."""
    slot = int(store.add(_key("count"), 1))
    store.set(_key(slot), pickle.dumps((name, address)))
    return slot


def count_out(store: Any, slot: int) -> bool:
    """Mark ledger entry ``slot`` gone; True when this call did (once per entry)."""
    token = f"{os.getpid()}:{os.urandom(6).hex()}".encode()
    return store.compare_set(_key(slot, "out"), "", token) == token


def check_static_join(store: Any, name: str, table: dict) -> None:
    """A static member may not join a store where a dynamic group runs: RuntimeError
    with torch's message (``table``: the dynamic group's members, see membership)."""
    if table:
        raise RuntimeError(f"{MIXED} (worker {name!r} has world_size set; the dynamic group on "
                           f"this store has {sorted(n for n, _, _ in table.values())})")


def live_static_member(store: Any) -> str | None:
    """The name of a static member that may still live on this store (None when
    none): entries whose address refuses a connection, or that were never written,
    are marked out here (see the module docstring)."""
    count = int(store.add(_key("count"), 0))
    done_raw = store.get(_key("done")) if store.check([_key("done")]) else b""
    done = int(done_raw or 0)  # entries 1..done are all out (a watermark, moved forward only)
    for slot in range(done + 1, count + 1):
        if not store.check([_key(slot, "out")]):
            entry = _entry(store, slot)
            if entry is not None and _listening(entry[1]):
                return entry[0]
            if count_out(store, slot):
                log.info("static member %s (ledger entry %d) is gone: counted out",
                         entry[0] if entry else "(never written)", slot)
        # every entry up to slot is out; best effort (another joiner may move it first)
        store.compare_set(_key("done"), str(done) if done else "", str(slot))
        done = slot
    return None


def _entry(store: Any, slot: int) -> tuple[str, str] | None:
    deadline = time.monotonic() + _MISSING_GRACE
    while not store.check([_key(slot)]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return pickle.loads(store.get(_key(slot)))


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
