"""The ``distgrad`` rendezvous backend for torchrun's agent (distgrad.launch.elastic_rdzv):
torch's dynamic rendezvous with its state kept as sealed, versioned JSON, and a
stranger who writes pickles into every store key they can list, on one node and
on an elastic two-node launch (real launchers, real sockets, each with a timeout)."""
from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from mp_utils import free_port
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from distgrad.launch import elastic_rdzv
from distgrad.launch.elastic_rdzv import SealedStateBackend, state_from_json, state_to_json

sys.path.insert(0, str(Path(__file__).resolve().parent / "launch_scripts"))
import procnet  # noqa: E402  (beside the stranger, which imports no distgrad)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the stranger")


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _state() -> _RendezvousState:
    s = _RendezvousState()
    a, b, c = _NodeDesc("10.0.0.1", 11, 0), _NodeDesc("10.0.0.2", 12, 1), _NodeDesc("h", 3, 2)
    s.round, s.complete, s.closed = 3, True, False
    s.deadline = datetime(2026, 12, 4, 20, 0, 1, 250000, tzinfo=timezone.utc)
    s.participants = {a: 0, b: 1}
    s.wait_list = {c}
    s.redundancy_list = {c}
    s.last_heartbeats = {a: datetime(2026, 12, 4, 20, 0, 0, 999999, tzinfo=timezone.utc),
                         b: datetime(1999, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc)}
    return s


def test_state_json_round_trip_is_exact() -> None:
    s = _state()
    back = state_from_json(state_to_json(s))
    assert vars(back) == vars(s)
    assert back.deadline.tzinfo is not None
    for bad in [{"round": 1}, {**state_to_json(s), "round": "1"},
                {**state_to_json(s), "participants": [["a", 1, 2]]},
                {**state_to_json(s), "deadline": 1.5}, {**state_to_json(s), "deadline": -1},
                {**state_to_json(s), "wait_list": [[1, 2, 3]]}]:
        with pytest.raises(ValueError):
            state_from_json(bad)


def test_backend_compare_and_set_and_what_it_refuses(tmp_path: Path) -> None:
    store = dist.HashStore()
    a = SealedStateBackend(store, "job", b"s3cret-of-the-job-0123456789abcdef")
    b = SealedStateBackend(store, "job", b"s3cret-of-the-job-0123456789abcdef")
    assert a.get_state() is None
    bits = pickle.dumps(_state())
    got, token, ok = a.set_state(bits)
    assert ok and vars(pickle.loads(got)) == vars(_state())
    # a stale writer loses the compare-and-set and gets the current state
    s2 = _state()
    s2.round = 4
    got_b, token_b, ok_b = b.set_state(pickle.dumps(s2), None)
    assert not ok_b and pickle.loads(got_b).round == 3
    got_b, token_b, ok_b = b.set_state(pickle.dumps(s2), token_b)
    assert ok_b and pickle.loads(a.get_state()[0]).round == 4
    raw = bytes(store.get("distgrad/rdzv/job/state"))
    assert b"pickle" not in raw and raw.startswith(b"DGS1")
    # nothing torch's holder loads comes from the store: a pickle there is refused, not run
    marker = tmp_path / "ran"
    for forged in (pickle.dumps(_Touch(marker)), base64.b64encode(pickle.dumps(_Touch(marker))),
                   raw[:-3] + b"99}"):
        store.set("distgrad/rdzv/job/state", forged)
        with pytest.raises(RendezvousStateError, match="tampered with"):
            a.get_state()
    assert not marker.exists()
    # another job's (or another key's) authentic state, and a rollback, are refused
    other = SealedStateBackend(dist.HashStore(), "job2", b"s3cret-of-the-job-0123456789abcdef")
    other.set_state(bits)
    store.set("distgrad/rdzv/job/state", bytes(other._store.get("distgrad/rdzv/job2/state")))
    with pytest.raises(RendezvousStateError, match="failed authentication"):
        a.get_state()
    first = SealedStateBackend(dist.HashStore(), "job", b"s3cret-of-the-job-0123456789abcdef")
    first.set_state(bits)
    old = bytes(first._store.get("distgrad/rdzv/job/state"))   # version 1
    store.set("distgrad/rdzv/job/state", old)
    with pytest.raises(RendezvousStateError, match="rolled back to version 1"):
        a.get_state()
    store.delete_key("distgrad/rdzv/job/state")
    with pytest.raises(RendezvousStateError, match="was deleted"):
        a.get_state()
    # a fresh agent with another secret cannot read (or be fed) the job's state
    store.set("distgrad/rdzv/job/state", raw)
    with pytest.raises(RendezvousStateError, match="failed authentication"):
        SealedStateBackend(store, "job", b"another-secret-0123456789abcdefghij").get_state()


