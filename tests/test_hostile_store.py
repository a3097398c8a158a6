"""The rendezvous store is a peer too (issue 29): whoever reaches its port can write
any key, knows no secret, and must neither run code in a worker nor steer it.

Real workers (spawn), a real TCPStore, and an attacker in the test process that
writes into it: evil pickles (unpickling one creates a marker file) in every key
distgrad reads, forged but well-formed entries naming the attacker's listening
socket, entries replayed from another rendezvous or another key, flipped bytes,
deleted keys, and a member table held at an old version. The static group (rank 0
hosts the store), torchrun's agent store (a store the test hosts, as torchrun's
agent does, with TORCHELASTIC_USE_AGENT_STORE), ``distgrad store`` (a dynamic group)
and a dynamic group whose rank 0 hosts the store are each attacked. Every start
either succeeds or fails within its (short) rendezvous timeout with an error that
says the store's entries were tampered with and which; the marker never appears
and the attacker's socket never gets a connection.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mp_utils import SLOW, distgrad_store, free_port, run_workers

USES_STORE_PROCESS = True   # rank 0 hosts its store as users get it (tests/mp_utils.py)

pytestmark = pytest.mark.timeout(180)

# a hang guard: an attacked start ends (either way) by its rendezvous timeout (cfg["rdv"],
# 25 s at most), the rest of this is slack for the start itself on a loaded machine
BOUND = 25.0 + 20.0 * SLOW


class _MakeFile:
    """Unpickling this creates ``path``: code run by whoever unpickles it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil(marker: str) -> bytes:
    return pickle.dumps(_MakeFile(marker))


def _forged(value) -> bytes:
    """An entry in distgrad's format, sealed with a key that is not the cluster's."""
    body = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    return b"DGS1" + hashlib.sha256(os.urandom(16) + body).digest() + body


def _client(port: int, wait: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=wait),
                         wait_for_workers=False)


def _host(port: int) -> dist.TCPStore:
    """A store served the way torchrun's agent serves it (static rendezvous)."""
    return dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=60),
                         wait_for_workers=False, multi_tenant=True)


def _is_counter(raw: bytes) -> bool:
    return raw.strip().lstrip(b"-").isdigit()


