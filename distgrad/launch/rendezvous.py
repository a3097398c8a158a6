"""Rendezvous on torch.distributed stores: env://, tcp://host:port, file://path.

Each worker publishes its name and listening address under its rank, then
reads everyone else's. The same store later serves the shutdown barrier.

The store is shared as torch shares it: rank 0 opens its TCPStore with
``multi_tenant=True``, so a gloo process group on the same MASTER_ADDR/PORT in
this process (before or after init_rpc) uses the same server, which lives as
long as either still holds it; under torchrun (TORCHELASTIC_USE_AGENT_STORE)
the agent hosts the store and every rank connects as a client. Each init_rpc
works in its own namespace of the store (:func:`session`), so neither a
process group's keys nor an earlier init_rpc's on a store that outlived it
are ever read.
"""
from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from ..errors import DistgradError
from ..safe_files import resolve_dir
from ..transport.auth import secret_from_env
from . import keeper
from .listen import host_store
from .sealed import StoreSeal, expect

_PREFIX = "distgrad/"


def resolve(init_method: str, rank: int | None, world_size: int | None) -> tuple[str, int | None, int | None]:
    """Fill rank and world size from the environment for ``env://``; returns
    ``(init_method, rank, world_size)`` or raises ValueError naming what is missing.

    ``world_size`` None (and, for ``env://``, no WORLD_SIZE in the environment)
    means a dynamic group, as in torch; there ``rank`` None asks the group for
    the smallest free rank.

    Example::

        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="1", WORLD_SIZE="2")
        >>> resolve("env://", -1, None)
        ('env://', 1, 2)
    """
    scheme = urlparse(init_method).scheme
    if scheme not in ("env", "tcp", "file"):
        raise ValueError(f"init_method must be env://, tcp://host:port or file://path, got {init_method!r}")
    if scheme == "env":
        if rank is not None and rank < 0:
            rank = _env_int("RANK")
        if world_size is None and "WORLD_SIZE" in os.environ:
            world_size = _env_int("WORLD_SIZE")
    if world_size is None:  # a dynamic group
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be given (>= 0, or None to be given one) for a dynamic "
                             f"group, got {rank!r}")
        return init_method, rank, None
    if rank is None or rank < 0:
        raise ValueError(f"rank must be given (>= 0) for init_method {init_method!r}, got {rank!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if rank >= world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    return init_method, rank, world_size


def _env_int(var: str) -> int:
    value = os.environ.get(var)
    if value is None:
        raise ValueError(f"init_method env:// needs {var} in the environment (or pass it to init_rpc)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {var}={value!r} is not an integer") from None


def master_host(init_method: str) -> str | None:
    """The host workers rendezvous on (a sensible default interface to listen on)."""
    url = urlparse(init_method)
    if url.scheme == "env":
        return os.environ.get("MASTER_ADDR")
    if url.scheme == "tcp":
        return url.hostname
    return None


def make_store(init_method: str, rank: int | None, world_size: int | None, timeout: float,
               name: str | None = None) -> dist.Store:
    """A store every worker of this cluster reaches, opened as torch's own
    rendezvous opens it: for tcp/env rank 0 hosts it, shared (``multi_tenant``)
    with any other store this process opens on the same port, and under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the agent's.

    Raises DistgradError naming the address when the store cannot be opened
    (e.g. another program holds the port).

    Example::

        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        >>> store = make_store("env://", 0, 2, 60.0, name="worker0")
    """
    url = urlparse(init_method)
    td = timedelta(seconds=timeout)
    if url.scheme == "file":
        path = url.path if not url.netloc else url.netloc + url.path
        return dist.FileStore(own_store_file(path), world_size if world_size is not None else -1)
    if url.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("init_method env:// needs MASTER_ADDR and MASTER_PORT in the environment")
    else:
        host, port = url.hostname, url.port
        if not host or not port:
            raise ValueError(f"init_method {init_method!r} must name host and port")
    host_it = hosts_store(init_method, rank, world_size)
    try:
        if host_it:   # on the address named, not torch's wildcard (see .listen), in a
            # process of its own that a crowd of connections cannot starve (.keeper)
            return host_store(host, int(port), world_size, td, multi_tenant=True,
                              own_process=keeper.wanted())
        return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=td,
                             wait_for_workers=False)
    except dist.DistError as e:
        raise _store_error(name, rank, host, int(port), host_it, e) from e


