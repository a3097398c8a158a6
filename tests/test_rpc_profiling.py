"""Caller-side RPC profiling: the callee's events in the caller's legacy profile
(distgrad/rpc/remote_profiling.py), on real workers."""
from __future__ import annotations

import json
import os
import tempfile

import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

from distgrad.rpc.functions import async_execution
from tests.mp_utils import free_port, run_workers

REMOTE_OP = "#remote_op: "


def _ops():
    with torch.autograd.profiler.record_function("##block##"):
        t = torch.add(torch.ones(4), torch.ones(4))
        return t.relu().sum()


def _sleep_mul(x):
    import time
    time.sleep(0.05)
    return torch.mul(x, x)


@async_execution
def _async_nested(to, x):
    import distgrad.rpc as rpc
    return rpc.rpc_async(to, _sleep_mul, args=(x,))


def _fails():
    raise ValueError("boom")


def _key(mode, name, src, dst):
    return f"{mode}#{name}({src} -> {dst})"


def _remote_names(events, key):
    prefix = key + REMOTE_OP
    return {e.name[len(prefix):]: e for e in events if e.is_remote and e.name.startswith(prefix)}


def _caller(rank, ws):
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    # rpc_async with a record_function block on the callee
    with legacy_profile() as prof:
        assert float(rpc.rpc_async("worker1", _ops).wait()) == 8.0
    events = prof.function_events
    key = _key("rpc_async", _ops.__qualname__, "worker0", "worker1")
    own = [e for e in events if e.name == key]
    assert len(own) == 1 and not own[0].is_remote and own[0].node_id == 0, own
    remote = _remote_names(events, key)
    for name in ("##block##", "aten::add", "aten::relu", "aten::sum", "aten::ones"):
        assert name in remote, sorted(remote)
        assert remote[name].node_id == 1 and remote[name].is_remote
    # every local event carries this worker's rank; remote ones lie inside the RPC's event
    assert all(e.node_id == 0 for e in events if not e.is_remote and e.name != "[memory]")
    for e in remote.values():
        assert own[0].time_range.start <= e.time_range.start <= e.time_range.end <= own[0].time_range.end
    # the callee's block is a tree of the callee's ops
    children = {c.name for c in remote["##block##"].cpu_children}
    assert key + REMOTE_OP + "aten::add" in children, children
    # the first event naming the RPC is the caller's own
    assert next(e for e in events if "rpc_async" in e.name) is own[0]

    # rpc_sync of a builtin, with shapes and memory
    with legacy_profile(record_shapes=True, profile_memory=True) as prof:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(100), torch.ones(100)))
    key = _key("rpc_sync", "aten::add", "worker0", "worker1")
    remote = _remote_names(prof.function_events, key)
    assert remote["aten::add"].input_shapes == [[100], [100], []], remote["aten::add"].input_shapes
    assert remote["aten::add"].cpu_memory_usage == 400, remote["aten::add"].cpu_memory_usage
    with legacy_profile() as prof:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(100), torch.ones(100)))
    remote = _remote_names(prof.function_events, key)
    assert remote["aten::add"].input_shapes == [] and remote["aten::add"].cpu_memory_usage == 0

    # remote(), to another worker and to this one: the value is the callee's, the events are merged
    for dst in ("worker1", "worker0"):
        with legacy_profile() as prof:
            rref = rpc.remote(dst, torch.mul, args=(torch.ones(2), 3))
            assert torch.equal(rref.to_here(), torch.full((2,), 3.0))
            rref._get_profiling_future().wait()
        key = _key("rpc_remote", "aten::mul", "worker0", dst)
        remote = _remote_names(prof.function_events, key)
        assert "aten::mul" in remote, (dst, [e.name for e in prof.function_events])
        assert remote["aten::mul"].node_id == int(dst[-1])

    # a call that fails: its error as is, no remote events
    with legacy_profile() as prof:
        try:
            rpc.rpc_sync("worker1", _fails)
            raise AssertionError("no error")
        except ValueError as e:
            assert "boom" in str(e)
    assert not [e for e in prof.function_events if e.is_remote]

    # the chrome trace names the remote events
    with legacy_profile() as prof:
        rpc.rpc_async("worker1", _ops).wait()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        names = [e["name"] for e in json.load(f)]
    assert any(n.endswith(REMOTE_OP + "aten::relu") for n in names), names
    averages = {a.key for a in prof.key_averages()}
    assert _key("rpc_async", _ops.__qualname__, "worker0", "worker1") + REMOTE_OP + "aten::add" in averages
    return True


def test_remote_events_in_callers_profile():
    assert run_workers(_caller, world_size=2, timeout=120)[0]


def _nested_caller(rank, ws):
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    x = torch.ones(2)
    # the callee (worker1) calls worker2 from an async function: worker2's events come
    # back through worker1, under both keys, with worker2's rank
    with legacy_profile() as prof:
        assert torch.equal(rpc.rpc_async("worker1", _async_nested, args=("worker2", x)).wait(), x * x)
    outer = _key("rpc_async", _async_nested.__qualname__, "worker0", "worker1")
    inner = _key("rpc_async", _sleep_mul.__qualname__, "worker1", "worker2")
    events = prof.function_events
    hop = [e for e in events if e.name == outer + REMOTE_OP + inner]
    assert len(hop) == 1 and hop[0].node_id == 1 and hop[0].is_remote, [e.name for e in events]
    mul = [e for e in events if e.name == outer + REMOTE_OP + inner + REMOTE_OP + "aten::mul"]
    assert len(mul) == 1 and mul[0].node_id == 2, [e.name for e in events]
    return True


def test_nested_async_remote_events():
    assert run_workers(_nested_caller, world_size=3, timeout=120)[0]


def _hooks(rank, ws):
    """Without RPC the profiler is torch's own; with RPC up and no RPC made, a
    profile's events are what torch's parser gives."""
    import torch.autograd.profiler_legacy as pl

    import distgrad.rpc as rpc
    from distgrad.rpc import remote_profiling
    assert pl._parse_legacy_records is remote_profiling._parse_hook
    with legacy_profile() as prof:
        torch.ones(2) + 1
    assert not [e for e in prof.function_events if e.is_remote]
    assert {e.node_id for e in prof.function_events if e.name.startswith("aten::")} == {rank}
    rpc.shutdown()
    assert pl._parse_legacy_records is remote_profiling._originals.get("parse", pl._parse_legacy_records)
    assert pl.profile._start_trace is not remote_profiling._start_trace_hook
    return True


def _hooks_entry(rank, ws):
    import torch.autograd.profiler_legacy as pl

    import distgrad.rpc as rpc
    from distgrad.rpc import remote_profiling
    original = pl._parse_legacy_records
    opts = rpc.TensorPipeRpcBackendOptions(init_method=os.environ["DG_INIT"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=ws, rpc_backend_options=opts)
    assert original is not remote_profiling._parse_hook
    return _hooks(rank, ws) and pl._parse_legacy_records is original


def test_hooks_only_while_rpc_is_up():
    env = {r: {"DG_INIT": f"tcp://127.0.0.1:{free_port()}"} for r in range(1)}
    assert run_workers(_hooks_entry, world_size=1, timeout=60, init=False, env_per_rank=env) == [True]
