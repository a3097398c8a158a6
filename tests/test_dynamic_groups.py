"""Dynamic groups (init_rpc without world_size): members that join at different
times, leave, rejoin under their name, crash and are replaced; distributed
autograd across them checked against local autograd; mixing static and dynamic
members refused within seconds. Real processes on 127.0.0.1 (tests/mp_utils.py);
a coordination store hosted by the test process orders their steps."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mp_utils import SLOW, distgrad_store, free_port, run_workers

# the call timeout the members run with: SLOW times torch's 60 s, so that a bound that
# tells "at the loss" from "at the call's timeout" can be SLOW times generous too
CALL_TIMEOUT = 60.0 * SLOW


def _coord(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=60),
                         wait_for_workers=False)


def _run(fn, rdv_port: int, timeout: float = 150, **kw) -> list:
    """``fn(rank, 3, rdv_port, coord_port)`` on three workers, ordered through a
    coordination store this process hosts for the run."""
    coord = free_port()
    host = dist.TCPStore("127.0.0.1", coord, None, is_master=True, timeout=timedelta(seconds=60),
                         wait_for_workers=False)
    try:
        return run_workers(fn, world_size=3, init=False, timeout=timeout, args=(rdv_port, coord), **kw)
    finally:
        del host


def _wait(store, key: str) -> None:
    store.wait([key], timedelta(seconds=60 * SLOW))


def _names() -> list[str]:
    import distgrad.rpc as rpc
    return sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())


def _until(pred, limit: float = 20.0 * SLOW) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.005)
    return time.monotonic() - t0


def _double(x):
    return x * 2


def _sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def _local_chain(x, y):
    return ((x * 2) + y).tanh().sum()


def _join_leave_rejoin(rank, world_size, rdv_port, coord_port):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.errors import WorkerLostError
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rdv_port}",
                                           rpc_timeout=CALL_TIMEOUT)
    out = {}
    if rank == 0:
        rpc.init_rpc("w0", rank=0, rpc_backend_options=opts)   # hosts the store, leaves last
        store.set("w0_up", "1")
        _wait(store, "w2_up")
        out["names_all"] = _names()
        slow = rpc.rpc_async("w1", _sleep_then, args=(1.0, "served"))  # in flight as w1 leaves
        store.set("w0_slow_sent", "1")
        out["slow_to_leaver"] = slow.wait()
        _wait(store, "w1_left")
        out["names_after_leave"] = _names()
        _wait(store, "w1_back")
        out["names_after_rejoin"] = _names()
        out["call_rejoined"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(2), 1)).tolist()
        store.set("w0_called", "1")
        _wait(store, "w2_done")
    elif rank == 1:
        _wait(store, "w0_up")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)
        store.set("w1_up", "1")
        _wait(store, "w2_ctx")          # w2 holds a live context that reached this worker
        _wait(store, "w0_slow_sent")
        mine = rpc.rpc_async("w0", _sleep_then, args=(0.5, "answered"))
        t0 = time.monotonic()
        rpc.shutdown()                  # leave: the others go on
        out["leave_s"] = time.monotonic() - t0
        out["slow_from_leaver"] = mine.wait()
        store.set("w1_left", "1")
        _wait(store, "w2_checked")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)  # the same name and rank again
        store.set("w1_back", "1")
        out["names_rejoined"] = _names()
        _wait(store, "w0_called")
        out["call_from_rejoined"] = rpc.rpc_sync("w2", torch.mul, args=(torch.ones(2), 3)).tolist()
        rpc.shutdown()
        # a static member on a store where a dynamic group runs: torch's message, at once
        t0 = time.monotonic()
        try:
            rpc.init_rpc("s1", rank=1, world_size=2, rpc_backend_options=opts)
            out["mixed"] = "no error"
            rpc.shutdown()
        except RuntimeError as e:
            out["mixed"] = str(e)
        out["mixed_s"] = time.monotonic() - t0
        store.set("w1_gone", "1")
    else:
        _wait(store, "w1_up")
        rpc.init_rpc("w2", rank=None, rpc_backend_options=opts)   # a rank given by the group
        out["rank"] = rpc.get_worker_info().id
        store.set("w2_up", "1")
        out["names_all"] = _names()
        held = rpc.remote("w1", _owned_value)    # owned by w1, which leaves while w2 holds it
        assert held.to_here().tolist() == [0.0, 1.0, 2.0]
        # a context spanning the member that joined first and the one that joined since
        x = torch.randn(4, requires_grad=True)
        y = torch.randn(4, requires_grad=True)
        with dist_autograd.context() as cid:
            t = rpc.rpc_sync("w0", _double, args=(x,))
            loss = rpc.rpc_sync("w1", torch.add, args=(t, y)).tanh().sum()
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
        xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        _local_chain(xr, yr).backward()
        out["exact"] = torch.equal(grads[x], xr.grad) and torch.equal(grads[y], yr.grad)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", torch.add, args=(x * 2, y)).tanh().sum()
            store.set("w2_ctx", "1")
            _until(lambda: "w1" not in _names())
            t0 = time.monotonic()
            try:
                dist_autograd.backward(cid, [loss])
                out["backward"] = "no error"
            except WorkerLostError as e:
                out["backward"] = f"{type(e).__name__}: {e}"
            out["backward_s"] = time.monotonic() - t0
        try:
            rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 1))
            out["call_departed"] = "no error"
        except WorkerLostError as e:
            out["call_departed"] = f"{type(e).__name__}: {e}"
        try:
            held.to_here()
            out["held_rref"] = "no error"
        except WorkerLostError as e:
            out["held_rref"] = f"{type(e).__name__}: {e}"
        del held  # nothing to send: its owner is gone
        store.set("w2_checked", "1")
        _wait(store, "w0_called")
        _wait(store, "w1_gone")
        store.set("w2_done", "1")
    if rpc.api.agent_or_none() is not None:
        out["contexts_left"] = dist_autograd._get_debug_info()["num_autograd_contexts"]
        out["events"] = [e[1:] for e in rpc.membership_events()]
        rpc.shutdown()
    return out


def test_join_leave_rejoin_autograd_and_mixing():
    rdv = free_port()
    w0, w1, w2 = _run(_join_leave_rejoin, rdv)
    assert w0["names_all"] == ["w0", "w1", "w2"] == w2["names_all"]
    assert w2["rank"] == 2
    # calls to and from the leaver in flight when it left finished first
    assert w0["slow_to_leaver"] == "served" and w1["slow_from_leaver"] == "answered"
    assert w2["exact"] is True
    # the leaver's departure: every member's table drops it; a backward needing it and a
    # call to it fail fast with WorkerLostError naming it
    assert w0["names_after_leave"] == ["w0", "w2"]
    assert w2["backward"].startswith("WorkerLostError") and "w1" in w2["backward"], w2["backward"]
    # at the loss, not after a call timeout (CALL_TIMEOUT: SLOW times 60 s)
    assert w2["backward_s"] < CALL_TIMEOUT / 2, w2
    assert w2["call_departed"].startswith("WorkerLostError") and "w1" in w2["call_departed"]
    assert w2["held_rref"].startswith("WorkerLostError") and "w1" in w2["held_rref"], w2
    # back under its name and rank (torch: every call to it then fails with eof)
    assert w0["names_after_rejoin"] == ["w0", "w1", "w2"] == w1["names_rejoined"]
    assert w0["call_rejoined"] == [2.0, 2.0] and w1["call_from_rejoined"] == [3.0, 3.0]
    assert "RPC group mixes statically and dynamically initialized members which is not supported" \
        in w1["mixed"], w1["mixed"]
    # refused, not a rendezvous that timed out (CALL_TIMEOUT: SLOW times 60 s)
    assert w1["mixed_s"] < CALL_TIMEOUT * 3 / 4, w1
    assert w0["contexts_left"] == 0 and w2["contexts_left"] == 0
    assert ("joined", "w1", 1, 2) in w0["events"] and ("left", "w1", 1, 1) in w0["events"]


def _owned_value():
    return torch.arange(3.0)


_SLOW_CALL = 30.0 * SLOW   # s: the call in flight when its server is killed


def _crash_and_replace(rank, world_size, rdv_port, coord_port):
    import gc

    import distgrad.rpc as rpc
    from distgrad.errors import WorkerLostError
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rdv_port}",
                                           rpc_timeout=CALL_TIMEOUT)
    out = {}
    if rank == 0:
        rpc.init_rpc("w0", rank=0, rpc_backend_options=opts)
        store.set("w0_up", "1")
        _wait(store, "w1_up")
        old = rpc.remote("w1", _owned_value)          # owned by w1's first process
        assert old.to_here().tolist() == [0.0, 1.0, 2.0]
        slow = rpc.rpc_async("w1", time.sleep, args=(_SLOW_CALL,))
        store.set("go_crash", "1")
        t0 = time.monotonic()
        try:
            slow.wait()
            out["pending"] = "no error"
        except WorkerLostError as e:
            out["pending"] = f"{type(e).__name__}: {e}"
        out["pending_s"] = time.monotonic() - t0
        out["removed_s"] = _until(lambda: "w1" not in _names())
        store.set("w1_out", "1")
        _wait(store, "w1_replaced")
        out["names"] = _names()
        out["call"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 1)).tolist()
        # the old process's RRef: using it reaches the new process, which refuses it
        try:
            old.to_here(timeout=10)
            out["old_rref"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["old_rref"] = f"{type(e).__name__}: {e}"
        del old  # its release (a fork_del about the old process's RRef) is ignored
        gc.collect()
        out["replacement_rrefs"] = rpc.rpc_sync("w1", rpc._rref_context_get_debug_info)
        out["events"] = [e[1:] for e in rpc.membership_events()]
        store.set("w0_done", "1")
        _wait(store, "w1_checked")
    elif rank == 1:
        _wait(store, "w0_up")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)
        store.set("w1_up", "1")
        _wait(store, "go_crash")
        time.sleep(0.2)  # the slow call is running here
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        _wait(store, "w1_out")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)   # the replacement
        out["incarnation"] = rpc.api._get_current_rpc_agent().incarnation
        store.set("w1_replaced", "1")
        _wait(store, "w0_done")
        out["rrefs"] = rpc._rref_context_get_debug_info()
        store.set("w1_checked", "1")
    rpc.shutdown()
    return out


def test_crashed_member_removed_and_replaced_as_new_incarnation():
    rdv = free_port()
    w0, _, w1b = _run(_crash_and_replace, rdv, expect_exit={1})
    assert w0["pending"].startswith("WorkerLostError") and "w1" in w0["pending"], w0["pending"]
    # failed at the loss, before the slow call (SLOW times 30 s) ended
    assert w0["pending_s"] < _SLOW_CALL * 5 / 6, w0
    assert ("lost", "w1", 1, 1) in w0["events"], w0["events"]
    assert w0["names"] == ["w0", "w1"] and w0["call"] == [2.0]
    assert w1b["incarnation"] == 2
    assert w0["old_rref"].startswith("WorkerLostError") and "owned RRef" in w0["old_rref"], w0["old_rref"]
    # nothing of the old process's RRef was taken for the new one's
    assert int(w0["replacement_rrefs"]["num_owner_rrefs"]) == 0
    assert int(w1b["rrefs"]["num_owner_rrefs"]) == 0 and int(w1b["rrefs"]["num_forks"]) == 0


def test_elastic_parameter_server_example():
    """The issue's pattern: a trainer joins at step 50, one is SIGKILLed at step 100 and
    replaced under its name, on to step 200; every step's gradients exact."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, DISTGRAD_SECRET="distgrad-tests", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(root / "examples" / "elastic_parameter_server.py")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    story = f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and "ELASTIC OK" in proc.stdout, story
    # 49 steps x 2 trainers, 50 x 3, step 100 without the crashed one (2), 100 x 3
    assert "steps 200, gradients checked 550, mismatched 0" in proc.stdout, story
    assert "left on the server: 0 contexts, 0 owner RRefs, 0 forks" in proc.stdout, story
    assert "event lost   trainer2 (rank 2, incarnation 1)" in proc.stdout, story
    assert "event joined trainer2 (rank 2, incarnation 2)" in proc.stdout, story