def test_own_state_loader_takes_no_other_class() -> None:
    with pytest.raises(pickle.UnpicklingError, match="not part of a rendezvous state"):
        elastic_rdzv._own_state(pickle.dumps(_Touch(Path("/nonexistent/x"))))


def test_the_agents_store_refuses_what_is_not_sealed() -> None:
    """torch's agent reads its rank assignment and the workers' store address from the
    rendezvous store: under the distgrad backend those values are sealed for their
    key and round, so a stranger's (a split group: [0, 1, 0, 1], a store of theirs)
    and one moved from another round are refused, never used."""
    from distgrad.launch.sealed import StoreSeal
    seal = StoreSeal(b"s3cret-of-the-job-0123456789abcdef", "a test store", attempt="rdzv|job")
    base = dist.HashStore()
    r1 = elastic_rdzv.SealedAgentStore(dist.PrefixStore("torch.rendezvous.job.1", base), seal,
                                       "job", "torch.rendezvous.job.1")
    r2 = elastic_rdzv.SealedAgentStore(dist.PrefixStore("torch.rendezvous.job.2", base), seal,
                                       "job", "torch.rendezvous.job.2")
    r1.set("MASTER_ADDR", "10.0.0.1")
    r1.multi_set(["torchelastic/assigned_ranks/0", "torchelastic/assigned_ranks/1"],
                 [b"[0, 2, 0, 2]", b"[1, 2, 2, 2]"])
    assert r1.get("MASTER_ADDR") == b"10.0.0.1"
    assert r1.multi_get(["torchelastic/assigned_ranks/1"]) == [b"[1, 2, 2, 2]"]
    assert r1.add("count", 2) == 2 and r1.check(["count"])
    base.set("torch.rendezvous.job.1/torchelastic/assigned_ranks/1", b"[0, 1, 0, 1]")
    with pytest.raises(RendezvousStateError, match="assigned_ranks/1.*tampered with"):
        r1.get("torchelastic/assigned_ranks/1")
    base.set("torch.rendezvous.job.2/MASTER_ADDR",
             bytes(base.get("torch.rendezvous.job.1/MASTER_ADDR")))   # moved to round 2
    with pytest.raises(RendezvousStateError, match="tampered with"):
        r2.get("MASTER_ADDR")


def test_one_node_handler_has_no_port() -> None:
    elastic_rdzv.register()
    h = elastic_rdzv.create_handler(RendezvousParameters("distgrad", "", "job-x", 1, 1))
    assert isinstance(h._store, dist.HashStore)
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        elastic_rdzv.create_handler(RendezvousParameters("distgrad", "", "job-y", 1, 2))


# -- launches with a stranger beside them -------------------------------------------

