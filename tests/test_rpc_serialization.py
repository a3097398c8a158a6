"""What can travel in RPC arguments and results, and how failures to travel look."""
import os
import sys
import tempfile
import time

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


class _RefusesPickling:
    def __reduce__(self):
        raise RuntimeError("this value refuses to be pickled")


def return_refusing():
    return _RefusesPickling()


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
    # ... and any other error while the reply is made (a value's __reduce__, a device
    # copy failing while staged): the caller gets it at once, not the call's timeout
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        rpc.rpc_sync("worker1", return_refusing, timeout=60)
    assert time.monotonic() - t0 < 30
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


# -- every kind of tensor, forward in a call and back as a gradient ----------------
def _kinds(requires_grad):
    """Tensors of every kind the wire carries, fresh each call (leaves when requires_grad)."""
    torch.manual_seed(0)
    base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
    z = torch.randn(4, 3, dtype=torch.complex128)
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([1., 2., 3., 4.]), (3, 3))
    kinds = {
        "one": torch.tensor([0.5], dtype=torch.float64),
        "zero_dim": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "stride0_one": torch.ones(1).as_strided((1,), (0,)),
        "expanded": torch.tensor([1., 2., 3.]).expand(4, 3),
        "offset": base.reshape(-1)[7:19],
        "noncontig": base.permute(2, 0, 1)[:, ::2],
        "conj": z.conj(),
        "neg": torch.randn(3)._neg_view(),
        "param": torch.nn.Parameter(torch.randn(2, 3)),
        "coo": coo,
        "coo_coalesced": coo.coalesce(),
        "coo_hybrid": torch.sparse_coo_tensor(i[:1], torch.randn(4, 2), (3, 2)),
    }
    if requires_grad:
        kinds = {k: (v if isinstance(v, torch.nn.Parameter) else v.detach().clone().requires_grad_())
                 for k, v in kinds.items()}
        # clone() compacts views: keep a stride-0 one-element leaf as such
        kinds["stride0_one"] = torch.ones(1).as_strided((1,), (0,)).requires_grad_()
    return kinds


def _describe_all(d):
    return {k: describe(v) for k, v in d.items()}


def _loss_of(d):
    """A scalar touching every tensor: sparse ones through sparse ops, so that their
    gradients are sparse; complex ones through abs()."""
    total = 0
    for k, v in sorted(d.items()):
        if v.layout == torch.sparse_coo:
            total = total + torch.sparse.sum(v * 2.0) * (len(k) % 3 + 1)
        elif v.is_complex():
            total = total + (v * v).abs().sum()
        elif v.numel():
            total = total + (v * v).sum() * (len(k) % 5 + 1)
    return total


def _grads_equal(got, want, name):
    assert got is not None, name
    assert got.layout == want.layout and got.shape == want.shape and got.dtype == want.dtype, \
        (name, got, want)
    if got.layout == torch.sparse_coo:
        got, want = got.coalesce(), want.coalesce()
        assert torch.equal(got.indices(), want.indices()), name
        got, want = got.values(), want.values()
    assert torch.allclose(got, want), (name, got, want)


def _all_kinds(rank, world_size):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    for requires_grad in (False, True):
        sent = _kinds(requires_grad)
        back = rpc.rpc_sync("worker1", echo, args=(sent,))
        desc = rpc.rpc_sync("worker1", _describe_all, args=(sent,))
        for k, v in sent.items():
            b = back[k]
            assert type(b) is type(v) and b.dtype == v.dtype and b.shape == v.shape, k
            assert b.layout == v.layout and b.requires_grad == v.requires_grad, k
            assert desc[k][3] == str(v.layout) and desc[k][4] == v.requires_grad, (k, desc[k])
            if v.layout == torch.sparse_coo:
                assert b.is_coalesced() == v.is_coalesced(), k
                assert torch.equal(b.detach().to_dense(), v.detach().to_dense()), k
            else:
                assert torch.equal(b.detach(), v.detach().resolve_conj().resolve_neg()), k
                # views keep their strides, as in torch (expanded ones stay at stride 0)
                assert v.is_contiguous() or b.stride() == v.stride(), (k, b.stride(), v.stride())
        assert back["expanded"].stride() == (0, 1) or requires_grad
    # one-element (also at stride 0), zero-element and 0-dim tensors of every dtype the wire allows
    from distgrad.wire.pickler import _DTYPES
    for dtype in _DTYPES.values():
        one = torch.zeros(1, dtype=dtype)
        cases = [one, one.as_strided((1,), (0,)), one.reshape(()), torch.empty(0, 2, dtype=dtype)]
        outs = rpc.rpc_sync("worker1", echo, args=(cases,))
        for a, b in zip(cases, outs):
            assert (b.dtype, b.shape) == (a.dtype, a.shape), (dtype, a.shape)
            raw = [x.new_empty(x.shape).copy_(x).view(torch.uint8) for x in (a, b) if x.dim()]
            assert torch.equal(raw[0], raw[1]) if raw else b.dim() == 0
    # CSR: refused on the caller, as torch.distributed.rpc refuses it; nothing is sent
    rpc.rpc_sync("worker1", echo, args=(1,))
    m0, _ = _sent()
    with pytest.raises(rpc.SerializationError, match="sparse_csr"):
        rpc.rpc_sync("worker1", echo, args=(torch.eye(2).to_sparse_csr(),))
    assert _sent()[0] == m0
    # forward in a call under distributed autograd, gradients back through the wire
    local = _kinds(True)
    _loss_of(local).backward()
    remote = _kinds(True)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", _loss_of, args=(remote,))
        assert loss.grad_fn is not None
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
    for k, v in remote.items():
        if local[k].grad is None:  # the empty tensor: no gradient either way
            assert k == "empty" and grads.get(v) is None
            continue
        if type(v) is torch.nn.Parameter:
            # as in torch: a Parameter travels as its data and arrives as a new leaf
            # Parameter, so no gradient comes back through the wire for it
            assert grads.get(v) is None and v.grad is None, k
            continue
        _grads_equal(grads.get(v), local[k].grad, k)
        assert v.grad is None, k  # the context's gradients, never .grad
    assert grads[remote["coo"]].layout == torch.sparse_coo
    assert grads[remote["stride0_one"]].shape == (1,)
    return True