@pytest.mark.parametrize("first_static", [True, False])
def test_unit_mixing_refused(tmp_path, first_static):
    """The table's own checks, both directions, with torch's message."""
    import socket

    from distgrad.rpc import membership, mixing
    store = dist.FileStore(str(tmp_path / "s"), -1)
    group = membership.Group(store, timeout=5)
    if first_static:
        live = socket.create_server(("127.0.0.1", 0))   # the static member listens: it lives
        mixing.count_in(store, "s", f"tcp://127.0.0.1:{live.getsockname()[1]}#host=x")
        with pytest.raises(RuntimeError, match="mixes statically and dynamically"):
            group.join("d", 0)
    else:
        group.join("d", 0)
        with pytest.raises(RuntimeError, match="mixes statically and dynamically"):
            membership.check_static_join(store, "s")


def test_unit_table_names_ranks_incarnations(tmp_path):
    from distgrad.rpc import membership
    store = dist.FileStore(str(tmp_path / "s"), -1)
    group = membership.Group(store, timeout=5)
    assert group.join("a", None)[:2] == (0, 1)
    assert group.join("b", None)[:2] == (1, 1)
    with pytest.raises(RuntimeError, match="RPC worker name a is not unique"):
        group.join("a", 5)
    with pytest.raises(RuntimeError, match="rank 1 of the dynamic group is taken by worker 'b'"):
        group.join("c", 1)
    assert group.leave(1, 1) and not group.leave(1, 1)
    rank, inc, others = group.join("b", 1)
    assert (rank, inc, sorted(others)) == (1, 2, [0])
    assert not group.leave(1, 1)   # the old incarnation cannot take the new one out
    assert group.members()[1][0] == "b" and group.members()[1][2] == 2


