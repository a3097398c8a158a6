"""Reentrant activation checkpointing (use_reentrant=True) in a distributed backward:
on a callee, on the caller, inside a region two entries share, and nested; every
gradient (the caller's leaves, the block's parameters on its worker) equal to local
autograd's, and no ``.grad`` written (torch's own distributed autograd fails on all
of these); a checkpoint node run on a thread of its own (as torch runs CUDA nodes)
still belongs to its pass. A block that makes an RPC is refused with a message that
says what to do. The local autograd reference runs in a process that never imported
distgrad (tests/clean_ref.py; this module imports distgrad only where it runs
distributed).
"""
import threading

import clean_ref
import pytest
import torch
from mp_utils import run_workers
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.timeout(240)
MODS: dict = {}


def _mods(dist):
    if dist not in MODS:
        torch.manual_seed(3)
        MODS[dist] = torch.nn.ModuleList([torch.nn.Linear(4, 4).double() for _ in range(3)])
    return MODS[dist]


def _block(dist, x):
    m = _mods(dist)
    return m[1](m[0](x).tanh()).sin()


def _nested(dist, x):
    m = _mods(dist)
    inner = checkpoint(lambda t: m[0](t).tanh(), x, use_reentrant=True)
    return m[2](inner) * 2


def _dist():
    """(distgrad.rpc, distgrad.autograd), imported where a function runs distributed."""
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    return rpc, dist_autograd


def _call(dist, worker, fn, *args):
    return _dist()[0].rpc_sync(f"worker{worker}", fn, args=(dist, *args)) if dist else fn(dist, *args)


def _third(dist, b):
    return b.exp()


class _OffThread(torch.autograd.Function):
    """h -> h; its backward runs h's checkpoint node's backward on a thread of its own
    (as torch runs a CUDA node on its device thread, where nothing of the pass's
    thread is known) and hands its gradient for x on. h itself gets no gradient (its
    node then runs again with zeros, as torch's engine runs it: it adds nothing)."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.node = h.grad_fn
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        box = []
        t = threading.Thread(target=lambda: box.append(ctx.node.apply(g)))
        t.start()
        t.join()
        return None, box[0][-1]  # (fn, preserve_rng_state, dist, x): x's


def _callee(dist, x, kind):
    if kind == "thread":
        return (_OffThread.apply(checkpoint(_block, dist, x, use_reentrant=True), x),)
    if kind == "callee":
        return (checkpoint(_block, dist, x, use_reentrant=True),)
    if kind == "nested":
        return (checkpoint(_nested, dist, x, use_reentrant=True),)
    if kind == "shared":  # h feeds two returns, one also sent on to worker2
        h = checkpoint(_block, dist, x, use_reentrant=True)
        b = h * 3
        return h, b, _call(dist, 2, _third, b)
    if kind == "rpc_inside":
        return (checkpoint(lambda t: _call(dist, 2, _third, t), x, use_reentrant=True),)
    raise ValueError(kind)


def _caller_side(dist, x):
    h = checkpoint(_block, dist, x, use_reentrant=True)  # on the caller, then sent
    return (_call(dist, 1, _third, h) + h,)


def _param_grads(dist, cid):
    ps = list(_mods(dist).parameters())
    if dist:
        assert all(p.grad is None for p in ps)
        g = _dist()[1].get_gradients(cid)
        return [g.get(p) for p in ps]
    return [p.grad for p in ps]


def _run(dist, kind):
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    worker = 0 if kind == "caller" else 1
    if not dist:
        _mods(False).zero_grad(set_to_none=True)
        outs = _caller_side(False, x) if kind == "caller" else _callee(False, x, kind)
        sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
        return [x.grad], _param_grads(False, None)
    rpc, dist_autograd = _dist()
    with dist_autograd.context() as cid:
        outs = _caller_side(True, x) if kind == "caller" else _call(True, 1, _callee, x, kind)
        dist_autograd.backward(cid, [sum((o * (i + 1)).sum() for i, o in enumerate(outs))])
        params = (_param_grads(True, cid) if worker == 0
                  else rpc.rpc_sync("worker1", _param_grads, args=(True, cid)))
        return [dist_autograd.get_gradients(cid)[x]], params


def _same(a, b):
    return len(a) == len(b) and all(
        (p is None and q is None) or (p is not None and q is not None and torch.allclose(p, q, rtol=1e-12))
        for p, q in zip(a, b))


KINDS = ("callee", "caller", "shared", "nested", "thread")


def _local_reference():
    """Every kind's local autograd half (run in the clean reference process)."""
    return {kind: _run(False, kind) for kind in KINDS}


def _main(rank, world, want):
    if rank != 0:
        return None
    want = clean_ref.unpack(want)
    out = {}
    for kind in KINDS:
        (wx, wp), (gx, gp) = want[kind], _run(True, kind)
        out[kind] = (_same(wx, gx), _same(wp, gp), sum(p is not None for p in gp))
    try:
        _run(True, "rpc_inside")
        out["rpc_inside"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["rpc_inside"] = "use_reentrant=False" in str(e)
    return out


def test_reentrant_checkpoint_across_workers():
    want = clean_ref.pack(clean_ref.reference(_local_reference))
    res = run_workers(_main, world_size=3, timeout=200, args=(want,))[0]
    assert res == {
        "callee": (True, True, 4),     # the block's two layers: weight and bias each
        "caller": (True, True, 4),
        "shared": (True, True, 4),
        "nested": (True, True, 4),     # layers 0 and 2
        "thread": (True, True, 4),     # the block's node run on another thread
        "rpc_inside": True,
    }
