"""Dynamic groups: the member table a running group keeps in its store.

``init_rpc`` without ``world_size`` joins a dynamic group (torch's name for
it): the store holds one table, ``{rank: (name, address, incarnation)}`` with
the last incarnation given to every rank and a version. Every change is one
compare-and-set of the whole table on the version it read (:meth:`Group.update`):
a writer that was overtaken (a process paused between its read and its write,
SIGSTOP or a VM pause) fails its compare-and-set, reads again and redoes its
change, so no joiner is lost and no removed member comes back. No lock, no
clock. A joiner takes a rank (given, or the smallest free one with
incarnations left), checks its name is not taken, writes itself into the
table, then connects to every member listed. A member leaves by taking itself
out (``shutdown()``); one that crashed is taken out by the survivors that saw
it go (its incarnation must still be the one listed, so a replacement that
already joined under its rank is never removed).

A rank's incarnation counts its joins: a replacement is a new process with a
new incarnation, and nothing the old one sent or created is taken for the new
one's. Each incarnation numbers its ids in its own slice of the id counter
(:mod:`distgrad.ids`), so a rank has ``MAX_INCARNATIONS`` (256) of them on one
store: a join past them fails at once with IncarnationsExhaustedError
(``rank=None`` takes a rank with incarnations left).

Between taking its rank and publishing its address a joiner moves a lease
counter in the store (:class:`Lease`); a later joiner waits for every member's
address as long as its lease moves, and takes out one whose lease stood still
for ``JOIN_PATIENCE`` seconds (it died before publishing; should it wake up,
its publish fails).

A table that once existed is never deleted by distgrad, and it names its group:
a random ``genesis`` chosen by the joiner that made it, sealed in the table and in
a marker key written after it (``dyn/genesis``). So a missing table is tampering
whenever the marker, or a member that read the table before, says it existed; a
table of another genesis is another group's; and a joiner that takes a rank the
table says never had an incarnation while that rank's lease counter moved (its
holder is, or was, alive) has found a table deleted or rolled back. In each case
the joiner, or the member, refuses the table (StoreTamperedError naming the key
and the store, at its deadline) rather than start a group of its own on a live
member's rank. Every entry carries its process's random nonce, and a leave takes
out only the entry of the nonce it was given or saw (see :meth:`Group.leave`).
Only a store wiped of the table, the marker and the rank's lease (a fresh store
to whoever comes next) lets a joiner start a new group; the old group's members
then refuse the new table as another group's and take no one out of it.

The store must outlive every member: under torchrun the agent hosts it; with
``tcp://`` or ``env://`` rank 0 hosts it (and, as in torch, leaves last) unless
``DISTGRAD_STORE_HOSTED=1`` says a program of its own serves it (``distgrad
store --port P``); ``file://`` outlives everyone. Static and dynamic members
on one store are refused (torch's message): see :mod:`.mixing`.

Example::

    >>> group = Group(store)
    >>> rank, incarnation, others = group.join("trainer3", None)
    >>> with Lease(group, rank, time.monotonic() + 60):
    ...     group.publish(rank, incarnation, "tcp://10.0.0.5:41234#...")
    >>> group.leave(rank, incarnation)
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import DistgradError, IncarnationsExhaustedError, StoreTamperedError
from ..ids import INCARNATION_BITS, MAX_INCARNATIONS
from ..launch import rendezvous
from ..launch.sealed import StoreSeal, expect, is_int
from . import mixing
from .mixing import MIXED

log = logging.getLogger(__name__)
JOIN_PATIENCE = 10.0   # a joiner whose lease stood still this long died before publishing
LEASE_INTERVAL = 0.5   # how often a joiner moves its lease


class Table:
    """One version of the member table: ``members`` ``{rank: (name, address,
    incarnation)}``, ``nonces`` ``{rank: the member's random nonce}``, ``incarnations``
    ``{rank: the last incarnation given}``, ``genesis`` the random id of the group
    (None until the table is first written)."""

    __slots__ = ("version", "members", "incarnations", "genesis", "nonces")

    def __init__(self, version: int = 0, members: dict | None = None,
                 incarnations: dict | None = None, genesis: str | None = None,
                 nonces: dict | None = None) -> None:
        self.version = version
        self.members: dict[int, tuple[str, str, int]] = dict(members or {})
        self.incarnations: dict[int, int] = dict(incarnations or {})
        self.genesis = genesis
        self.nonces: dict[int, str] = dict(nonces or {})


def encode(table: Table, seal: StoreSeal, key: str) -> bytes:
    """The table as the store holds it under ``key``: sealed JSON (its format lives
    here and in :func:`decode`).

    Example::

        >>> raw = encode(Table(1, {0: ("a", "", 1)}, {0: 1}, "ab" * 16, {0: "cd" * 16}), seal, key)
        >>> decode(raw, seal, key).members
        {0: ('a', '', 1)}
    """
    return seal.seal(key, {"version": table.version, "genesis": table.genesis,
                           "members": [[r, n, a, i, table.nonces[r]]
                                       for r, (n, a, i) in sorted(table.members.items())],
                           "incarnations": sorted([r, i] for r, i in table.incarnations.items())})


def decode(raw: bytes, seal: StoreSeal, key: str) -> Table | None:
    """The table from the store's bytes under ``key`` (empty bytes: no table yet);
    None when it fails authentication (``seal`` warned and noted it). Raises
    ProtocolError when it is not a well-formed table.

    Example::

        >>> decode(b"", seal, key).version
        0
    """
    if not raw:
        return Table()
    value = seal.open(key, raw, _check_table)
    if value is None:
        return None
    return Table(value["version"], {r: (n, a, i) for r, n, a, i, _ in value["members"]},
                 dict(value["incarnations"]), value["genesis"],
                 {r: nonce for r, _, _, _, nonce in value["members"]})


def _is_token(value: Any) -> bool:
    """A random id as distgrad writes it: 32 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _check_table(value: Any) -> str | None:
    """What is wrong with a decoded table (None: nothing)."""
    if not (isinstance(value, dict)
            and set(value) == {"version", "genesis", "members", "incarnations"}):
        return "expected {'version', 'genesis', 'members', 'incarnations'}"
    if not is_int(value["version"], 1, 1 << 62):
        return f"bad version {value['version']!r}"
    if not _is_token(value["genesis"]):
        return f"bad genesis {value['genesis']!r:.80}"
    members, incarnations = value["members"], value["incarnations"]
    if not (isinstance(members, list) and isinstance(incarnations, list)):
        return "members and incarnations must be lists"
    ranks = set()
    for m in members:
        if not (isinstance(m, list) and len(m) == 5 and is_int(m[0], 0, 1 << 16)
                and isinstance(m[1], str) and isinstance(m[2], str)
                and is_int(m[3], 1, MAX_INCARNATIONS + 1) and _is_token(m[4])) or m[0] in ranks:
            return f"bad member entry {m!r:.80}"
        ranks.add(m[0])
    given = set()
    for e in incarnations:
        if not (isinstance(e, list) and len(e) == 2 and is_int(e[0], 0, 1 << 16)
                and is_int(e[1], 1, MAX_INCARNATIONS + 1)) or e[0] in given:
            return f"bad incarnation entry {e!r:.80}"
        given.add(e[0])
    return None


def check_static_join(store: Any, name: str, seal: StoreSeal | None = None) -> None:
    """A static member may not join a store where a dynamic group runs (torch's message).
    A table that fails authentication is ignored (its seal warned)."""
    try:
        members = Group(store, seal=seal).members()
    except StoreTamperedError:
        members = {}
    mixing.check_static_join(store, name, members)


def _check_marker(value: Any) -> str | None:
    problem = expect(value, genesis=str)
    if problem is None and not _is_token(value["genesis"]):
        problem = f"bad genesis {value['genesis']!r:.80}"
    return problem


class _Taken(Exception):
    pass


class _Again(Exception):
    """The table changed under a check that read another key: read it again."""


class Group:
    """One dynamic group's table in ``store`` (see the module docstring).

    Example::

        >>> group = Group(store, timeout=60.0)
        >>> rank, incarnation, others = group.join("trainer3", None)
        >>> group.leave(rank, incarnation)
        True
    """

    def __init__(self, store: Any, timeout: float = 60.0, seal: StoreSeal | None = None) -> None:
        self.raw = store
        self.root = mixing.root()
        self.key = self.root + "dyn/members"
        self.marker = self.root + "dyn/genesis"   # written once the table exists: it did
        self.timeout = timeout
        self.seal = seal if seal is not None else rendezvous.store_seal(store)
        self.high = 0   # the highest version read: a lower one is a rollback
        self.high_raw = b""   # its bytes: the same version with other bytes is a fork
        self.genesis: str | None = None   # the group's id, once a table was read or made
        self.nonces: dict[tuple[int, int], str] = {}   # (rank, incarnation) -> nonce first seen

    def _load(self) -> tuple[bytes, Table | None]:
        """The table's bytes and the table (None when it cannot be trusted: it failed
        authentication, is older than one read before, is another group's, or is gone
        while the marker or an earlier read says it existed). Version 0: no table yet."""
        raw = rendezvous.peek(self.raw, self.key) or b""
        if not raw:
            if self.genesis is not None:
                return raw, self.seal.reject(self.key, f"deleted after version {self.high} was read")
            made = self._made()
            if made is None:
                return raw, Table()
            # the table is written before the marker: read it again, it may have come since
            raw = rendezvous.peek(self.raw, self.key) or b""
            if not raw:
                return raw, self.seal.reject(self.key, f"deleted: {self.marker} says the group's "
                                                       f"table was made (genesis {made[:8]}...)")
        table = decode(raw, self.seal, self.key)
        if table is None:
            return raw, None
        if self.genesis is None:
            problem = self._adopt(table.genesis)
            if problem is not None:
                return raw, self.seal.reject(self.key, problem)
        elif table.genesis != self.genesis:
            return raw, self.seal.reject(self.key, f"another group's table (genesis "
                                                   f"{table.genesis[:8]}...) replaced this group's "
                                                   f"(genesis {self.genesis[:8]}...): deleted and made "
                                                   "again")
        if table.version < self.high:
            return raw, self.seal.reject(self.key, f"rolled back to version {table.version} after "
                                                   f"version {self.high} was read")
        if table.version == self.high and raw != self.high_raw:
            # a joiner fed an older table (replayed) wrote its next version over ours
            return raw, self.seal.reject(self.key, f"two different tables of version "
                                                   f"{table.version}: an older one was replayed "
                                                   "and written over")
        self._high(table.version, raw)
        self._saw(table)
        return raw, table

    def _high(self, version: int, raw: bytes) -> None:
        if version > self.high:
            self.high, self.high_raw = version, raw

    def _made(self) -> str | None:
        """The genesis the marker names (the group's table was made), else None (no
        marker, or one that fails authentication: ignored, as every such entry)."""
        raw = rendezvous.peek(self.raw, self.marker)
        value = None if raw is None else self.seal.open(self.marker, raw, _check_marker)
        return None if value is None else value["genesis"]

    def _adopt(self, genesis: str) -> str | None:
        """This Group's first table: its genesis must be the marker's (a marker that is
        missing or fails authentication is written again from the sealed table: a
        joiner that made the table may have died before writing it). Returns what is
        wrong (None: adopted)."""
        raw = rendezvous.peek(self.raw, self.marker)
        value = None if raw is None else self.seal.open(self.marker, raw, _check_marker)
        if value is None:
            self._mark(genesis, raw or b"")
        elif value["genesis"] != genesis:
            return (f"another group's table (genesis {genesis[:8]}...): {self.marker} names genesis "
                    f"{value['genesis'][:8]}...")
        self.genesis = genesis
        return None

    def _mark(self, genesis: str, expected: bytes = b"") -> None:
        self.raw.compare_set(self.marker, expected, self.seal.seal(self.marker, {"genesis": genesis}))

    def _saw(self, table: Table) -> None:
        for r, (_, _, inc) in table.members.items():
            self.nonces.setdefault((r, inc), table.nonces[r])

    def _unusable(self, what: str) -> StoreTamperedError:
        return self.seal.tampered_error(what, {self.key: self.seal.tampered.get(self.key, "unusable")})

    def members(self) -> dict[int, tuple[str, str, int]]:
        """The table now: ``{rank: (name, address, incarnation)}``. Raises
        StoreTamperedError when the table cannot be trusted."""
        table = self._load()[1]
        if table is None:
            raise self._unusable("the dynamic group's member table cannot be used")
        return table.members

    def update(self, change: Callable[[Table], Any]) -> Any:
        """Change the table as one compare-and-set on the version read; returns what
        ``change`` returns. ``change`` edits the table it is given (or raises to
        refuse); when another writer got in first it runs again on the new table.
        Nothing is written when it changed nothing. A table that cannot be trusted
        (see :meth:`_load`) is waited on until the deadline: StoreTamperedError."""
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while True:
            raw, table = self._load()
            if table is not None:
                try:
                    done, result = self._change(raw, table, change)
                except _Again:
                    done = False
                if done:
                    return result
            if time.monotonic() > deadline:
                if table is None:
                    raise self._unusable(f"could not change the dynamic group's table for "
                                         f"{self.timeout:.0f} s")
                raise DistgradError(f"could not change the dynamic group's table in the store for "
                                    f"{self.timeout:.0f} s: other writers kept changing it first")
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(pause * 2, 0.05)

    def _change(self, raw: bytes, table: Table, change: Callable[[Table], Any]) -> tuple[bool, Any]:
        """One try of :meth:`update` on ``table`` (read as ``raw``): (whether it is done,
        what ``change`` returned)."""
        members, incarnations = dict(table.members), dict(table.incarnations)
        result = change(table)
        if table.members == members and table.incarnations == incarnations:
            return True, result
        fresh = table.genesis is None
        if fresh:   # the first table on this store (and attempt): a new group
            table.genesis = os.urandom(16).hex()
        table.version += 1
        new = encode(table, self.seal, self.key)
        if self.raw.compare_set(self.key, raw, new) != new:
            return False, None
        if fresh:
            self.genesis = table.genesis
            self._mark(table.genesis)
        self._high(table.version, new)
        self._saw(table)
        return True, result

    def join(self, name: str, rank: int | None, wait: float = 0.0) -> tuple[int, int, dict]:
        """Enter the table (with no address yet: see :meth:`publish`); returns
        ``(rank, incarnation, the other members)``.

        Raises RuntimeError with torch's message when a static group runs on this
        store, or when the name or the rank is taken by a member; and
        IncarnationsExhaustedError when the rank had ``MAX_INCARNATIONS`` already.
        A name or rank taken is waited for up to ``wait`` seconds first: a
        replacement may start before the survivors took the crashed member it
        replaces out."""
        deadline = time.monotonic() + wait
        nonce = os.urandom(16).hex()

        def enter(table: Table) -> tuple[int, int, dict]:
            got = _enter(table, name, rank, nonce)
            if got[1] == 1:
                self._check_first(table, got[0])
            return got

        while True:
            try:
                got, incarnation, others = self.update(enter)
                break
            except _Taken as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(str(e)) from None
                time.sleep(0.05)
        # checked once listed: a static member checks the table once in the ledger
        static = mixing.live_static_member(self.raw, self.seal)
        if static is not None:
            self.leave(got, incarnation)
            raise RuntimeError(f"{MIXED} (worker {name!r} has no world_size; static member "
                               f"{static!r} runs on this store)")
        return got, incarnation, others

    def publish(self, rank: int, incarnation: int, address: str) -> None:
        """Give this member's entry the address the others connect to."""
        nonce = self.nonces.get((rank, incarnation))

        def change(table: Table) -> None:
            entry = table.members.get(rank)
            if entry is None or entry[2] != incarnation or nonce not in (None, table.nonces[rank]):
                raise DistgradError(f"rank {rank} (incarnation {incarnation}) was taken out of the "
                                    "dynamic group while it joined: a later joiner saw no sign of "
                                    f"life from it for {JOIN_PATIENCE:.0f} s")
            table.members[rank] = (entry[0], address, incarnation)
        self.update(change)

    def lease_value(self, rank: int) -> int:
        """The lease counter of ``rank`` (see :class:`Lease`)."""
        return rendezvous.counter(self.raw, f"{self.root}dyn/lease/{rank}", 0)

    def addresses(self, others: dict, deadline: float,
                  patience: float | None = None) -> dict[int, tuple[str, str, int]]:
        """The entries of ``others`` once each has an address (a member that joins at
        the same time publishes it a moment later); those that left are dropped. One
        whose lease (:class:`Lease`) stood still for ``patience`` seconds
        (``JOIN_PATIENCE``) died between taking its rank and listening: it is taken
        out of the table and skipped. A live one is waited for until ``deadline``
        (then DistgradError naming it)."""
        patience = JOIN_PATIENCE if patience is None else patience
        seen: dict[int, tuple[int, float]] = {}  # rank -> (lease value, when it last moved)
        pause = 0.002
        while True:
            table = self._load()[1]
            if table is None:  # tampered with: wait for the deadline (StoreTamperedError)
                if time.monotonic() >= deadline:
                    raise self._unusable("members' addresses could not be read")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            ready = {r: e for r, e in table.members.items() if r in others and e[2] == others[r][2]}
            waiting = [r for r, e in ready.items() if not e[1]]
            if not waiting:
                return ready
            now = time.monotonic()
            for r in waiting:
                beat, last = self.lease_value(r), seen.get(r)
                if last is None or beat != last[0]:
                    seen[r] = (beat, now)
                elif now - last[1] >= patience and self.leave(r, ready[r][2]):
                    log.warning("member %s (rank %d) of the dynamic group showed no sign of life "
                                "for %.0f s without publishing its address: taken out",
                                ready[r][0], r, patience)
            if now >= deadline:
                raise DistgradError(f"members {sorted(ready[r][0] for r in waiting)} of the dynamic "
                                    "group are still joining (alive, without an address) at the "
                                    "deadline of this join")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def leave(self, rank: int, incarnation: int, nonce: str | None = None) -> bool:
        """Take ``rank`` out if its entry is still the process of incarnation
        ``incarnation`` and nonce ``nonce`` (None: the nonce this Group saw that
        entry with, or wrote it with; never seen: any); returns whether it was there.
        Another process listed under the same rank and incarnation (a table deleted or
        rolled back, then joined again) is left alone.

        Example::

            >>> rank, incarnation, _ = group.join("trainer3", None)
            >>> group.leave(rank, incarnation), group.leave(rank, incarnation)
            (True, False)
        """
        nonce = nonce if nonce is not None else self.nonces.get((rank, incarnation))

        def change(table: Table) -> bool:
            entry = table.members.get(rank)
            if entry is None or entry[2] != incarnation or nonce not in (None, table.nonces[rank]):
                return False
            del table.members[rank]
            del table.nonces[rank]
            return True
        return self.update(change)

    def _check_first(self, table: Table, rank: int) -> None:
        """A joiner takes ``rank`` for its first incarnation: the table says nobody
        held it. Its lease counter says whether someone did (it moves from the join on):
        if it moved, the table was deleted or rolled back (or the counter moved by
        another writer), and joining would put this process on a live member's rank."""
        moved = self.lease_value(rank)
        if moved <= 0:
            return
        now = rendezvous.peek(self.raw, self.key)
        again = decode(now, self.seal, self.key) if now else Table()
        if again is None or again.version != table.version:
            raise _Again()   # another joiner took the rank meanwhile (then moved its lease)
        self.seal.reject(self.key, f"deleted or rolled back: it gives rank {rank} no incarnation "
                                   f"yet, but that rank's lease {self.root}dyn/lease/{rank} moved "
                                   f"({moved}): a process held rank {rank} (or another writer "
                                   "moved the counter)")
        raise self._unusable(f"cannot join the dynamic group as rank {rank}")

    def entry(self, rank: int) -> tuple[str, str, int] | None:
        """What the table lists under ``rank`` (None when nobody, or when the table
        cannot be trusted)."""
        table = self._load()[1]
        return None if table is None else table.members.get(rank)

    def wait_empty(self, but: int, deadline: float, lost: Any = (), linger: float | None = None) -> bool:
        """Wait until no member but ``but`` (and those in ``lost``) is listed, and none
        came for ``linger`` seconds (``DISTGRAD_STORE_LINGER``, 5 s by default): the
        store's host leaves last, and members still on their way cannot be known.
        False at the deadline."""
        if linger is None:
            linger = float(os.environ.get("DISTGRAD_STORE_LINGER", "5"))
        pause, quiet_since = 0.005, None
        while True:
            try:
                left = set(self.members()) - {but} - set(lost)
            except StoreTamperedError:
                left = {-1}   # unknown: as if someone were still listed
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


def _enter(table: Table, name: str, rank: int | None, nonce: str) -> tuple[int, int, dict]:
    """The change of a join (see :meth:`Group.join`)."""
    for r, (n, _, _) in table.members.items():
        if n == name:
            raise _Taken(f"RPC worker name {name} is not unique. Workers {r} and "
                         f"{rank if rank is not None else '(new)'} share the same name.")
    if rank is None:
        rank = next((r for r in range(1 << 16) if r not in table.members
                     and table.incarnations.get(r, 0) < MAX_INCARNATIONS), None)
        if rank is None:
            raise IncarnationsExhaustedError(
                f"worker {name!r} cannot join the dynamic group: every rank had "
                f"{MAX_INCARNATIONS} incarnations on this store; start the group on a fresh store",
                name, -1, MAX_INCARNATIONS)
    elif not 0 <= rank < (1 << 16):
        raise ValueError(f"rank {rank} does not fit in 16 bits")
    elif rank in table.members:
        raise _Taken(f"rank {rank} of the dynamic group is taken by worker "
                     f"{table.members[rank][0]!r}; worker {name!r} cannot join under it")
    elif table.incarnations.get(rank, 0) >= MAX_INCARNATIONS:
        raise IncarnationsExhaustedError(
            f"worker {name!r} cannot join the dynamic group as rank {rank}: that rank already had "
            f"{MAX_INCARNATIONS} incarnations (processes that held it one after another) on this "
            f"store, as many as distributed ids can tell apart ({INCARNATION_BITS} bits of their "
            "48-bit counter). Join under another rank (rank=None takes a free rank with "
            "incarnations left), or start the group on a fresh store (a new file:// path, a "
            "restarted `distgrad store`)", name, rank, MAX_INCARNATIONS)
    incarnation = table.incarnations.get(rank, 0) + 1
    table.incarnations[rank] = incarnation
    others = dict(table.members)
    table.members[rank] = (name, "", incarnation)
    table.nonces[rank] = nonce
    return rank, incarnation, others


class Lease:
    """A joiner's sign of life from taking its rank until it published its address:
    a counter in the store it moves every ``LEASE_INTERVAL`` seconds, on a thread of
    its own, until ``until`` at most (see :meth:`Group.addresses`). A context manager.

    Example::

        >>> with Lease(group, rank, time.monotonic() + 60):
        ...     group.publish(rank, incarnation, transport.listen(host))
    """

    def __init__(self, group: Group, rank: int, until: float) -> None:
        self.key = f"{group.root}dyn/lease/{rank}"
        self.store, self.until = group.raw, until
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"distgrad-lease-{rank}", daemon=True)

    def _run(self) -> None:
        while time.monotonic() < self.until:
            try:
                rendezvous.counter(self.store, self.key, 1)
            except Exception as e:  # noqa: BLE001 - the join itself fails on a store that is gone
                log.warning("could not move the join lease: %s", e)
                return
            if self.stop.wait(LEASE_INTERVAL):
                return

    def __enter__(self) -> Lease:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def hosted_elsewhere() -> bool:
    """``DISTGRAD_STORE_HOSTED=1``: a program of its own serves the store (rank 0 is a client)."""
    return os.environ.get("DISTGRAD_STORE_HOSTED", "0") == "1"


def serve_store(host: str, port: int):
    """Host a TCPStore that outlives every member (``distgrad store``), listening on
    ``host`` alone (:mod:`distgrad.launch.listen`) through a front that caps its
    connections (:func:`distgrad.launch.keeper.serve_here`). Returns the store (its
    server's own, on loopback); it serves until this process exits.

    Example::

        >>> store = serve_store("0.0.0.0", 29500)   # then: DISTGRAD_STORE_HOSTED=1 on every worker
        >>> store.set("k", b"v")
    """
    from ..launch.keeper import serve_here
    return serve_here(host, port).server