def _hosted_store(rank, world_size, store_port, coord_port):
    import distgrad.rpc as rpc
    os.environ["DISTGRAD_STORE_HOSTED"] = "1"
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{store_port}")
    out = {}
    if rank == 0:
        rpc.init_rpc("w0", rank=0, rpc_backend_options=opts)
        store.set("w0_up", "1")
        _wait(store, "w1_up")
        t0 = time.monotonic()
        rpc.shutdown()          # rank 0 leaves first: the store lives elsewhere
        out["leave_s"] = time.monotonic() - t0
        store.set("w0_left", "1")
        _wait(store, "w2_up")
        rpc.init_rpc("w0", rank=None, rpc_backend_options=opts)   # w2 holds rank 0 now
        out["rank_back"] = rpc.get_worker_info().id
        out["names_back"] = _names()
        out["call"] = rpc.rpc_sync("w2", torch.add, args=(torch.ones(1), 4)).tolist()
        store.set("w0_back", "1")
    elif rank == 1:
        _wait(store, "w0_up")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)
        store.set("w1_up", "1")
        _wait(store, "w0_left")
        out["names_without_0"] = _until(lambda: _names() == ["w1"]) >= 0 and _names()
        _wait(store, "w0_back")
    else:
        _wait(store, "w0_left")
        rpc.init_rpc("w2", rank=None, rpc_backend_options=opts)   # rank 0 is free now
        out["rank"] = rpc.get_worker_info().id
        out["call"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 1)).tolist()
        store.set("w2_up", "1")
        _wait(store, "w0_back")
    rpc.shutdown()
    return out


