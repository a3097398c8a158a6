"""What can travel in RPC arguments and results, and how failures to travel look."""
import os
import sys
import tempfile

import pytest
import torch
from mp_utils import run_workers

import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(180)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.bool]


def echo(x):
    return x


def describe(x):
    """Runs on the callee: what it received (types, dtypes, shapes, layouts)."""
    if isinstance(x, torch.Tensor):
        return (type(x).__name__, str(x.dtype), tuple(x.shape), str(x.layout), x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x).__name__, [describe(v) for v in x]
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    return repr(x)


def boom(msg):
    raise ValueError(msg)


class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def raise_two_arg():
    raise TwoArgError(1, 2)


def return_lambda():
    return lambda: 1


def big_roundtrip(t):
    assert t.is_contiguous() and t.numel() == 64 * 2**20
    return t.add_(1)


def _sent(peer="worker1"):
    info = rpc._get_debug_info()[f"peer.{peer}"]
    return info["messages_sent"], info["bytes_sent"]


def _sample(dtype):
    if dtype == torch.bool:
        return torch.tensor([[True, False], [False, True]])
    if dtype.is_complex:
        return torch.randn(3, 2, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(3, 4).to(dtype)
    return torch.arange(12).reshape(3, 4).to(dtype)


def _serialization(rank, world_size):
    if rank != 0:
        return None
    # every dtype, through rpc_sync both ways
    for dtype in DTYPES:
        t = _sample(dtype)
        out = rpc.rpc_sync("worker1", echo, args=(t,))
        assert out.dtype == dtype and torch.equal(out, t), dtype
    # 0-dim, empty, non-contiguous, requires_grad (a leaf is rebuilt as a leaf)
    base = torch.arange(30.).reshape(5, 6)
    cases = [torch.tensor(7), torch.empty(0), torch.empty(3, 0, 2, dtype=torch.int32),
             base.t(), base[::2, 1::3], torch.ones(1, 4).expand(3, 4),
             torch.randn(2, dtype=torch.complex64).conj(), torch.ones(3, requires_grad=True)]
    outs = rpc.rpc_sync("worker1", echo, args=(cases,))
    for a, b in zip(cases, outs):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.detach().resolve_conj(), b.detach())
    assert outs[0].dim() == 0 and outs[-1].requires_grad
    # a view of a large tensor sends the bytes it covers, not the storage
    big = torch.zeros(10 * 2**20)  # 40 MB
    rpc.rpc_sync("worker1", echo, args=(1,))  # the peer's stats row exists
    m0, b0 = _sent()
    out = rpc.rpc_sync("worker1", echo, args=(big[1000:1010],))
    m1, b1 = _sent()
    assert out.shape == (10,) and m1 - m0 == 1 and b1 - b0 < 4096, (m1 - m0, b1 - b0)
    out = rpc.rpc_sync("worker1", echo, args=(big[::2**20],))
    m2, b2 = _sent()
    assert out.shape == (10,) and b2 - b1 < 4096
    # the same tensor twice travels once and keeps its identity
    t = torch.randn(1000)
    a, b = rpc.rpc_sync("worker1", echo, args=([t, t],))
    assert a is b and torch.equal(a, t)
    # sparse COO, nested containers, nn.Parameter
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([5., 6.]), (3, 3))
    param = torch.nn.Parameter(torch.randn(3))
    nested = {"sparse": sp, "param": param, "list": [torch.ones(2), (torch.zeros(1), 3, "s")],
              "tuple": (None, 1.5, {"deep": [[torch.tensor(True)]]})}
    desc = rpc.rpc_sync("worker1", describe, args=(nested,))
    assert desc["sparse"] == ("Tensor", "torch.float32", (3, 3), "torch.sparse_coo", False)
    assert desc["param"] == ("Parameter", "torch.float32", (3,), "torch.strided", True)
    assert desc["list"][0] == "list" and desc["tuple"][0] == "tuple"
    back = rpc.rpc_sync("worker1", echo, args=(nested,))
    assert torch.equal(back["sparse"].to_dense(), sp.to_dense())
    assert isinstance(back["param"], torch.nn.Parameter) and torch.equal(back["param"], param)
    assert back["tuple"][2]["deep"][0][0].item() is True
    assert back["list"][1][1:] == (3, "s")
    # builtins and module-level functions
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 2)), torch.full((2,), 3.))
    assert rpc.rpc_sync("worker1", len, args=([1, 2, 3],)) == 3
    assert rpc.rpc_sync("worker1", max, args=(1, 5), kwargs={"key": None}) == 5
    assert rpc.rpc_sync("worker1", echo, args=(echo,)) is echo
    # an unpicklable argument fails on the caller and nothing is sent
    m0, b0 = _sent()
    for bad in (lambda x: x, (torch.ones(2), lambda: 0)):
        with pytest.raises(rpc.SerializationError, match="pickle") as ei:
            rpc.rpc_sync("worker1", echo, args=(bad,))
        assert isinstance(ei.value, TypeError)
        with pytest.raises(rpc.SerializationError):
            rpc.rpc_async("worker1", echo, args=(bad,))
        with pytest.raises(rpc.SerializationError):
            rpc.remote("worker1", echo, args=(bad,))
    with pytest.raises(rpc.SerializationError):
        rpc.rpc_sync("worker1", lambda: 1)
    assert _sent() == (m0, b0)
    assert rpc._get_debug_info()["agent.num_pending_requests"] == 0
    # an unpicklable result fails on the callee; the caller gets an error, not a hang
    with pytest.raises(rpc.SerializationError, match="pickle") as ei:
        rpc.rpc_sync("worker1", return_lambda, timeout=20)
    assert "worker1" in str(ei.value)
    # a function whose module exists only on the caller
    d = tempfile.mkdtemp(prefix="distgrad-only-here-")
    with open(os.path.join(d, "only_on_caller_mod.py"), "w") as f:
        f.write("def f(x):\n    return x + 1\n")
    sys.path.insert(0, d)
    import only_on_caller_mod
    assert only_on_caller_mod.f(1) == 2
    with pytest.raises(Exception) as ei:
        rpc.rpc_sync("worker1", only_on_caller_mod.f, args=(1,), timeout=20)
    assert "only_on_caller_mod" in str(ei.value) and "worker1" in str(ei.value), str(ei.value)
    assert isinstance(ei.value, ImportError), type(ei.value)
    # remote exceptions: original type, message, remote traceback, worker name
    with pytest.raises(ValueError) as ei:
        rpc.rpc_sync("worker1", boom, args=("boom",))
    text = str(ei.value)
    assert text.startswith("On WorkerInfo(id=1, name=worker1):\nValueError('boom')\n"), text
    assert "Traceback" in text and "in boom" in text
    assert ei.value.worker_name == "worker1"
    assert "in boom" in ei.value.remote_traceback and "raise ValueError(msg)" in ei.value.remote_traceback
    fut = rpc.rpc_async("worker1", boom, args=("async boom",))
    with pytest.raises(ValueError, match="async boom"):
        fut.wait()
    # a type that cannot be rebuilt from a message: RemoteError keeps type name and traceback
    with pytest.raises(rpc.RemoteError) as ei:
        rpc.rpc_sync("worker1", raise_two_arg)
    assert ei.value.remote_type.endswith("TwoArgError") and "raise_two_arg" in ei.value.remote_traceback
    assert ei.value.worker_name == "worker1" and isinstance(ei.value, RuntimeError)
    # a 256 MB tensor, there and back
    t = torch.zeros(64 * 2**20)
    out = rpc.rpc_sync("worker1", big_roundtrip, args=(t,), timeout=120)
    assert out.shape == t.shape and out[0].item() == 1 and out[-1].item() == 1
    assert float(out.sum()) == float(t.numel()) and t[0].item() == 0
    return True


