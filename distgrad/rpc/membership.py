"""Dynamic groups: the member table a running group keeps in its store.

``init_rpc`` without ``world_size`` joins a dynamic group (torch's name for
it): the store holds one table, ``{rank: (name, address, incarnation)}``,
changed only under a lock in the same store. A joiner takes a rank (given, or
the smallest free one), checks its name is not taken, writes itself into the
table, then connects to every member listed. A member leaves by taking itself
out (``shutdown()``); one that crashed is taken out by the survivors that saw
it go (its incarnation must still be the one listed, so a replacement that
already joined under its rank is never removed). A rank's incarnation counts
its joins: a replacement is a new process with a new incarnation, and nothing
the old one sent or created is taken for the new one's (see
:mod:`.lifecycle`).

The store must outlive every member: under torchrun the agent hosts it; with
``tcp://`` or ``env://`` rank 0 hosts it (and, as in torch, leaves last) unless
``DISTGRAD_STORE_HOSTED=1`` says a program of its own serves it (``distgrad
store --port P``); ``file://`` outlives everyone.

Example::

    >>> group = Group(store)
    >>> rank, incarnation, others = group.join("trainer3", None)
    >>> group.publish(rank, incarnation, "tcp://10.0.0.5:41234#...")
    >>> group.leave(rank, incarnation)
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import DistgradError

log = logging.getLogger(__name__)
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported."
_LOCK_STALE = 30.0  # a lock older than this was held by a process that died


def _root(attempt: str | None = None) -> str:
    return f"distgrad/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') if attempt is None else attempt}/"


def static_key() -> str:
    """The counter of live members of static groups on a store (see :func:`check_static_join`)."""
    return _root() + "static_live"


def check_static_join(store: Any, name: str) -> None:
    """A static member may not join a store where a dynamic group runs (torch's message)."""
    table = _read(store, _root() + "dyn/members")
    if table:
        raise RuntimeError(f"{MIXED} (worker {name!r} has world_size set; the dynamic group on "
                           f"this store has {sorted(n for n, _, _ in table.values())})")


def _read(store: Any, key: str) -> dict:
    if not store.check([key]):
        return {}
    raw = store.get(key)
    return pickle.loads(raw) if raw else {}


class _Taken(Exception):
    pass


class Group:
    """One dynamic group's table in ``store`` (see the module docstring)."""

    def __init__(self, store: Any, timeout: float = 60.0) -> None:
        self.raw = store
        self.root = _root()
        self.timeout = timeout

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the table's lock (compare-and-set in the store; a holder that died
        is overtaken after 30 s)."""
        key = self.root + "dyn/lock"
        token = f"{os.getpid()}:{os.urandom(4).hex()}:{time.time():.3f}".encode()
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            held = self.raw.compare_set(key, "", token)
            if held == token:
                break
            try:
                since = float(held.decode().rsplit(":", 1)[1])
            except (ValueError, IndexError):
                since = time.time()
            if time.time() - since > _LOCK_STALE and self.raw.compare_set(key, held, token) == token:
                break
            if time.monotonic() > deadline:
                raise DistgradError(f"the dynamic group's lock in the store was held for more than "
                                    f"{self.timeout:.0f} s by {held.decode(errors='replace')}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        try:
            yield
        finally:
            self.raw.compare_set(key, token, "")

    def members(self) -> dict[int, tuple[str, str, int]]:
        """The table now: ``{rank: (name, address, incarnation)}``."""
        return _read(self.raw, self.root + "dyn/members")

    def _write(self, table: dict) -> None:
        self.raw.set(self.root + "dyn/members", pickle.dumps(table))

    def join(self, name: str, rank: int | None, wait: float = 0.0) -> tuple[int, int, dict]:
        """Enter the table (with no address yet: see :meth:`publish`); returns
        ``(rank, incarnation, the other members)``.

        Raises RuntimeError with torch's message when a static group runs on this
        store, or when the name or the rank is taken by a member. A name or rank
        taken is waited for up to ``wait`` seconds first: a replacement may start
        before the survivors took the crashed member it replaces out."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._join(name, rank)
            except _Taken as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(str(e)) from None
                time.sleep(0.05)

    def _join(self, name: str, rank: int | None) -> tuple[int, int, dict]:
        with self.locked():
            if int(self.raw.add(static_key(), 0)) > 0:
                raise RuntimeError(f"{MIXED} (worker {name!r} has no world_size; a static group "
                                   "runs on this store)")
            table = self.members()
            for r, (n, _, _) in table.items():
                if n == name:
                    raise _Taken(f"RPC worker name {name} is not unique. Workers {r} and "
                                       f"{rank if rank is not None else '(new)'} share the same name.")
            if rank is None:
                rank = next(r for r in range(len(table) + 1) if r not in table)
            elif rank in table:
                raise _Taken(f"rank {rank} of the dynamic group is taken by worker "
                                   f"{table[rank][0]!r}; worker {name!r} cannot join under it")
            if not 0 <= rank < (1 << 16):
                raise ValueError(f"rank {rank} does not fit in 16 bits")
            incarnation = int(self.raw.add(f"{self.root}dyn/incarnation/{rank}", 1))
            others = dict(table)
            table[rank] = (name, "", incarnation)
            self._write(table)
        return rank, incarnation, others

    def publish(self, rank: int, incarnation: int, address: str) -> None:
        """Give this member's entry the address the others connect to."""
        with self.locked():
            table = self.members()
            name, _, inc = table[rank]
            if inc != incarnation:
                raise DistgradError(f"worker {name!r} was taken out of the group while it joined")
            table[rank] = (name, address, inc)
            self._write(table)

    def addresses(self, others: dict, deadline: float,
                  patience: float = 10.0) -> dict[int, tuple[str, str, int]]:
        """The entries of ``others`` once each has an address (a member that joins
        at the same time publishes it a moment later); those that left are dropped,
        and so are those still without one after ``patience`` seconds (a joiner that
        died between taking its rank and listening: it never connected to anyone)."""
        pause, start = 0.002, time.monotonic()
        while True:
            table = self.members()
            ready = {r: e for r, e in table.items() if r in others and e[2] == others[r][2]}
            if all(e[1] for e in ready.values()):
                return ready
            if time.monotonic() - start >= patience or time.monotonic() >= deadline:
                silent = sorted(e[0] for e in ready.values() if not e[1])
                log.warning("members %s of the dynamic group never published their address: "
                            "joining without them", silent)
                return {r: e for r, e in ready.items() if e[1]}
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def leave(self, rank: int, incarnation: int) -> bool:
        """Take ``rank`` out if its incarnation is still ``incarnation``; returns
        whether it was there."""
        with self.locked():
            table = self.members()
            entry = table.get(rank)
            if entry is None or entry[2] != incarnation:
                return False
            del table[rank]
            self._write(table)
            return True

    def entry(self, rank: int) -> tuple[str, str, int] | None:
        """What the table lists under ``rank`` (None when nobody)."""
        return self.members().get(rank)

    def wait_empty(self, but: int, deadline: float, lost: Any = (), linger: float | None = None) -> bool:
        """Wait until no member but ``but`` (and those in ``lost``) is listed, and none
        came for ``linger`` seconds (``DISTGRAD_STORE_LINGER``, 5 s by default): the
        store's host leaves last, and members still on their way cannot be known.
        False at the deadline."""
        if linger is None:
            linger = float(os.environ.get("DISTGRAD_STORE_LINGER", "5"))
        pause, quiet_since = 0.005, None
        while True:
            left = set(self.members()) - {but} - set(lost)
            now = time.monotonic()
            if left:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            if quiet_since is not None and now - quiet_since >= linger:
                return True
            if now >= deadline:
                return not left
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)


def hosted_elsewhere() -> bool:
    """``DISTGRAD_STORE_HOSTED=1``: a program of its own serves the store (rank 0 is a client)."""
    return os.environ.get("DISTGRAD_STORE_HOSTED", "0") == "1"


def serve_store(host: str, port: int) -> dist.TCPStore:
    """Host a TCPStore that outlives every member (``distgrad store``).

    Example::

        >>> store = serve_store("0.0.0.0", 29500)   # then: DISTGRAD_STORE_HOSTED=1 on every worker
    """
    return dist.TCPStore(host, port, None, is_master=True, timeout=timedelta(seconds=60),
                         wait_for_workers=False)