def test_store_of_its_own_lets_rank_0_come_and_go():
    """``distgrad store`` serves the store; with DISTGRAD_STORE_HOSTED=1 rank 0 is a member
    like the others: it leaves first, its rank is given to a joiner meanwhile, ... ."""
    store_port = free_port()
    with distgrad_store(store_port):
        w0, w1, w2 = _run(_hosted_store, store_port, timeout=120)
    # without waiting for the others (they wait SLOW times 60 s for it: _wait)
    assert w0["leave_s"] < 30 * SLOW, w0
    assert w1["names_without_0"] == ["w1"]
    assert w2["rank"] == 0 and w2["call"] == [2.0]   # the smallest free rank, while w0 was out
    assert w0["rank_back"] == 2 and w0["call"] == [5.0] and w0["names_back"] == ["w0", "w1", "w2"], w0


def test_unit_a_joiner_that_died_before_listening_is_skipped(tmp_path):
    from distgrad.rpc import membership
    store = dist.FileStore(str(tmp_path / "s"), -1)
    group = membership.Group(store, timeout=5)
    r0, i0, _ = group.join("alive", None)
    group.publish(r0, i0, "tcp://127.0.0.1:1")
    group.join("died", None)                      # took rank 1, never published
    _, _, others = group.join("late", None)
    t0 = time.monotonic()
    ready = group.addresses(others, time.monotonic() + 30, patience=0.3)
    assert sorted(ready) == [0] and time.monotonic() - t0 < 30
    assert sorted(n for n, _, _ in group.members().values()) == ["alive", "late"]  # taken out


def _silent_member(rank, world_size, rdv_port, coord_port):
    import distgrad.rpc as rpc
    from distgrad.errors import WorkerLostError
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rdv_port}",
                                           heartbeat_interval=0.2, heartbeat_deadline=1.5)
    out = {}
    if rank == 0:
        rpc.init_rpc("w0", rank=0, rpc_backend_options=opts)
        store.set("w0_up", "1")
        _wait(store, "w1_up")
        pid = int(store.get("w1_pid"))
        os.kill(pid, signal.SIGSTOP)      # silent, not dead: only the heartbeats can tell
        t0 = time.monotonic()
        out["removed_s"] = _until(lambda: "w1" not in _names(), 30 * SLOW) and time.monotonic() - t0
        store.set("w1_out", "1")
        _wait(store, "w1_replaced")
        out["call"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 2)).tolist()
        os.kill(pid, signal.SIGCONT)      # the old process wakes up to a group without it
        _wait(store, "old_done")
        out["names"] = _names()
        out["call_again"] = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 3)).tolist()
        out["events"] = [e[1:] for e in rpc.membership_events()]
        store.set("w0_done", "1")
    elif rank == 1:
        _wait(store, "w0_up")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)
        store.set("w1_pid", str(os.getpid()))
        store.set("w1_up", "1")
        _wait(store, "w1_replaced")   # (stopped in here, then continued)
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("w0", torch.add, args=(torch.ones(1), 1), timeout=10)
            out["old_call"] = "no error"
        except (WorkerLostError, RuntimeError) as e:
            out["old_call"] = f"{type(e).__name__}: {e}"
        out["old_call_s"] = time.monotonic() - t0
        store.set("old_done", "1")
        _wait(store, "w0_done")
    else:
        _wait(store, "w1_out")
        rpc.init_rpc("w1", rank=1, rpc_backend_options=opts)   # the replacement
        store.set("w1_replaced", "1")
        _wait(store, "w0_done")
    rpc.shutdown()
    return out


def test_silent_member_removed_by_heartbeats_and_its_wakeup_harmless():
    """A SIGSTOPped member is taken out by the heartbeats and replaced; when the old
    process continues, nothing it sends reaches the group, and it cannot hang it."""
    rdv = free_port()
    w0, old, _ = _run(_silent_member, rdv)
    assert ("lost", "w1", 1, 1) in w0["events"], w0["events"]   # by the heartbeats
    assert w0["removed_s"] < 25 * SLOW, w0   # heartbeat deadline 1.5 s; a hang guard
    assert w0["call"] == [3.0] and w0["call_again"] == [4.0] and w0["names"] == ["w0", "w1"], w0
    # the old process finds its connections closed: it lost the group, at once
    assert old["old_call"].startswith("WorkerLostError") and "w0" in old["old_call"], old


