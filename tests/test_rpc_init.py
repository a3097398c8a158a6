"""init_rpc: init methods, re-init, errors, options."""
import os
import threading

import pytest
import torch
from mp_utils import free_port, run_workers, tmp_path_for

import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(120)


def _distgrad_threads():
    return [t.name for t in threading.enumerate() if "distgrad" in t.name]


def _ping(rank, world_size):
    other = (rank + 1) % world_size
    out = rpc.rpc_sync(other, torch.add, args=(torch.ones(2), rank))
    assert out.tolist() == [1.0 + rank] * 2
    assert rpc.get_worker_info().name == f"worker{rank}"
    assert rpc.get_worker_info() == rpc.WorkerInfo(f"worker{rank}", rank)


def _init_methods(rank, world_size, env_port, tcp_port, file_path):
    assert rpc.is_available()
    assert _distgrad_threads() == []
    with pytest.raises(RuntimeError, match="not been initialized"):
        rpc.rpc_sync(0, torch.add, args=(1, 1))
    rpc.shutdown()  # never initialized: returns quietly

    # env:// with everything in the environment
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(env_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    rpc.init_rpc(f"worker{rank}", backend=rpc.BackendType.TENSORPIPE)
    _ping(rank, world_size)
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    _ping(rank, world_size)  # the failed second init broke nothing
    rpc.shutdown()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        del os.environ[var]
    assert _distgrad_threads() == []

    # tcp://, again in the same process
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{tcp_port}",
                                           num_worker_threads=4, rpc_timeout=30,
                                           device_maps={f"worker{1 - rank}": {"cpu": "cpu"}})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    assert rpc.get_rpc_timeout() == 30
    _ping(rank, world_size)
    rpc.shutdown()
    assert _distgrad_threads() == []

    # file://
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{file_path}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    assert rpc.get_rpc_timeout() == rpc._DEFAULT_RPC_TIMEOUT_SEC
    _ping(rank, world_size)
    rpc.shutdown()
    assert _distgrad_threads() == []
    return True


def test_init_methods_and_reinit():
    ports = (free_port(), free_port())
    assert run_workers(_init_methods, world_size=2, timeout=90, init=False,
                       args=(*ports, tmp_path_for("store"))) == [True, True]


def _duplicate_names(rank, world_size, port, port2):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    with pytest.raises(RuntimeError) as ei:
        rpc.init_rpc("dup", rank=rank, world_size=world_size, rpc_backend_options=opts)
    msg = str(ei.value)
    want = f"RPC worker name dup is not unique. Workers {rank} and {1 - rank} share the same name."
    assert msg == want, msg
    rpc.shutdown()  # after a failed init: returns
    assert _distgrad_threads() == []
    # a failed init leaves the process able to init properly
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port2}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    _ping(rank, world_size)
    rpc.shutdown()
    assert _distgrad_threads() == []
    return True


def test_duplicate_names_and_shutdown_after_failed_init():
    assert run_workers(_duplicate_names, world_size=2, timeout=90, init=False,
                       args=(free_port(), free_port())) == [True, True]


def test_bad_options_single_process():
    # nothing here starts an agent
    with pytest.raises(ValueError, match="rpc_timeout"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(ValueError, match="num_worker_threads"):
        rpc.TensorPipeRpcBackendOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="heartbeat"):
        rpc.TensorPipeRpcBackendOptions(heartbeat_interval=2, heartbeat_deadline=1)
    # device maps and devices: torch's rules and texts (tests/test_device_maps.py for more)
    with pytest.raises(ValueError, match="`set_devices` expect a list of CUDA devices, but got "
                                         "device type cpu."):
        rpc.TensorPipeRpcBackendOptions(devices=["cpu"])
    assert rpc.TensorPipeRpcBackendOptions(devices=["cuda:1"]).devices == [torch.device("cuda:1")]
    opts = rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {"cpu": "cpu"}})
    with pytest.raises(ValueError, match="`set_device_map` only supports 1-to-1 mapping"):
        opts.set_device_map("worker1", {"cpu": "cuda:0"})
    opts.set_device_map("worker2", {"cpu": "cpu"})
    cpu = torch.device("cpu")
    assert opts.device_maps == {"worker1": {cpu: cpu}, "worker2": {cpu: cpu}}
    assert isinstance(opts, rpc.RpcBackendOptions)
    assert rpc.BackendType.TENSORPIPE in list(rpc.BackendType)
    # init_rpc argument checks fail before any rendezvous
    with pytest.raises(TypeError, match="BackendType"):
        rpc.init_rpc("w", backend="gloo", rank=0, world_size=1)
    with pytest.raises(TypeError, match="rpc_backend_options"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options={"rpc_timeout": 1})
    with pytest.raises(ValueError, match="name"):
        rpc.init_rpc("bad name!", rank=0, world_size=1)
    bad = rpc.TensorPipeRpcBackendOptions(init_method="gloo://x")
    with pytest.raises(ValueError, match="init_method"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=bad)
    tcp = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="rank"):
        rpc.init_rpc("w", rank=-1, world_size=1, rpc_backend_options=tcp)
    with pytest.raises(ValueError, match="out of range"):
        rpc.init_rpc("w", rank=2, world_size=2, rpc_backend_options=tcp)
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        with pytest.raises(ValueError, match="RANK"):
            rpc.init_rpc("w")
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    rpc.shutdown()
    assert _distgrad_threads() == []


def _whoami(caller):
    # Runs on the callee: needs its agent installed (current_agent) and working.
    me = rpc.get_worker_info()
    return me.name, caller, rpc.get_worker_info(caller).id


def _early_calls(rank, world_size, ports):
    for port in ports:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
        # at once, before anyone else can be known to be ready: a request reaching
        # a worker must run only once that worker's agent is installed
        futs = {peer: rpc.rpc_async(peer, _whoami, args=(f"worker{rank}",))
                for peer in range(world_size) if peer != rank}
        for peer, fut in futs.items():
            assert fut.wait() == (f"worker{peer}", f"worker{rank}", rank)
        rpc.shutdown()
    return True


def test_requests_arriving_right_after_init_find_the_worker_ready():
    world_size, rounds = 8, 3
    ports = [free_port() for _ in range(rounds)]
    assert run_workers(_early_calls, world_size=world_size, timeout=150, init=False,
                       args=(ports,)) == [True] * world_size