def own_store_file(path: str) -> str:
    """``path`` once it is safe to use as a ``file://`` store: a regular file of
    this user that no one else can write (created here 0600, never through a
    link; one of ours that others could only read is made 0600; never one with
    another hard link), in a directory
    where others cannot swap it: it and every directory above it belong to this
    user or root and no one else can write them, unless sticky (as OpenSSH checks
    ``~/.ssh``), every link on the way this user's or root's
    (:func:`distgrad.safe_files.resolve_dir`; the path returned has them resolved,
    so torch, which reopens it at every operation, follows none). Raises
    DistgradError saying what is wrong."""
    path = os.path.abspath(path)
    problem, real = resolve_dir(os.path.dirname(path))
    if problem is not None:   # torch reopens the path at every operation: no one may swap it
        raise DistgradError(f"file:// store {path}: {problem} (another user could plant or swap "
                            "the file); use a directory that only you (or root) can write, all "
                            "the way up")
    path = os.path.join(real, os.path.basename(path))   # torch gets no link to follow later
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
            os.close(fd)
            return path
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | nofollow)
        except FileNotFoundError:
            continue  # removed in between: create it
        except OSError as e:
            raise DistgradError(f"file:// store {path}: cannot open it safely (a symbolic link?): "
                                f"{e}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022 \
                    and st.st_mode & 0o044 and st.st_nlink == 1:
                os.fchmod(fd, 0o600)  # ours, but readable by others (torch makes it 0644)
                st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DistgradError(f"file:// store {path} is not a regular file")
        if st.st_nlink != 1:
            raise DistgradError(f"file:// store {path} has {st.st_nlink} hard links: it is also "
                                "another file (one a link planted here names), which the store "
                                "would write into; remove it or use another path")
        if st.st_uid != os.geteuid():
            raise DistgradError(f"file:// store {path} belongs to another user (uid {st.st_uid}): "
                                "refusing a store someone else planted; remove it or use another path")
        if st.st_mode & 0o077:
            raise DistgradError(f"file:// store {path} is writable by others (mode "
                                f"{stat.S_IMODE(st.st_mode):o}): someone else may have planted or "
                                "changed it; remove it, or chmod 600 it, or use a new path")
        return path


def hosts_store(init_method: str, rank: int | None, world_size: int | None) -> bool:
    """Whether this worker hosts the rendezvous store: rank 0 for tcp:// and env://,
    unless torchrun's agent serves it, or (a dynamic group) DISTGRAD_STORE_HOSTED=1
    says a program of its own does (``distgrad store``).

    Example::

        >>> hosts_store("tcp://127.0.0.1:29500", 0, 2), hosts_store("file:///tmp/s", 0, 2)
        (True, False)
    """
    url = urlparse(init_method)
    if url.scheme == "file" or rank != 0:
        return False
    port = os.environ.get("MASTER_PORT") if url.scheme == "env" else url.port
    if port is None or agent_hosts_store(int(port)):
        return False
    return not (world_size is None and os.environ.get("DISTGRAD_STORE_HOSTED", "0") == "1")


def agent_hosts_store(port: int) -> bool:
    """True when torchrun's agent serves the store on ``port``: it sets
    ``TORCHELASTIC_USE_AGENT_STORE=True`` and hosts it on MASTER_PORT, where no
    rank may host one. (A tcp:// address on another port is still rank 0's.)

    Example::

        >>> os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_PORT="29500")
        >>> agent_hosts_store(29500), agent_hosts_store(29501)
        (True, False)
    """
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("MASTER_PORT") == str(port))


def _store_error(name: str | None, rank: int, host: str, port: int, host_it: bool,
                 cause: Exception) -> DistgradError:
    who = f"worker {name!r} (rank {rank})" if name else f"rank {rank}"
    if host_it and "EADDRINUSE" in str(cause):
        what = (f"cannot host the rendezvous store on {host}:{port}: the port is held by "
                "another program, or by a store this process opened without multi_tenant=True "
                "(stores opened by torch's or distgrad's rendezvous share it); choose a free "
                "MASTER_PORT")
    elif host_it:
        what = f"cannot host the rendezvous store on {host}:{port}: {cause}"
    else:
        what = (f"cannot reach a torch.distributed store at {host}:{port} (is rank 0 or the "
                f"torchrun agent serving there, and is that port a store?): {cause}")
    return DistgradError(f"rendezvous of {who} failed: {what}", name)