# -- issue 26 item 4: incarnations, the table's compare-and-set, slow joiners, static members


def _ids_of_incarnation(monkeypatch, k: int) -> tuple[list, object]:
    """Autograd context/message ids and RRef ids of incarnation ``k`` of rank 3 (a
    dynamic group's process), each counter driven to the end of its slice and one past."""
    import importlib
    import itertools
    from types import SimpleNamespace

    from distgrad.autograd import recording
    from distgrad.rpc.rref_context import RRefContext
    container = importlib.import_module("distgrad.autograd.context").Container()
    monkeypatch.setattr(recording, "CONTAINER", container)
    agent = SimpleNamespace(rank=3, name="w3", incarnation=k, dynamic=True, world_size=None,
                            control_handlers={})
    recording.AutogradExtension(agent)
    rrefs = RRefContext(agent)
    end = k << 40                        # incarnation k numbers in [(k-1) << 40, k << 40)
    ids, errors = [], []
    ids.append(container.new_context().id & ((1 << 48) - 1))
    container.release(container.current_id())
    ids.append(container.new_message_id() & ((1 << 48) - 1))
    ids.append(rrefs.new_id()[1])
    container._counter = itertools.count(end - 1)
    container._msg_counter = itertools.count(end - 1)
    rrefs._ids = itertools.count(end - 1)
    for make in (lambda: container.new_context().id, container.new_message_id,
                 lambda: rrefs.new_id()[1]):
        for _ in range(2):               # the last id of the slice, then one past it
            try:
                ids.append(make() & ((1 << 48) - 1))
            except RuntimeError as e:
                errors.append(str(e))
            if container.current_id() is not None:
                container.release(container.current_id())
    return ids, errors


@pytest.mark.parametrize("k", [1, 2, 255, 256])
def test_unit_ids_of_one_incarnation_never_reach_the_next(monkeypatch, k):
    """Incarnation k's context, message and RRef ids stay in its slice of the 48-bit
    counter up to its very end: past it they are refused, never wrapped onto
    incarnation 1's or spilled into k+1's."""
    ids, errors = _ids_of_incarnation(monkeypatch, k)
    first, end = (k - 1) << 40, k << 40
    assert all(first <= i < end for i in ids), [hex(i) for i in ids if not first <= i < end]
    assert len(ids) == 6 and len(errors) == 3, (ids, errors)   # 3 first ids, 3 last ones
    assert all("exhausted" in e for e in errors), errors
    ids_next, _ = _ids_of_incarnation(monkeypatch, k + 1) if k < 256 else ([], [])
    assert not set(ids) & set(ids_next)


def _past_the_incarnations(rank, world_size, path):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
    out = {}
    try:
        rpc.init_rpc("client", rank=0, rpc_backend_options=opts)   # rank 0 had 256 already
        out["explicit"] = "joined"
        rpc.shutdown()
    except Exception as e:  # noqa: BLE001
        out["explicit"] = f"{type(e).__name__}: {e}"
        out["explicit_is_runtime"] = isinstance(e, RuntimeError)
    rpc.init_rpc("client", rank=None, rpc_backend_options=opts)
    me = rpc.get_worker_info()
    out["rank"] = me.id
    out["incarnation"] = rpc.api._get_current_rpc_agent().incarnation
    with dist_autograd.context() as cid:          # ids work in the rank it was given
        out["cid_ok"] = cid >> 48 == me.id
    out["rref"] = rpc.remote("client", torch.add, args=(torch.ones(1), 1)).to_here().tolist()
    rpc.shutdown()
    return out


def test_join_past_the_incarnation_limit_fails_at_init_rpc(tmp_path):
    """256 short-lived clients, each taking the smallest free rank (0), use up rank 0's
    incarnations; the next join under rank 0 fails at init_rpc with an error naming the
    rank, the limit and what to do, and rank=None goes on to a rank with incarnations left."""
    from distgrad.launch import rendezvous
    from distgrad.rpc import membership
    path = tmp_path / "store"
    store = dist.FileStore(str(path), -1)
    # the workers' secret (tests/mp_utils.py): the table they read must be sealed with it
    group = membership.Group(store, timeout=10, seal=rendezvous.store_seal(store, b"distgrad-tests"))
    for _ in range(256):
        r, inc, _ = group.join("client", None)
        assert r == 0
        assert group.leave(r, inc)
    (out,) = run_workers(_past_the_incarnations, world_size=1, init=False, timeout=90,
                         args=(str(path),))
    assert out["explicit"].startswith("IncarnationsExhaustedError"), out
    assert out["explicit_is_runtime"] is True
    assert "rank 0" in out["explicit"] and "256 incarnations" in out["explicit"], out
    assert "another rank" in out["explicit"] and "fresh store" in out["explicit"], out
    assert out["rank"] == 1 and out["incarnation"] == 1 and out["cid_ok"] is True, out
    assert out["rref"] == [2.0]


