"""One rendezvous per process: a gloo process group and distgrad's RPC share one
MASTER_PORT (both orders, both shutdown orders, a second init_rpc on a store that
outlived the first), torchrun's agent store, and the error when the port is held
by something that is not a store."""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from mp_utils import free_port, run_workers

import distgrad.rpc as rpc
from distgrad.errors import DistgradError

USES_STORE_PROCESS = True   # rank 0 hosts its store as users get it (tests/mp_utils.py)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def _rpc_work(rank: int, world_size: int) -> None:
    """rpc_sync to the next worker and, on rank 0, a distributed backward through
    it whose gradient matches torch's local autograd."""
    import distgrad.autograd as dist_autograd

    peer = f"worker{(rank + 1) % world_size}"
    assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank)).tolist() == [1.0 + rank] * 2
    if rank != 0:
        return
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, generator=g, requires_grad=True)
    w = torch.randn(3, generator=g)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync(peer, torch.mul, args=(x, x))
        dist_autograd.backward(cid, [(y * w).sum()])
        got = dist_autograd.get_gradients(cid)[x]
    x_local = x.detach().clone().requires_grad_()
    (x_local * x_local * w).sum().backward()
    torch.testing.assert_close(got, x_local.grad)


def _all_reduce(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _store_alive(store, rank: int, key: str) -> None:
    """Rank 1 writes ``key``, rank 0 reads it: the store's server (rank 0) still serves."""
    if rank == 1:
        store.set(key, b"ok")
    else:
        store.wait([key], timedelta(seconds=30))
        assert store.get(key) == b"ok"


def _shared_port(rank: int, world_size: int, port_a: int, port_b: int) -> None:
    import torch.distributed as dist

    from distgrad.rpc.agent import agent_or_none

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size))

    # A: process group first (env://; it hosts the store on rank 0), then RPC on
    # tcp:// to the same port. The group goes first; RPC keeps the server alive.
    os.environ["MASTER_PORT"] = str(port_a)
    dist.init_process_group("gloo")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port_a}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    _all_reduce(rank, world_size)
    _rpc_work(rank, world_size)
    dist.destroy_process_group()
    gc.collect()
    _store_alive(agent_or_none().store, rank, "after-pg")
    _rpc_work(rank, world_size)
    rpc.shutdown()

    # B: RPC first (env://; it hosts the store on rank 0), then the process group on
    # the same port. RPC goes first: its shutdown leaves the group's store working.
    os.environ["MASTER_PORT"] = str(port_b)
    rpc.init_rpc(f"worker{rank}")
    store_ref = weakref.ref(agent_or_none().store)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_b}", rank=rank,
                            world_size=world_size)
    _all_reduce(rank, world_size)
    _rpc_work(rank, world_size)
    rpc.shutdown()
    gc.collect()
    assert store_ref() is None, "rpc.shutdown kept its store"
    _store_alive(dist.distributed_c10d._get_default_store(), rank, "after-rpc")
    _all_reduce(rank, world_size)

    # A second init_rpc on the store that outlived the first (its keys still there).
    rpc.init_rpc(f"worker{rank}")
    _rpc_work(rank, world_size)
    rpc.shutdown()
    _all_reduce(rank, world_size)
    dist.destroy_process_group()


def test_process_group_and_rpc_share_master_port():
    run_workers(_shared_port, world_size=2, init=False, timeout=100,
                args=(free_port(), free_port()))


def test_torchrun_agent_store():
    """Under torchrun the agent hosts the store; every rank connects as a client."""
    script = ROOT / "tests" / "launch_scripts" / "rdzv_shared.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               DISTGRAD_SECRET="distgrad-tests", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    story = f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, story
    for rank in range(2):
        assert f"OK rank={rank} agent_store=True" in proc.stdout, story
    # No worker tried to host a store on the agent's port (torch would log that it
    # failed to bind and fall back to a client).
    assert "failed to bind" not in proc.stderr, story


def test_port_held_by_something_else():
    """A port held by a program that is not a store: an error naming the address."""
    from distgrad.launch import rendezvous

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # rank 0 cannot host the store there
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        with pytest.raises(DistgradError, match=f"worker 'worker0'.*127.0.0.1:{port}.*held by another"):
            rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)
        assert rpc.api.agent_or_none() is None

        # another rank reaches it, but it hangs up on the store's handshake
        def hang_up():
            for _ in range(10):
                try:
                    conn, _ = held.accept()
                except OSError:
                    return
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        with pytest.raises(DistgradError, match=f"worker 'worker1'.*cannot reach .* at 127.0.0.1:{port}"):
            rendezvous.make_store(f"tcp://127.0.0.1:{port}", 1, 2, 1.0, name="worker1")


def test_agent_store_only_on_master_port(monkeypatch):
    """Under torchrun rank 0 hosts nothing on MASTER_PORT (the agent does), but
    still hosts a tcp:// store on another port."""
    from distgrad.launch import rendezvous

    agent_port, other_port = free_port(), free_port()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    store = rendezvous.make_store(f"tcp://127.0.0.1:{other_port}", 0, 1, 5.0, name="worker0")
    store.set("k", b"v")
    assert store.get("k") == b"v"
    # nothing serves the agent's port here: rank 0 is a client, so it cannot connect
    with pytest.raises(DistgradError, match=f"cannot reach .* at 127.0.0.1:{agent_port}"):
        rendezvous.make_store("env://", 0, 1, 1.0, name="worker0")