class _Listener:
    """The attacker's listening socket: counts the connections that reach it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}#auth={'00' * 16}"

    def close(self) -> None:
        self.sock.close()


class _Attacker:
    """A thread in the test process with a client of the store: ``step(store)`` runs
    every ``every`` seconds until ``stop()``; connection losses (the store's host
    restarting) are retried."""

    def __init__(self, port: int, step, every: float = 0.002) -> None:
        self.port, self.step, self.every = port, step, every
        self.done = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        store = None
        while not self.done.is_set():
            try:
                if store is None:
                    store = _client(self.port, wait=2.0)
                self.step(store)
            except Exception as e:  # noqa: BLE001 - the store's host went or came back
                store = None
                self.errors.append(repr(e))
                time.sleep(0.05)
                continue
            time.sleep(self.every)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


# -- the workers ----------------------------------------------------------------------
def _worker(rank: int, world_size: int, cfg: dict) -> dict:
    """init_rpc as ``cfg`` says, a call to every other member, shutdown;
    ``cfg['rounds']`` times. With ``cfg['coord']`` (a store's port) each round
    starts at key ``cfg['go']`` (``{rank}``, ``{i}``: the round); with ``cfg['report']``
    its start is reported (``up/<rank>/<i>``: ok or failed); a start that succeeded in
    round ``i`` stays until key ``cfg['hold'][i]``, if any. Rank ``r`` waits
    ``cfg['delay'][r]`` seconds before its init_rpc in round ``cfg['delay_round']``,
    and until key ``cfg['after'][r]`` is set, if any; rank ``r`` sets key
    ``cfg['tell'][r][1]`` once it warned of something naming ``cfg['tell'][r][0]``.
    Returns what happened, and the warnings."""
    import logging

    import distgrad.rpc as rpc
    from distgrad.rpc import lifecycle

    lifecycle.rdv_timeout = lambda opts: cfg["rdv"]   # attacked runs end soon
    seen: list[str] = []

    tell = cfg.get("tell", {}).get(str(rank))
    teller = _client(cfg["coord"]) if tell else None

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
            if tell and tell[0] in seen[-1]:
                teller.set(tell[1], "1")

    logging.getLogger("distgrad").addHandler(_Keep(level=logging.WARNING))
    os.environ.update(cfg.get("env", {}))
    coord = _client(cfg["coord"]) if cfg.get("coord") else None
    out = {"rounds": []}
    for i in range(cfg.get("rounds", 1)):
        if coord is not None:
            coord.wait([cfg.get("go", "go/{i}").format(rank=rank, i=i)], timedelta(seconds=90))
        if i == cfg.get("delay_round", 0):
            time.sleep(cfg.get("delay", {}).get(str(rank), 0.0))
            if str(rank) in cfg.get("after", {}):
                coord.wait([cfg["after"][str(rank)]], timedelta(seconds=90))
        port = cfg["ports"][i] if "ports" in cfg else cfg["port"]
        t0 = time.monotonic()
        got = {"ok": False, "error": None}
        try:
            if cfg["init"] == "dynamic":
                opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
                rpc.init_rpc(f"d{rank}", rank=cfg["rank"][str(rank)], rpc_backend_options=opts)
            elif cfg["init"] == "agent":
                os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
                rpc.init_rpc(f"worker{rank}")
            else:
                opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
                rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                             rpc_backend_options=opts)
        except Exception as e:  # noqa: BLE001 - what happened is the result
            got["error"] = f"{type(e).__name__}: {e}"
        got["init_s"] = time.monotonic() - t0
        if cfg.get("report"):
            coord.set(f"up/{rank}/{i}", "failed" if got["error"] else "ok")
        if got["error"] is None:
            if str(i) in cfg.get("hold", {}):
                coord.wait([cfg["hold"][str(i)]], timedelta(seconds=90))
            names = [w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()]
            me = rpc.get_worker_info().name
            got["calls"] = [rpc.rpc_sync(n, torch.add, args=(torch.ones(1), 1)).item()
                            for n in names if n != me]
            rpc.shutdown()
            got["ok"] = True
        out["rounds"].append(got)
    out["warnings"] = seen
    return out


def _clean_start_or_tampered(result: dict, limit: float = BOUND) -> None:
    """The rule for every attacked start: success, or the tampering error, in time."""
    for got in result["rounds"]:
        assert got["init_s"] < limit, got
        if not got["ok"]:
            assert "StoreTamperedError" in got["error"] and "tampered with" in got["error"], got


# -- the attacks ----------------------------------------------------------------------
def test_evil_pickles_in_every_key_under_torchruns_agent_store(tmp_path):
    """Static group on a store hosted as torchrun's agent hosts it. Evil pickles wait
    in the member table (read by a static joiner's check), in both ranks' nonce and
    exchange entries before they are written, and the attacker writes one over every
    entry a worker writes, once, as soon as it appears (counters excepted). No code
    runs; each worker writes its own entry again, and the start succeeds."""
    marker = str(tmp_path / "owned")
    port = free_port()
    host = _host(port)
    evil = _evil(marker)
    for key in ("distgrad/0/dyn/members", "distgrad/0.1/nonce/0", "distgrad/0.1/nonce/1",
                "distgrad/0.1/worker/0", "distgrad/0.1/worker/1"):
        host.set(key, evil)
    hit: set[str] = set()

    def overwrite_once(store):
        for key in store.list_keys():
            if key.startswith("distgrad/") and key not in hit:
                raw = store.get(key)
                if raw != evil and not _is_counter(raw):
                    store.set(key, evil)
                    hit.add(key)

    attacker = _Attacker(port, overwrite_once)
    try:
        results = run_workers(_worker, world_size=2, init=False, timeout=120,
                              args=({"init": "agent", "port": port, "rdv": 25.0},))
    finally:
        attacker.stop()
    assert not os.path.exists(marker), "a worker unpickled an entry of the store"
    for r in results:
        _clean_start_or_tampered(r)
        assert r["rounds"][0]["ok"] and r["rounds"][0]["calls"] == [2.0], r
    assert any("distgrad/0/dyn/members" in w for w in results[0]["warnings"]), results[0]
    assert len(hit) >= 4, hit   # the attack reached the entries


def test_forged_member_and_replays_from_another_rendezvous_static_group():
    """Rank 0 hosts the store. The attacker records a first rendezvous; in a second
    one (another store, the same key names) rank 1 starts late, and meanwhile the
    attacker writes into rank 1's nonce and exchange entries, in turn: a pickle and
    a well-formed entry naming its own listening socket (rank 1 taken over), rank
    1's entries of the first rendezvous (a replay from another attempt) and rank 0's
    current ones (a replay under another key). None is believed, no connection
    reaches the attacker's socket, and once it stops the start completes. Rank 1
    starts once rank 0 warned of its forged nonce (it started 2 s after the attack did,
    on the clock: a rank 0 whose previous shutdown and store took longer than the 2.3 s
    the nonce was forged never saw a forgery there, and the last assertion failed)."""
    ports = [free_port(), free_port()]
    coord_port = free_port()
    coord = _host(coord_port)
    listener = _Listener()
    recorded: dict[str, bytes] = {}
    phases = [0.0, 0.0]   # until when the nonce, then the exchange entry, are forged
    turn = [0]
    keys = (("distgrad/0.1/nonce/1", "distgrad/0.1/nonce/0"),
            ("distgrad/0.1/worker/1", "distgrad/0.1/worker/0"))

    def record(store):
        for key, _ in keys:
            if key not in recorded and store.check([key]):
                recorded[key] = store.get(key)

    def forge(store):
        now = time.monotonic()
        if now > phases[1]:
            return
        turn[0] += 1
        kind = turn[0] % 4
        for key, other in keys if now < phases[0] else keys[1:]:
            if kind == 1:    # what a worker that unpickles would connect to
                value = pickle.dumps(("worker1", listener.address()))
            elif kind == 2:  # rank 1 taken over: a well-formed entry with the attacker's address
                value = _forged({"name": "worker1", "address": listener.address()}
                                if "worker" in key else {"nonce": "ab" * 16})
            elif kind == 3:  # rank 1's entry of the first rendezvous
                value = recorded.get(key, b"")
            else:            # rank 0's entry under rank 1's key
                value = store.get(other) if store.check([other]) else b""
            if value:
                store.set(key, value)

    attackers = [_Attacker(ports[0], record)]

    def second_round():
        deadline = time.monotonic() + 90
        while "distgrad/0.1/worker/1" not in recorded and time.monotonic() < deadline:
            time.sleep(0.02)
        attackers[0].stop()
        coord.set("recorded", "1")   # the first rendezvous' workers may go on
        # until rank 0 warned of rank 1's nonce entry, both of rank 1's entries are
        # forged; then rank 1 starts, and (both nonces in) its exchange entry is forged
        # 2.2 s more
        phases[:] = [float("inf"), float("inf")]
        attackers.append(_Attacker(ports[1], forge, every=0.001))
        coord.set("go/1", "1")
        try:
            coord.wait(["nonce_warned"], timedelta(seconds=30))
        except RuntimeError:
            pass   # never warned: the last assertion says so
        phases[:] = [time.monotonic(), time.monotonic() + 2.2]
        coord.set("r1_go", "1")

    coord.set("go/0", "1")
    threading.Thread(target=second_round, daemon=True).start()
    cfg = {"init": "tcp", "ports": ports, "rdv": 25.0, "rounds": 2, "coord": coord_port,
           "after": {"1": "r1_go"}, "delay_round": 1, "hold": {"0": "recorded"},
           "tell": {"0": ["distgrad/0.1/nonce/1", "nonce_warned"]}}
    try:
        results = run_workers(_worker, world_size=2, init=False, timeout=150, args=(cfg,))
    finally:
        for a in attackers:
            a.stop()
        listener.close()
    assert listener.hits == 0, "a worker connected to the address the attacker wrote"
    for r in results:
        _clean_start_or_tampered(r)
        assert [g["ok"] for g in r["rounds"]] == [True, True], r
    assert sorted(recorded) == ["distgrad/0.1/nonce/1", "distgrad/0.1/worker/1"], recorded
    # rank 0 read what the attacker wrote for rank 1 while rank 1 was not there, and
    # said so (its exchange entry too, most of the time: not asserted, a matter of timing)
    assert any("distgrad/0.1/nonce/1" in w for w in results[0]["warnings"]), results[0]


def test_deleted_entries_are_written_again_under_torchruns_agent_store():
    """The attacker deletes every exchange entry once, as soon as it appears (rank 0
    starts late, so rank 1's entries are gone before anyone read them). Each worker
    writes its own again: the start is delayed, not broken."""
    port = free_port()
    host = _host(port)   # held: the store lives until the test ends
    gone: set[str] = set()

    def delete_once(store):
        for key in store.list_keys():
            if ("/nonce/" in key or "/worker/" in key) and key not in gone:
                store.delete_key(key)
                gone.add(key)

    attacker = _Attacker(port, delete_once, every=0.001)
    try:
        results = run_workers(_worker, world_size=2, init=False, timeout=120,
                              args=({"init": "agent", "port": port, "rdv": 25.0,
                                     "delay": {"0": 2.0}},))
    finally:
        attacker.stop()
    for r in results:
        _clean_start_or_tampered(r)
        assert r["rounds"][0]["ok"] and r["rounds"][0]["calls"] == [2.0], r
    assert host.check(["distgrad/0/joins/0"])
    assert {"distgrad/0.1/nonce/1", "distgrad/0.1/worker/1"} <= gone, gone
    assert any("deleted (this worker wrote it; written again)" in w for w in results[1]["warnings"])


class _DeletingStore:
    """A TCPStore whose ``check`` deletes the keys it just found: the attacker of
    the test above, at the worst moment, every time."""

    def __init__(self, store):
        self.store = store

    def check(self, keys):
        found = self.store.check(keys)
        for key in keys:
            self.store.delete_key(key)
        return found

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_key_deleted_between_check_and_read_does_not_block_its_writer():
    """``store.get`` waits for a missing key up to the store's timeout, and only the
    worker itself writes its own entry again: reading it back after ``check`` found
    it hung that worker for the whole timeout (the run above failed 1 time in 4)."""
    from distgrad.launch import rendezvous
    from distgrad.launch.sealed import StoreSeal
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30))
    store = _DeletingStore(host)
    assert rendezvous.peek(host, "nothing") is None and not host.check(["nothing"])
    host.set("k", b"v")
    assert rendezvous.peek(host, "k") == b"v"
    seal = StoreSeal(b"s" * 32, "test store", worker="w0")
    rounds = rendezvous._Rounds(store, "", seal, "w0", 5.0, time.monotonic() + 5.0)
    rounds.own["mine"] = b"what I wrote"
    host.set("mine", b"what I wrote")
    t0 = time.monotonic()
    rounds.guard()      # a check that found it is followed by its deletion
    assert time.monotonic() - t0 < 5.0 * SLOW  # not the store's 30 s wait for the key
    assert host.check(["mine"])
    host.delete_key("mine")
    rounds.guarded = 0.0
    rounds.guard()
    assert host.get("mine") == b"what I wrote"   # written again, and said so
    assert "deleted" in seal.tampered.get("mine", ""), seal.tampered


def _two_joiners(port: int, coord, coord_port: int, env: dict, attack, after=None) -> list:
    """Two members of a dynamic group on the store at ``port``: d0 (rank 0) joins,
    ``attack()`` runs, d1 (rank None) joins, ``after()`` runs, d0 leaves; ordered
    through ``coord`` (a client of the store at ``coord_port``)."""
    def order():
        try:
            coord.wait(["up/0/0"], timedelta(seconds=90))
            attack()
        finally:   # whatever happened to the first member
            coord.set("go/1", "1")
            coord.wait(["up/1/0"], timedelta(seconds=90))
            if after is not None:
                after()
            coord.set("release/0", "1")

    coord.set("go/0", "1")
    threading.Thread(target=order, daemon=True).start()
    cfg = {"init": "dynamic", "port": port, "rdv": 6.0, "coord": coord_port, "go": "go/{rank}",
           "env": env, "rank": {"0": 0, "1": None}, "report": True, "hold": {"0": "release/0"}}
    return run_workers(_worker, world_size=2, init=False, timeout=150, args=(cfg,))


def test_distgrad_store_evil_ledger_then_flipped_table(tmp_path):
    """``distgrad store`` serves a dynamic group. An evil pickle waits in the static
    members' ledger (a dynamic joiner reads it), whose counter says a billion entries:
    the first member joins, no code runs, and it looks at a bounded number of them.
    Then one byte of the member table is flipped: the next joiner fails within its
    timeout with StoreTamperedError naming the table."""
    marker = str(tmp_path / "owned")
    port = free_port()
    with distgrad_store(port):
        store = _client(port)
        store.add("distgrad/0/static/count", 10**9)
        store.set("distgrad/0/static/1", _evil(marker))

        def flip():
            raw = bytearray(store.get("distgrad/0/dyn/members"))
            raw[len(raw) // 2] ^= 0x01
            store.set("distgrad/0/dyn/members", bytes(raw))

        results = _two_joiners(port, store, port, {"DISTGRAD_STORE_HOSTED": "1"}, flip)
    assert not os.path.exists(marker), "a worker unpickled an entry of the store"
    first, second = results[0]["rounds"][0], results[1]["rounds"][0]
    assert first["ok"], first
    assert not second["ok"] and "distgrad/0/dyn/members" in second["error"], second
    assert "StoreTamperedError" in second["error"] and "failed authentication" in second["error"]
    _clean_start_or_tampered(results[1])
    assert any("distgrad/0/static/1" in w for w in results[0]["warnings"]), results[0]
    assert any("distgrad/0/static/count" in w and "reads 1000000000" in w
               for w in results[0]["warnings"]), results[0]


def test_table_held_at_an_old_version_fails_the_joiner_clearly():
    """A dynamic group whose rank 0 hosts the store. The attacker records the member
    table once rank 0 has joined and writes it back over every change (a version held
    forever: every compare-and-set of a joiner is undone). The joiner fails within its
    timeout with StoreTamperedError saying the table was rolled back."""
    port = free_port()
    coord_port = free_port()
    coord = _host(coord_port)
    saved: dict[str, bytes] = {}
    key = "distgrad/0/dyn/members"
    joined = threading.Event()

    def hold(store):
        if "table" not in saved:
            if joined.is_set():
                saved["table"] = store.get(key)
        elif store.get(key) != saved["table"]:
            store.set(key, saved["table"])

    attacker = _Attacker(port, hold, every=0.0005)

    def record():
        joined.set()
        deadline = time.monotonic() + 30
        while "table" not in saved and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        results = _two_joiners(port, coord, coord_port, {"DISTGRAD_STORE_LINGER": "0.5"}, record,
                               after=attacker.stop)
    finally:
        attacker.stop()
    first, joiner = results[0]["rounds"][0], results[1]["rounds"][0]
    assert "table" in saved
    assert first["ok"], first
    assert not joiner["ok"] and "StoreTamperedError" in joiner["error"], joiner
    assert key in joiner["error"] and "rolled back" in joiner["error"], joiner
    _clean_start_or_tampered(results[1])


def _no_secret(rank: int, world_size: int, port: int) -> str:
    import distgrad.rpc as rpc
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    try:
        rpc.init_rpc("worker0")
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    rpc.shutdown()
    return "started"


def test_without_a_secret_nothing_is_unpickled_either(tmp_path):
    """No cluster secret: nothing can be authenticated, but the evil pickle in the
    member table is still not unpickled: ProtocolError naming the key and the store."""
    marker = str(tmp_path / "owned")
    port = free_port()
    host = _host(port)
    host.set("distgrad/0/dyn/members", _evil(marker))
    try:
        (out,) = run_workers(_no_secret, world_size=1, init=False, timeout=90, args=(port,),
                             env_per_rank={0: {"DISTGRAD_SECRET": None}})
    finally:
        host.set("done", "1")   # (keeps the store's host alive until here)
    assert not os.path.exists(marker), "a worker unpickled an entry of the store"
    assert out.startswith("ProtocolError"), out
    assert "distgrad/0/dyn/members" in out and f"tcp://127.0.0.1:{port}" in out, out
    assert "malformed" in out and "not a distgrad entry" in out, out


def test_a_deleted_member_table_fails_the_next_joiner_and_splits_nothing():
    """Issue 42, item 2, through init_rpc: ``distgrad store`` serves a dynamic group; once
    d0 joined, a store writer deletes the member table. d1 (rank None) must not start a
    group of its own on d0's rank: it fails within its timeout with StoreTamperedError
    naming the table and the store, and nothing it did lists it. (Before: d1 started as
    rank 0 of a group of one, and d0's leave then took d1 out of the table.)"""
    port = free_port()
    key = "distgrad/0/dyn/members"
    with distgrad_store(port):
        store = _client(port)
        results = _two_joiners(port, store, port, {"DISTGRAD_STORE_HOSTED": "1"},
                               lambda: store.delete_key(key))
        assert not store.check([key])   # nobody wrote a table in its place
    first, second = results[0]["rounds"][0], results[1]["rounds"][0]
    assert first["ok"] and first["calls"] == [], first
    assert not second["ok"] and "StoreTamperedError" in second["error"], second
    assert key in second["error"] and f"tcp://127.0.0.1:{port}" in second["error"], second
    assert "deleted" in second["error"], second
    _clean_start_or_tampered(results[1])


def test_unit_forged_moved_or_replayed_shutdown_flags_are_not_counted():
    """Issue 42, item 4: the survivors' shutdown barrier counted any value under
    ``shutdown/arrived/<rank>``. A flag in the old format, one sealed with another key,
    rank 1's own flag moved to rank 0's key and rank 0's flag of another rendezvous
    (another exchange's nonces) each leave rank 1 waiting; rank 0's own flag ends it."""
    from distgrad.launch import rendezvous
    from distgrad.launch.sealed import StoreSeal
    store = dist.HashStore()
    seal = StoreSeal(b"s" * 32, "test store", worker="worker1")
    mine, earlier = seal.bound("this rendezvous"), seal.bound("an earlier rendezvous")
    key = "shutdown/arrived/0"
    forged = {"old format": b"1",
              "another key's seal": _forged({"rank": 0}),
              "moved": mine.seal("shutdown/arrived/1", {"rank": 1}),
              "replayed": earlier.seal(key, {"rank": 0})}
    for what, raw in forged.items():
        store.set(key, raw)
        with pytest.raises(RuntimeError, match="timed out"):
            rendezvous.barrier(store, "shutdown", 1, 2, 0.3, lost=set, seal=mine)
        assert key in seal.tampered, what
    store.set(key, mine.seal(key, {"rank": 0}))
    t0 = time.monotonic()
    rendezvous.barrier(store, "shutdown", 1, 2, 30.0 * SLOW, lost=set, seal=mine)
    assert time.monotonic() - t0 < 30.0 * SLOW


def _then_call_worker1(coord_port: int) -> object:
    """Runs on worker0 for worker2, through everyone's shutdown: busy until worker1 either
    left or refused the forged flags (it warns, naming the key), then calls worker1."""
    import distgrad.rpc as rpc
    coord = _client(coord_port)
    deadline = time.monotonic() + 90
    while not coord.check(["refused"]) and not coord.check(["left/1"]):
        assert time.monotonic() < deadline, "worker1 neither left nor refused the flags"
        time.sleep(0.01)
    out = {"worker1_left_first": coord.check(["left/1"]),
           "refused": coord.get("refused").decode() if coord.check(["refused"]) else None}
    try:
        out["call"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).tolist()
    except Exception as e:  # noqa: BLE001 - the result
        out["call"] = f"{type(e).__name__}: {e}"
    return out


def _idle_leaver(rank: int, world_size: int, port: int, coord_port: int) -> dict:
    """worker2 has worker0 run :func:`_then_call_worker1` and all three shut down:
    worker1 is idle and goes straight to the shutdown barrier."""
    import logging

    import distgrad.rpc as rpc
    coord = _client(coord_port)

    class _Tell(logging.Handler):
        def emit(self, record):
            if "/shutdown/arrived/" in record.getMessage():
                coord.set("refused", record.getMessage())

    if rank == 1:
        logging.getLogger("distgrad").addHandler(_Tell(level=logging.WARNING))
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    coord.set(f"up/{rank}", "1")
    coord.wait(["forged"], timedelta(seconds=90))
    fut = rpc.rpc_async("worker0", _then_call_worker1, args=(coord_port,)) if rank == 2 else None
    rpc.shutdown()
    if rank == 1:
        coord.set("left/1", "1")
    return fut.wait() if fut is not None else {}


def test_a_forged_shutdown_flag_does_not_let_an_idle_worker_leave():
    """Issue 42, item 4, through rpc.shutdown: rank 0 hosts the store. A store writer
    sets ``distgrad/0.1/shutdown/arrived/{0,2}`` while worker0 still serves worker2's
    call, which will call idle worker1. worker1 must wait in the shutdown barrier for
    them (it refuses the flags and says so), so the nested call succeeds. (Before:
    worker1 left at once and the nested call failed.)"""
    port, coord_port = free_port(), free_port()
    coord = _host(coord_port)

    def forge():
        deadline = time.monotonic() + 90
        while not coord.check(["up/0", "up/1", "up/2"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        store = _client(port)
        for r in (0, 2):
            store.set(f"distgrad/0.1/shutdown/arrived/{r}", b"1")
        coord.set("forged", "1")

    threading.Thread(target=forge, daemon=True).start()
    _, _, r2 = run_workers(_idle_leaver, world_size=3, init=False, timeout=150,
                           args=(port, coord_port))
    assert not r2["worker1_left_first"], r2
    assert "distgrad/0.1/shutdown/arrived/" in r2["refused"], r2
    assert r2["call"] == [2.0], r2