def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TMPDIR"] = str(tmp)
    for key in ("DISTGRAD_SECRET", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _listening(pid: int) -> set[str]:
    """The local addresses (``ip:port``, hex as /proc shows them) ``pid`` and its
    children listen on."""
    return procnet.listening([pid])


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A launcher (or any command) from the project's root, its output captured."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running of ``procs`` (a test that failed midway)."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def _wait_files(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            outs = [p.communicate(timeout=30) if p.poll() is not None else ("", "") for p in procs]
            raise AssertionError(f"workers never got ready: {outs}")
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            o, e = p.communicate(timeout=15)
            raise AssertionError(f"a launcher hung:\n{o}\n{e}") from None
        out.append((p.returncode, o, e))
    return out


def _stranger(tmp: Path, seconds: float, pids: list[int]) -> str:
    env = _env(tmp)
    env.pop("PYTHONPATH")   # no distgrad in the stranger's process, no secret
    res = subprocess.run([sys.executable, str(SCRIPTS / "stranger.py"), str(tmp / "pwned"),
                          str(seconds), *map(str, pids)], env=env, capture_output=True,
                         text=True, timeout=seconds + 60)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.timeout(150)
def test_one_node_launch_survives_a_stranger_writing_pickles(tmp_path: Path) -> None:
    """The default one-node launch: the rendezvous has no port; the only one the
    launch opens besides the workers' RPC ports is their store, on 127.0.0.1
    alone. A stranger writes a pickle into every key of every store it reaches:
    nothing runs, and the job completes."""
    cmd = [sys.executable, "-m", "distgrad.launch", "--nproc-per-node", "2",
           str(SCRIPTS / "rdzv_victim.py"), str(tmp_path)]
    proc = _start(cmd, _env(tmp_path))
    try:
        _wait_files([tmp_path / "ready0.0", tmp_path / "ready1.0"], [proc], 90)
        addrs = _listening(proc.pid)
        assert addrs and all(a.startswith(("0100007F:", "00000000000000000000000001000000:"))
                             for a in addrs), addrs      # loopback only: no wildcard
        seen = _stranger(tmp_path, 4.0, [proc.pid])
        assert "reached=[]" not in seen, seen             # it reached the workers' store
        (tmp_path / "go").touch()
        [(rc, out, err)] = _finish([proc], 90)
    finally:
        _kill([proc])
    assert not (tmp_path / "pwned").exists()
    assert rc == 0 or "tamper" in err, (rc, out, err[-3000:])
    if rc == 0:
        assert "[rank0]: DONE rank=0" in out and "[rank1]: DONE rank=1" in out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["distgrad", "c10d"])
def test_elastic_two_node_rendezvous_against_a_stranger(tmp_path: Path, backend: str) -> None:
    """Two launchers of ``--nnodes 1:2`` meet at a rendezvous endpoint on
    127.0.0.1. A stranger writes pickles into every key of every store port the
    launchers hold. torch's c10d backend runs the stranger's code (the stranger
    and this test's calibration); distgrad's stops the rendezvous with a clear
    error naming the tampered state, or goes on, and runs nothing."""
    port = free_port()
    cmd = [sys.executable, "-m", "distgrad.launch", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7", "--monitor-interval",
           "0.1", "--rdzv-conf", "last_call_timeout=1"]
    if backend == "c10d":
        cmd += ["--rdzv-backend", "c10d"]
    cmd += [str(SCRIPTS / "rdzv_victim.py"), str(tmp_path)]
    env = _env(tmp_path, DISTGRAD_SECRET="distgrad-tests-elastic-0123456789abcdef")
    procs = [_start(cmd, env) for _ in range(2)]
    try:
        _wait_files([tmp_path / "ready0.0", tmp_path / "ready1.0"], procs, 120)
        if backend == "distgrad":   # the rendezvous store listens where it was told
            hosts = set().union(*(_listening(p.pid) for p in procs))
            assert f"0100007F:{port:04X}" in hosts, hosts
            assert not {f"00000000:{port:04X}", f"{'0' * 32}:{port:04X}"} & hosts, hosts
        seen = _stranger(tmp_path, 8.0, [p.pid for p in procs])
        assert f"{port}" in seen, seen
        (tmp_path / "go").touch()
        results = _finish(procs, 120)
    finally:
        _kill(procs)
    story = "\n".join(f"rc={rc}\n{out}\n{err[-2500:]}" for rc, out, err in results)
    if backend == "c10d":
        assert (tmp_path / "pwned").exists(), story    # the hole the distgrad backend closes
        assert all("unpickles what it reads" in err for _, _, err in results)
        return
    assert not (tmp_path / "pwned").exists(), story
    # an agent that read the forged state stops with an error naming it (the other may
    # first lose its peer's workers, then fail on that)
    assert any(rc == 1 and "distgrad rendezvous 'job7'" in err and "was tampered with" in err
               for rc, _, err in results), story