def session(store: dist.Store, rank: int) -> tuple[dist.Store, str]:
    """This init_rpc's own namespace in ``store``: ``distgrad/<attempt>.<n>/``;
    returns the prefixed store and its prefix.

    ``n`` counts this rank's joins on the store (every rank counts the same: the
    workers init and shut down together) and ``attempt`` is torchrun's restart
    count, so a store that outlives an init_rpc (shared with a process group,
    or torchrun's agent store) never serves its keys to the next one. ``n`` is a
    counter anyone who reaches the store may move: a wrong one puts ranks in
    different namespaces, so at worst the rendezvous times out.

    Example::

        >>> s, prefix = session(store, rank=0)   # first init_rpc on this store
        >>> s.set("worker/0", b"...")            # key distgrad/0.1/worker/0 in store
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    n = counter(store, f"{_PREFIX}{attempt}/joins/{rank}", 1)
    prefix = f"{_PREFIX}{attempt}.{n}"
    return dist.PrefixStore(prefix, store), prefix


_ABSENT = b"\x00distgrad: no such key\x00"


def peek(store: Any, key: str) -> bytes | None:
    """The bytes under ``key``, or None when there are none, without waiting.

    ``store.get`` waits for a missing key (up to the store's timeout, 60 s or more),
    so ``check`` then ``get`` blocks when someone deletes the key in between, and
    forever in effect when only the reader would write it again. A compare-and-set
    whose expected and new values are one marker never changes the store (torch's
    stores answer the marker when the key is missing, the current value otherwise).
    An entry that *is* the marker reads as missing: no one but a tamperer writes it.

    Example::

        >>> peek(dist.HashStore(), "nothing") is None
        True
    """
    try:
        got = store.compare_set(key, _ABSENT, _ABSENT)
    except (NotImplementedError, RuntimeError) as e:  # a store without compare-and-set
        if "not implemented" not in str(e).lower() and not isinstance(e, NotImplementedError):
            raise
        return bytes(store.get(key)) if store.check([key]) else None
    return None if got == _ABSENT else bytes(got)


def counter(store: Any, key: str, delta: int = 1) -> int:
    """``store.add(key, delta)``. A counter is anyone's to move: its value is read as
    a liveness or ordering hint only. Raises DistgradError naming the key when the
    store refuses: torch's store drops the connection when the key holds something
    that is not an integer (another writer put it there)."""
    try:
        return int(store.add(key, delta))
    except RuntimeError as e:
        raise DistgradError(f"{describe(store)} refused to move the counter {key!r}, or is gone: a "
                            "value that is not an integer under that key (put there by another "
                            "writer of the store: its entries were tampered with) makes torch's "
                            f"store drop the connection ({str(e).splitlines()[0]})") from None


def describe(store: Any) -> str:
    """The store in words, for messages: ``the rendezvous store at tcp://host:port``
    (torchrun's agent store, a file)."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        public = keeper.public_of(inner.port) if inner.host == "127.0.0.1" else None
        where = f"tcp://{public or f'{inner.host}:{inner.port}'}"
        if agent_hosts_store(inner.port):
            where += " (torchrun's agent store)"
    elif isinstance(inner, dist.FileStore):
        where = f"file://{inner.path}"
    else:
        where = f"a {type(inner).__name__}"
    return f"the rendezvous store at {where}"


def store_seal(store: Any, secret: bytes | None = None, worker: str | None = None) -> StoreSeal:
    """The :class:`~distgrad.launch.sealed.StoreSeal` of entries in ``store``, keyed
    from ``secret`` (None: ``DISTGRAD_SECRET``; unset: nothing authenticated)."""
    return StoreSeal(secret or secret_from_env(), describe(store), worker=worker)


def _check_nonce(value: Any) -> str | None:
    problem = expect(value, nonce=str)
    if problem is None and len(value["nonce"]) != 32:
        problem = f"a nonce of {len(value['nonce'])} characters, not 32"
    return problem


def check_pair(value: Any) -> str | None:
    """What is wrong with an entry ``{"name": str, "address": str}`` (None: nothing)."""
    return expect(value, name=str, address=str)


def check_pair_devices(value: Any) -> str | None:
    """What is wrong with an exchange entry: :func:`check_pair`'s, or the same with a
    JSON object ``"devices"`` (the worker's device maps, :mod:`distgrad.rpc.devices`)."""
    if isinstance(value, dict) and "devices" in value:
        return expect(value, name=str, address=str, devices=dict)
    return check_pair(value)


def exchange(store: dist.Store, rank: int, world_size: int, name: str, address: str,
             timeout: float, seal: StoreSeal | None = None,
             prefix: str = "", devices: dict | None = None) -> tuple[list[tuple], StoreSeal]:
    """Publish ``(name, address)`` for ``rank`` in ``store`` (a :func:`session`, whose
    keys are under ``prefix``); returns every rank's pair and the seal of this
    rendezvous (bound to all ranks' nonces: what the session's later entries, the
    shutdown barrier's, are sealed with, so that none from another rendezvous counts).
    With ``devices`` (a JSON object: this worker's device maps) each rank's entry
    carries it too, and every pair is a triple ``(name, address, devices)``
    (``devices`` None for a rank that published none).

    Two rounds of sealed entries (:mod:`.sealed`): every rank publishes a fresh
    nonce, then its pair bound to all ranks' nonces, so an entry of any other
    rendezvous (replayed) fails the check as a forged one does. One that fails it
    is ignored while its rank may still publish a good one: until the exchange's
    barrier, a worker whose own entry was deleted or overwritten writes it again,
    and one that read a nonce its rank has since written over (a replayed one)
    redoes the second round. At the timeout StoreTamperedError names every entry
    that failed. Nothing read is unpickled.

    Raises RuntimeError when two workers chose the same name or on timeout.

    Example::

        >>> s, prefix = session(store, rank=1)
        >>> peers, bound = exchange(s, 1, 2, "worker1", address, 60.0, prefix=prefix)
        >>> peers
        [('worker0', 'tcp://10.0.0.5:41234#...'), ('worker1', 'tcp://10.0.0.6:38211#...')]
    """
    seal = seal if seal is not None else store_seal(store, worker=name)
    rounds = _Rounds(store, prefix, seal, name, timeout, time.monotonic() + timeout)
    nonces = rounds.gather("nonce", seal, rank, world_size, {"nonce": os.urandom(16).hex()},
                           _check_nonce)
    while True:  # again when a nonce we read was since replaced (its rank wrote over a replay)
        attempt = hashlib.sha256(",".join(v["nonce"] for v in nonces).encode()).hexdigest()
        bound = seal.bound(attempt)
        try:
            mine = {"name": name, "address": address}
            if devices is not None:
                mine["devices"] = devices
            entries = rounds.gather("worker", bound, rank, world_size, mine,
                                    check_pair if devices is None else check_pair_devices,
                                    renewed=lambda n=nonces: rounds.renewed(n, rank))
            break
        except _Renewed as e:
            nonces = e.values
    if devices is None:
        peers: list[tuple] = [(e["name"], e["address"]) for e in entries]
    else:
        peers = [(e["name"], e["address"], e.get("devices")) for e in entries]
    # Rank 0 hosts the store: it must not leave (and, on a name clash, raise and
    # drop the store) before every rank has read the table.
    try:
        # every rank has read all by now: what is left of the timeout, but time enough
        # for the last ones to arrive on a loaded machine
        barrier(store, "exchange", rank, world_size,
                max(rounds.deadline - time.monotonic(), min(timeout, 10.0)), give_up=rounds.guard)
    except Exception as e:
        what = f"rendezvous of worker {name!r} failed after the exchange: {e}"
        if seal.tampered:
            raise seal.tampered_error(what) from e
        raise RuntimeError(what) from e
    seen: dict[str, int] = {}
    for r, (n, *_) in enumerate(peers):
        if n in seen:
            a, b = seen[n], r
            if rank == b:  # name ourselves first, as torch does
                a, b = b, a
            raise RuntimeError(f"RPC worker name {n} is not unique. Workers {a} and {b} share the "
                               "same name.")
        seen[n] = r
    return peers, bound


class _Renewed(Exception):
    """A round's inputs changed in the store (see :meth:`_Rounds.gather`)."""

    def __init__(self, values: list) -> None:
        super().__init__("renewed")
        self.values = values


class _Rounds:
    """One exchange's rounds in its session of the store (see :func:`exchange`).
    Until the exchange's barrier completes, this worker keeps its own entries as it
    wrote them: one deleted or overwritten is written again (and noted)."""

    def __init__(self, store: Any, prefix: str, seal: StoreSeal, name: str, timeout: float,
                 deadline: float) -> None:
        self.store, self.prefix, self.seal = store, prefix, seal
        self.name, self.timeout, self.deadline = name, timeout, deadline
        self.own: dict[str, bytes] = {}   # key -> the bytes we wrote
        self.guarded = self.looked = 0.0

    def full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def gather(self, tag: str, seal: StoreSeal, rank: int, world_size: int, mine: dict,
               check: Callable[[Any], str | None],
               renewed: Callable[[], list | None] | None = None) -> list[Any]:
        """Publish ``mine`` under ``<tag>/<rank>``, sealed with ``seal``; every rank's
        value once each passed the check (ours as we wrote it). While waiting,
        ``renewed()`` returning values ends the round with _Renewed."""
        keys = [f"{tag}/{r}" for r in range(world_size)]
        own = seal.seal(self.full(keys[rank]), mine)
        self.store.set(keys[rank], own)
        self.own[keys[rank]] = own
        got: dict[int, Any] = {rank: mine}
        pause = 0.001
        while True:
            pending = [r for r in range(world_size) if r not in got]
            if pending and self.store.check([keys[r] for r in pending]):
                for r in pending:
                    raw = self._get(keys[r])
                    value = None if raw is None else seal.open(self.full(keys[r]), raw, check)
                    if value is not None:
                        got[r] = value
                pending = [r for r in pending if r not in got]
            if not pending:
                return [got[r] for r in range(world_size)]
            self.guard()
            fresh = renewed() if renewed is not None else None
            if fresh is not None:
                raise _Renewed(fresh)
            now = time.monotonic()
            if now >= self.deadline:
                raise self._timeout(tag, pending)
            time.sleep(min(pause, self.deadline - now))
            pause = min(pause * 1.5, 0.05)

    def renewed(self, values: list, rank: int) -> list | None:
        """The nonces in the store when an authentic one differs from ``values`` (read
        at most every 100 ms), else None."""
        now = time.monotonic()
        if now - self.looked < 0.1:
            return None
        self.looked = now
        fresh = list(values)
        for r in range(len(values)):
            key = f"nonce/{r}"
            raw = self._get(key) if r != rank else None
            value = None if raw is None else self.seal.open(self.full(key), raw, _check_nonce)
            if value is not None:
                fresh[r] = value
        return fresh if fresh != values else None

    def _get(self, key: str) -> bytes | None:
        return peek(self.store, key)

    def guard(self) -> bool:
        """Write again any of our entries that was deleted or overwritten (at most
        every 20 ms); False, for :func:`barrier`'s ``give_up``."""
        now = time.monotonic()
        if now - self.guarded < 0.02:
            return False
        self.guarded = now
        for key, own in self.own.items():
            raw = self._get(key)
            if raw != own:
                self.seal.reject(self.full(key), "deleted (this worker wrote it; written again)"
                                 if raw is None else "overwritten (this worker wrote it; written again)")
                self.store.set(key, own)
        return False

    def _timeout(self, tag: str, ranks: list[int]) -> Exception:
        what = (f"rendezvous timed out after {self.timeout:.0f} s on worker {self.name!r}: ranks "
                f"{ranks} never joined" + (f" (store keys {self.prefix}/{tag}/...)" if self.prefix else ""))
        if self.seal.tampered:
            return self.seal.tampered_error(what)
        return RuntimeError(what)


def barrier(store: dist.Store, key: str, rank: int, world_size: int, timeout: float,
            give_up: Callable[[], bool] | None = None,
            lost: Callable[[], Collection[int]] | None = None,
            seal: StoreSeal | None = None, prefix: str = "") -> None:
    """Wait until all ranks reached ``key``; rank 0 (the store's host) leaves last.

    ``give_up()`` returning True (e.g. every other worker is gone) ends the wait
    early and quietly; otherwise a timeout raises.

    With ``lost()`` (the ranks known to be gone) it is a barrier of the
    survivors, polled: it completes once every rank not lost has arrived, and
    rank 0 waits (at most 10 s) for the survivors only to leave. Rank 0 hosts
    the store, so once it is lost this raises at once. Its flags (``<key>/arrived/<r>``,
    ``<key>/left/<r>``) are sealed with ``seal`` (default: ``DISTGRAD_SECRET``'s, bound
    to the attempt only; give the one :func:`exchange` returned, bound to this
    rendezvous) for their full key names (``store`` a :func:`session` whose keys are
    under ``prefix``): a flag that fails the check is not counted (warned once), and
    a worker writes its own again while it waits if it was deleted or overwritten.

    Example::

        >>> barrier(store, "shutdown", rank, world_size, 60.0, lost=lambda: set(agent.lost),
        ...         seal=bound, prefix=prefix)
    """
    if lost is not None:
        flags = _Flags(store, key, rank, seal if seal is not None else store_seal(store), prefix)
        _survivor_barrier(flags, world_size, timeout, lost)
        return
    # ">=": the counter is anyone's to move; a moved one ends the wait early or never
    # (then the timeout's error says what it read), it cannot stop it from ending
    if counter(store, key, 1) >= world_size:
        store.set(key + "/done", b"1")
    deadline = time.monotonic() + timeout
    if give_up is None:
        try:
            store.wait([key + "/done"], timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - torch's timeout, or a store that is gone
            raise RuntimeError(f"barrier {key!r} timed out after {timeout:.1f} s "
                               f"({_counted(store, key)} of {world_size} ranks counted): {e}") from e
    else:
        while not store.check([key + "/done"]):
            if give_up():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"barrier {key!r} timed out after {timeout:.1f} s "
                                   f"({_counted(store, key)} of {world_size} ranks counted)")
            time.sleep(0.005)
    n = counter(store, key + "/left", 1)
    if rank == 0:
        deadline = time.monotonic() + min(timeout, 10.0)
        while n < world_size and time.monotonic() < deadline and not (give_up and give_up()):
            time.sleep(0.005)
            n = counter(store, key + "/left", 0)


def _counted(store: dist.Store, key: str) -> str:
    try:
        return str(int(store.add(key, 0)))
    except Exception:  # noqa: BLE001 - the store is gone
        return "?"


class _Flags:
    """A survivor barrier's sealed flags in the store (see :func:`barrier`): ``<key>/<tag>/<r>``
    holds ``{"rank": r}`` sealed for that key name. Flags read authentic stay counted;
    this rank's own are written again if deleted or overwritten while it waits."""

    def __init__(self, store: Any, key: str, rank: int, seal: StoreSeal, prefix: str = "") -> None:
        self.store, self.key, self.rank, self.seal, self.prefix = store, key, rank, seal, prefix
        self.seen: set[tuple[str, int]] = set()
        self.own: dict[str, bytes] = {}

    def name(self, tag: str, r: int) -> str:
        return f"{self.key}/{tag}/{r}"

    def full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, tag: str) -> None:
        key = self.name(tag, self.rank)
        self.own[key] = self.seal.seal(self.full(key), {"rank": self.rank})
        self.store.set(key, self.own[key])

    def guard(self) -> None:
        for key, own in self.own.items():
            raw = peek(self.store, key)
            if raw != own:
                self.seal.reject(self.full(key), "deleted (this worker wrote it; written again)"
                                 if raw is None else "overwritten (this worker wrote it; written again)")
                self.store.set(key, own)

    def all_in(self, tag: str, ranks: Collection[int]) -> bool:
        """Whether every rank of ``ranks`` has an authentic flag ``tag``."""
        for r in ranks:
            if (tag, r) in self.seen:
                continue
            key = self.name(tag, r)
            raw = peek(self.store, key)
            if raw is None:
                return False
            value = self.seal.open(self.full(key), raw, lambda v, r=r: _check_flag(v, r))
            if value is None:
                return False
            self.seen.add((tag, r))
        return True


def _check_flag(value: Any, rank: int) -> str | None:
    problem = expect(value, rank=int)
    if problem is None and value["rank"] != rank:
        problem = f"the flag of rank {value['rank']}, not {rank}"
    return problem


def _survivor_barrier(flags: _Flags, world_size: int, timeout: float,
                      lost: Callable[[], Collection[int]]) -> None:
    key, rank = flags.key, flags.rank

    def check_host() -> None:
        if rank != 0 and 0 in lost():
            raise RuntimeError(f"barrier {key!r}: rank 0, which hosts the store, is lost")

    def wait_for(tag: str, limit: float) -> bool:
        # Poll with a growing pause (5 ms to 100 ms): a worker may wait here for a
        # long time while its peers still work, and must not steal their CPU, GIL
        # or store traffic meanwhile. (store.wait with short timeouts would block
        # without polling, but torch logs a warning for every slice that runs out.)
        # Only sealed flags count: anyone who reaches the store can set a key.
        deadline = time.monotonic() + limit
        pause = 0.005
        while True:
            check_host()
            gone = lost()
            if flags.all_in(tag, [r for r in range(world_size) if r != rank and r not in gone]):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            flags.guard()
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, 0.1)

    check_host()
    flags.put("arrived")
    if not wait_for("arrived", timeout):
        raise RuntimeError(f"barrier {key!r} timed out after {timeout:.1f} s")
    flags.put("left")
    if rank == 0:
        wait_for("left", min(timeout, 10.0))