class _PausingStore:
    """A store whose first write of the member table stops until ``release`` is set (a
    process paused between reading the table and writing it: SIGSTOP, a VM pause)."""

    def __init__(self, store) -> None:
        import threading
        self.store, self.paused, self.release = store, threading.Event(), threading.Event()

    def _pause(self, key: str) -> None:
        if key.endswith("dyn/members") and not self.paused.is_set():
            self.paused.set()
            assert self.release.wait(30)

    def set(self, key, value):
        self._pause(key)
        return self.store.set(key, value)

    def compare_set(self, key, expected, desired):
        self._pause(key)
        return self.store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_unit_a_paused_table_writer_loses_nothing_and_revives_no_one(tmp_path, monkeypatch):
    """Joiner "a" reads the table, then stalls before its write (longer than the old
    lock's 30 s staleness, shortened here). Meanwhile "b" joins and "x" leaves. When "a"
    continues, the table lists a and b: b is not lost and x does not come back."""
    import threading

    from distgrad.rpc import membership
    monkeypatch.setattr(membership, "_LOCK_STALE", 0.2, raising=False)  # the old lock's
    store = dist.FileStore(str(tmp_path / "s"), -1)
    group = membership.Group(store, timeout=20)
    rx, ix, _ = group.join("x", None)
    pausing = _PausingStore(dist.FileStore(str(tmp_path / "s"), -1))
    result = {}
    a = threading.Thread(target=lambda: result.update(a=membership.Group(pausing, 20).join("a", None)))
    a.start()
    try:
        assert pausing.paused.wait(20)        # "a" read {x} and stalls before writing
        time.sleep(0.5)
        group.join("b", None)
        assert group.leave(rx, ix)            # "x" leaves meanwhile
    finally:
        pausing.release.set()
        a.join(30)
    assert not a.is_alive() and "a" in result
    names = sorted(n for n, _, _ in group.members().values())
    assert names == ["a", "b"], names
    # and both ranks distinct, each with its incarnation
    ranks = {n: r for r, (n, _, _) in group.members().items()}
    assert result["a"][0] == ranks["a"] and len(set(ranks.values())) == 2


def _slow_joiner(rank, world_size, rdv_port, coord_port):
    import distgrad.rpc as rpc
    from distgrad.rpc import membership
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rdv_port}")
    out = {}
    if rank == 0:
        rpc.init_rpc("w0", rank=0, rpc_backend_options=opts)
        store.set("w0_up", "1")
    elif rank == 1:                       # slow: 3 s from taking its rank to publishing
        publish = membership.Group.publish

        def slow_publish(self, *args):
            store.set("slow_in_table", "1")
            _wait(store, "late_waiting")
            time.sleep(3)
            return publish(self, *args)

        membership.Group.publish = slow_publish
        _wait(store, "w0_up")
        rpc.init_rpc("slow", rank=None, rpc_backend_options=opts)
    else:                                 # joins while "slow" is in the table without an address
        addresses = membership.Group.addresses

        def impatient(self, others, deadline, patience=None):
            store.set("late_waiting", "1")
            return addresses(self, others, deadline, patience=1.0)   # instead of 10 s

        membership.Group.addresses = impatient
        _wait(store, "slow_in_table")
        rpc.init_rpc("late", rank=None, rpc_backend_options=opts)
    store.add("up", 1)
    _until(lambda: int(store.add("up", 0)) == 3, 60)
    out["names"] = _names()
    other = {1: "late", 2: "slow"}.get(rank)
    if other is not None:
        try:
            out["call"] = rpc.rpc_sync(other, torch.add, args=(torch.ones(1), rank), timeout=20).tolist()
        except Exception as e:  # noqa: BLE001
            out["call"] = f"{type(e).__name__}: {e}"
    store.add("called", 1)
    _until(lambda: int(store.add("called", 0)) == 3, 60)
    rpc.shutdown()
    return out


def test_a_slow_but_live_joiner_is_not_skipped():
    """A joiner 3 s from taking its rank to publishing its address, and a later joiner
    whose patience is 1 s: the slow one's lease shows it lives, so the later one waits
    for it; all three list each other and the two joiners call each other."""
    rdv = free_port()
    w0, slow, late = _run(_slow_joiner, rdv, timeout=120)
    assert w0["names"] == slow["names"] == late["names"] == ["late", "slow", "w0"], (w0, slow, late)
    assert slow["call"] == [2.0] and late["call"] == [3.0], (slow, late)