def test_serialization():
    # The 256 MB transfer holds up heartbeats behind it (one connection per direction);
    # on a loaded 2-core box that can exceed the default 4 s deadline (open issue,
    # transport): give this test's peers more slack.
    assert run_workers(_serialization, world_size=2, timeout=150,
                       options={"heartbeat_deadline": 30.0}) == [True, None]


# -- large tensors through reused shared-memory segments ---------------------------
_KEPT: list = []
MIB = 1 << 20


def keep(x):
    """Callee: hold a received 1 MiB tensor (a zero-copy view of a segment)."""
    _KEPT.append(x)
    return float(x[0])


def kept_values():
    return [float(t[0]) if bool((t == t[0]).all()) else None for t in _KEPT]


def make(i):
    return torch.full((MIB // 4,), float(i))


def drop_kept():
    _KEPT.clear()
    import gc
    gc.collect()


def segments_created():
    return rpc.api.current_agent().transport._shm_writer.created


def _shared_memory(rank, world_size):
    if rank != 0:
        return None
    transport = rpc.api.current_agent().transport
    assert transport.uses_shm(1)
    # Tensors held on both sides while more are sent: a segment still viewed by a
    # received tensor is never reused, so nothing held is overwritten.
    replies = []
    for i in range(8):
        assert rpc.rpc_sync("worker1", keep, args=(torch.full((MIB // 4,), float(i)),)) == i
        replies.append(rpc.rpc_sync("worker1", make, args=(100 + i,)))
    assert rpc.rpc_sync("worker1", kept_values) == [float(i) for i in range(8)]
    assert [float(r[0]) for r in replies] == [100.0 + i for i in range(8)]
    assert all(bool((r == r[0]).all()) for r in replies)
    mine, theirs = transport._shm_writer.created, rpc.rpc_sync("worker1", segments_created)
    assert mine >= 8 and theirs >= 8  # one per tensor held at once
    # Once dropped, segments are reused: many more transfers, (almost) no new segments.
    replies.clear()
    rpc.rpc_sync("worker1", drop_kept)
    for i in range(30):
        out = rpc.rpc_sync("worker1", echo, args=(torch.full((MIB // 4,), float(i)),))
        assert float(out[0]) == i and float(out[-1]) == i
        del out
    assert transport._shm_writer.created <= mine + 2
    assert rpc.rpc_sync("worker1", segments_created) <= theirs + 2
    return True


def test_large_tensors_through_reused_shared_memory_stay_intact():
    assert run_workers(_shared_memory, world_size=2, timeout=120) == [True, None]