def test_every_tensor_kind_forward_and_as_gradient():
    assert run_workers(_all_kinds, world_size=2, timeout=150) == [True, None]


# -- sparse gradients: embeddings on a parameter server, sparse results ------------
class EmbeddingServer:
    """Lives on worker1: an EmbeddingBag and an Embedding with sparse gradients."""

    def __init__(self):
        torch.manual_seed(1)
        self.bag = torch.nn.EmbeddingBag(16, 4, mode="sum", sparse=True)
        self.emb = torch.nn.Embedding(16, 4, sparse=True)
        self.table = torch.nn.Parameter(torch.randn(5, 3).to_sparse())

    def forward(self, ids, offsets, weights):
        return self.bag(ids, offsets, weights) + self.emb(ids[:2]).sum(0)

    def sparse_part(self, scale):
        return self.table * scale  # a sparse result that requires grad

    def grads(self, cid):
        import distgrad.autograd as dist_autograd
        g = dist_autograd.get_gradients(cid)
        return [g.get(p) for p in (self.bag.weight, self.emb.weight, self.table)]


def _call(rref, method, *args):
    return getattr(rref.local_value(), method)(*args)


def _embeddings(rank, world_size):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4])
    weights = torch.rand(8, requires_grad=True)
    scale = torch.tensor(3.0, requires_grad=True)
    # the oracle: the same server here, two backward passes accumulating into .grad
    local = EmbeddingServer()
    for _ in range(2):
        out = local.forward(ids, offsets, weights)
        (out.sum() + torch.sparse.sum(local.sparse_part(scale))).backward()
    want = [local.bag.weight.grad, local.emb.weight.grad, local.table.grad]
    assert all(w.layout == torch.sparse_coo for w in want)
    want_w, want_s = weights.grad.clone(), scale.grad.clone()
    weights.grad = scale.grad = None

    server = rpc.remote("worker1", EmbeddingServer)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", _call, args=(server, "forward", ids, offsets, weights))
        part = rpc.rpc_sync("worker1", _call, args=(server, "sparse_part", scale))
        assert part.layout == torch.sparse_coo and part.requires_grad
        loss = out.sum() + torch.sparse.sum(part)
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss])  # sparse gradients accumulate in the context
        got = rpc.rpc_sync("worker1", _call, args=(server, "grads", cid))
        mine = dist_autograd.get_gradients(cid)
    for name, g, w in zip(("bag", "emb", "table"), got, want):
        assert g.layout == torch.sparse_coo, name  # sparse + sparse stays sparse
        _grads_equal(g, w, name)
    _grads_equal(mine[weights], want_w, "per_sample_weights")
    _grads_equal(mine[scale], want_s, "scale")
    # on one worker, inside a context: sparse, then dense on top of sparse
    emb = torch.nn.Embedding(10, 3, sparse=True)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [emb(ids).sum()])
        first = dist_autograd.get_gradients(cid)[emb.weight]
        assert first.layout == torch.sparse_coo
        dense_loss = (emb.weight * torch.arange(30.).reshape(10, 3)).sum()
        dist_autograd.backward(cid, [dense_loss])
        total = dist_autograd.get_gradients(cid)[emb.weight]
    expected = torch.zeros(10, 3).index_add_(0, ids, torch.ones(8, 3)) + torch.arange(30.).reshape(10, 3)
    assert total.layout == torch.strided and torch.equal(total, expected)
    assert emb.weight.grad is None
    return True


def test_sparse_gradients_parameter_server_and_local():
    assert run_workers(_embeddings, world_size=2, timeout=150) == [True, None]