@pytest.mark.timeout(200)
def test_a_node_joining_restarts_the_group(tmp_path: Path) -> None:
    """``--nnodes 1:2``: the first node's round closes with one node (last_call 1 s)
    and its worker runs alone; a second launcher joins, and the agents restart the
    group as one of two nodes, as torchrun means to. (torch 2.13's own handler
    fails here, on its c10d backend too: rank 0 does not publish the workers'
    store in the new round, and the newcomer waits for it until the timeout.)"""
    port = free_port()
    cmd = [sys.executable, "-m", "distgrad.launch", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job9", "--monitor-interval",
           "0.1", "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "0"]
    cmd += [str(SCRIPTS / "elastic_join.py"), str(tmp_path)]
    env = _env(tmp_path, DISTGRAD_SECRET="distgrad-tests-elastic-0123456789abcdef")
    procs = [_start(cmd, env)]
    try:
        _wait_files([tmp_path / "started.w1.r0"], procs, 90)
        procs.append(_start(cmd, env))
        results = _finish(procs, 150)
    finally:
        _kill(procs)
    story = "\n".join(f"rc={rc}\n{out}\n{err[-2500:]}" for rc, out, err in results)
    assert [rc for rc, _, _ in results] == [0, 0], story
    out = "".join(o for _, o, _ in results)
    assert "world=1 attempt=0 group=0/1" in out, story
    assert "DONE rank=0 world=2" in out and "DONE rank=1 world=2" in out, story
    assert "DONE rank=0 world=1" not in out, story


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["--master-port", "--rdzv-backend static", "PET_RDZV_BACKEND"])
def test_static_one_node_store_listens_on_the_address_named(tmp_path: Path, how: str) -> None:
    """``--master-port`` on one node is torchrun's static rendezvous: its store is
    bound on ``--master-addr`` (127.0.0.1) alone, not torch's every interface. The
    static rendezvous named without a port (by option or by torchrun's variable)
    gets a free port the same way; torchrun would turn it into its c10d rendezvous,
    whose store listens everywhere and whose state the agent unpickles."""
    port = free_port()
    extra, env = [], {}
    if how == "--master-port":
        extra = ["--master-port", str(port)]
    elif how == "--rdzv-backend static":
        extra = ["--rdzv-backend", "static"]
    else:
        env = {"PET_RDZV_BACKEND": "static"}
    cmd = [sys.executable, "-m", "distgrad.launch", "--nproc-per-node", "2", *extra,
           str(SCRIPTS / "rdzv_victim.py"), str(tmp_path)]
    proc = _start(cmd, _env(tmp_path, **env))
    try:
        _wait_files([tmp_path / "ready0.0", tmp_path / "ready1.0"], [proc], 90)
        addrs = _listening(proc.pid)
        if how == "--master-port":
            assert f"0100007F:{port:04X}" in addrs, addrs
        assert addrs and all(a.startswith(("0100007F:", "00000000000000000000000001000000:"))
                             for a in addrs), addrs      # loopback only: no wildcard
        (tmp_path / "go").touch()
        [(rc, out, err)] = _finish([proc], 90)
    finally:
        _kill([proc])
    assert rc == 0, err[-3000:]
    assert "[rank0]: DONE rank=0" in out and "[rank1]: DONE rank=1" in out