def _static_then_dynamic(rank, world_size, path, coord_port):
    import distgrad.rpc as rpc
    store = _coord(coord_port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
    out = {}
    if rank < 2:                          # a static group of two on the file store
        rpc.init_rpc(f"s{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        assert rpc.rpc_sync(f"s{1 - rank}", torch.add, args=(torch.ones(1), 1)).tolist() == [2.0]
        store.add("static_up", 1)
        _until(lambda: int(store.add("static_up", 0)) == 2, 60)
        _wait(store, "tried")             # live until the joiner has tried
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)      # never counts itself out
        rpc.shutdown()                    # the survivor shuts down (its peer is lost)
        store.set("static_gone", "1")
        return out
    _until(lambda: int(store.add("static_up", 0)) == 2, 60)
    try:                                  # the static group lives: torch's refusal
        rpc.init_rpc("d0", rank=None, rpc_backend_options=opts)
        out["while_static"] = "joined"
        rpc.shutdown()
    except RuntimeError as e:
        out["while_static"] = str(e)
    store.set("tried", "1")
    _wait(store, "static_gone")
    rpc.init_rpc("d0", rank=None, rpc_backend_options=opts)   # it is gone: a dynamic group starts
    out["rank"] = rpc.get_worker_info().id
    out["call"] = rpc.rpc_sync("d0", torch.add, args=(torch.ones(1), 2)).tolist()
    rpc.shutdown()
    return out


def test_dynamic_group_starts_on_a_file_store_after_a_killed_static_group(tmp_path):
    """A static group on a file:// store loses a member to SIGKILL (it never counts
    itself out) and the other shuts down; a dynamic group then starts on the same
    file. While the static group was live, a dynamic joiner was refused (torch)."""
    path = tmp_path / "store"
    w = _run(_static_then_dynamic, str(path), expect_exit={1}, timeout=120)
    dyn = w[2]
    assert "mixes statically and dynamically" in dyn["while_static"], dyn
    assert dyn["rank"] == 0 and dyn["call"] == [3.0], dyn


def test_unit_static_ledger_counts_out_members_nobody_listens_for(tmp_path):
    """The ledger's liveness evidence: an entry whose address accepts a connection is
    a live static member (refusal); one whose address refuses is counted out."""
    import socket

    from distgrad.rpc import membership, mixing
    store = dist.FileStore(str(tmp_path / "s"), -1)
    with socket.create_server(("127.0.0.1", 0)) as live:
        dead = socket.create_server(("127.0.0.1", 0))   # bound while live is: another port (the
        dead_port = dead.getsockname()[1]               # kernel may hand a port it freed again)
        dead.close()                                    # nobody listens there any more
        mixing.count_in(store, "dead", f"tcp://127.0.0.1:{dead_port}#host=x")
        slot = mixing.count_in(store, "live", f"tcp://127.0.0.1:{live.getsockname()[1]}#host=x")
        assert mixing.live_static_member(store) == "live"
        with pytest.raises(RuntimeError, match="static member 'live' runs on this store"):
            membership.Group(store, timeout=5).join("d", None)
        assert mixing.count_out(store, slot) and not mixing.count_out(store, slot)
    assert mixing.live_static_member(store) is None
    assert membership.Group(store, timeout=5).join("d", None)[:2] == (0, 2)


def _tamper_group(store, timeout: float = 5.0):
    """A Group with the workers' secret (tests/mp_utils.py), as a member keeps it."""
    from distgrad.launch import rendezvous
    from distgrad.rpc import membership
    return membership.Group(store, timeout=timeout,
                            seal=rendezvous.store_seal(store, b"distgrad-tests"))


def _live_member(group, name: str) -> tuple[int, int]:
    """``name`` joins as a worker does: its lease moves until it published its address."""
    from distgrad.rpc import membership
    rank, inc, _ = group.join(name, None)
    with membership.Lease(group, rank, time.monotonic() + 30 * SLOW):
        group.publish(rank, inc, f"tcp://127.0.0.1:1#{name}")
    return rank, inc


def test_unit_a_deleted_table_is_tampering_not_a_fresh_group(tmp_path):
    """Issue 42, item 2: a store writer deletes the member table while a member lives.
    The next joiner (a new process: nothing read before) must not start a group of its
    own on the live member's rank: StoreTamperedError naming the key and the store,
    whether the table alone, or the table and its marker, were deleted. (Before: the
    joiner took rank 0, incarnation 1, in a table of its own.)"""
    from distgrad.errors import StoreTamperedError
    from distgrad.launch import rendezvous
    store = dist.FileStore(str(tmp_path / "s"), -1)
    live = _tamper_group(store)
    assert _live_member(live, "alive") == (0, 1)
    key = "distgrad/0/dyn/members"
    store.delete_key(key)
    for gone in ([], ["distgrad/0/dyn/genesis"]):   # the table; the table and its marker
        for k in gone:
            store.delete_key(k)
        joiner = _tamper_group(store, timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(StoreTamperedError) as e:
            joiner.join("new", None)
        assert time.monotonic() - t0 < 10 * SLOW         # its timeout, not a hang
        assert key in str(e.value) and rendezvous.describe(store) in str(e.value), e.value
        assert key in e.value.keys and "deleted" in e.value.keys[key], e.value.keys
        assert not store.check([key])                    # nothing written in its place
    # the live member sees the deletion too, and changes nothing
    live.timeout = 0.5
    with pytest.raises(StoreTamperedError, match="deleted"):
        live.leave(0, 1)


def test_unit_a_leave_takes_out_only_the_member_that_leaves(tmp_path):
    """Issue 42, item 2: ``leave`` matched rank and incarnation only, so a member took
    out another process that held the same rank and incarnation after the table was
    tampered with. (1) The table rolled back to before the member joined: a new joiner
    refuses it (rank 0's lease moved, yet the table says rank 0 never had an
    incarnation); with that lease deleted too it takes rank 0, incarnation 1, at the
    same version as the member read last, and the member's leave must not take it out
    (its nonce differs). (2) The whole store wiped (table, marker, lease: a fresh store
    to whoever comes next): the joiner starts a group of its own; the old member
    refuses that table (another group's) and takes no one out of it."""
    from distgrad.errors import StoreTamperedError
    store = dist.FileStore(str(tmp_path / "s"), -1)
    key, lease = "distgrad/0/dyn/members", "distgrad/0/dyn/lease/0"
    _tamper_group(store).join("x", 5)                     # the table exists
    before = store.get(key)
    live = _tamper_group(store)
    assert _live_member(live, "alive") == (0, 1)
    store.set(key, before)                                # rolled back to before "alive"
    with pytest.raises(StoreTamperedError, match=f"rolled back.*{lease}"):
        _tamper_group(store, timeout=0.5).join("new", None)
    store.delete_key(lease)
    joiner = _tamper_group(store)
    assert _live_member(joiner, "new") == (0, 1)          # same rank, same incarnation
    live.timeout = 0.5   # the joiner's table has the version "alive" read last: a fork
    with pytest.raises(StoreTamperedError, match="two different tables of version"):
        live.leave(0, 1)
    _tamper_group(store).join("y", 7)                     # one version more: taken as newer
    live.timeout = 5.0
    assert not live.leave(0, 1)                           # not "alive"'s entry: left alone
    assert _tamper_group(store).members()[0][0] == "new"

    for k in (key, "distgrad/0/dyn/genesis", lease):
        store.delete_key(k)                              # nothing says a group was here
    other = _tamper_group(store)
    assert _live_member(other, "other") == (0, 1)         # (the documented limit)
    joiner.timeout = 0.5
    with pytest.raises(StoreTamperedError, match="another group"):
        joiner.leave(0, 1)
    assert _tamper_group(store).members()[0][0] == "other"


def test_unit_a_missing_or_forged_marker_costs_nothing(tmp_path):
    """The marker is written after the table (a joiner may die in between): a table
    without its marker, or with one that fails authentication, is joined as usual and
    the marker written again; a forged marker on a fresh store starts no alarm."""
    store = dist.FileStore(str(tmp_path / "s"), -1)
    marker = "distgrad/0/dyn/genesis"
    store.set(marker, b"DGS1" + bytes(range(32)) + b'{"genesis":"' + b"ab" * 16 + b'"}')
    first = _tamper_group(store)
    assert _live_member(first, "a") == (0, 1)                # a fresh store: a new group
    for tamper in (lambda: store.delete_key(marker), lambda: store.set(marker, b"junk")):
        tamper()
        group = _tamper_group(store)
        assert _live_member(group, f"b{len(group.members())}")[1] == 1
        assert group.genesis == first.genesis
        assert _tamper_group(store)._made() == first.genesis   # written again


def test_unit_a_replayed_table_written_over_is_a_fork_the_members_refuse(tmp_path):
    """Issue 42's second audit: a store writer with no secret copies an older sealed
    table (rank 1 had left) and writes it back after rank 1 rejoined. A fresh joiner
    cannot tell it from the latest and writes the next version over it, taking rank 1
    in the table; the members, which read the newer table of that same version, refuse
    the fork with StoreTamperedError (before: they took it, and the live rank 1 was
    out of the group's table). The joiner's handshake is refused by the members (not
    checked here), so no group forms on the live member's rank."""
    from distgrad.errors import StoreTamperedError
    store = dist.FileStore(str(tmp_path / "s"), -1)
    key = "distgrad/0/dyn/members"
    a, b = _tamper_group(store), _tamper_group(store)
    ra, ia, _ = a.join("a", None)
    a.publish(ra, ia, "addr-a")
    rb, ib, _ = b.join("b", None)
    b.publish(rb, ib, "addr-b")
    b.leave(rb, ib)
    snapshot = bytes(store.get(key))      # sealed bytes any reader of the store can copy
    b2 = _tamper_group(store)
    rb2, ib2, _ = b2.join("b2", None)
    b2.publish(rb2, ib2, "addr-b2")
    assert sorted(a.members()) == [ra, rb2]
    store.set(key, snapshot)              # the replay
    c = _tamper_group(store, timeout=0.5)
    rc, ic, _ = c.join("c", None)
    c.publish(rc, ic, "addr-c")
    for member in (a, b2):
        member.timeout = 0.5
        with pytest.raises(StoreTamperedError, match="two different tables of version"):
            member.members()
