"""A native region run as torch's plain backward() (AccumulateGrad writes .grad, read
and put back at once) keeps what torch's distributed engine gives: the same
gradients as local autograd, the same copy-or-keep decisions (torch's
test_no_grad_copy), the leaves' .grad untouched, hooks run once; and a pass that
cannot take that road (two at a time, a post-accumulate-grad hook) captures."""
import threading

import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd
from distgrad.autograd import share

pytestmark = pytest.mark.timeout(180)


class Twice(torch.autograd.Function):
    """Hands its one incoming gradient, the same tensor, to both inputs."""
    ptr = None

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        Twice.ptr = g.data_ptr()
        return g, g


class Once(torch.autograd.Function):
    ptr = None

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        Once.ptr = g.data_ptr()
        return g


_through = [0]  # native regions that ran through .grad in this worker


def _count_through() -> None:
    orig = share.PassState._through_grad

    def counted(self, *args):
        res = orig(self, *args)
        _through[0] += res is not None
        return res
    share.PassState._through_grad = counted


def _scenarios(rank, world):
    if rank != 0:
        return None
    _count_through()
    out = {}
    torch.manual_seed(0)
    a = torch.randn(5, 6, requires_grad=True)
    b = torch.randn(5, 6, requires_grad=True)

    # one tensor for two leaves: copied for both, as torch's distributed engine does
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [Twice.apply(a, b)[1][0]])
        g = dist_autograd.get_gradients(cid)
        out["two_leaves_copied"] = (g[a].data_ptr() != Twice.ptr and g[b].data_ptr() != Twice.ptr
                                    and g[a].data_ptr() != g[b].data_ptr())
    # a gradient nobody else holds is kept (no copy)
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [Once.apply(a)[1][0]])
        out["kept"] = dist_autograd.get_gradients(cid)[a].data_ptr() == Once.ptr

    # a model: exact against local autograd; .grad untouched (a user's .grad stays)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    params = list(net.parameters())
    mine = torch.full_like(params[0], 7.0)
    params[0].grad = mine
    before = _through[0]
    with dist_autograd.context() as cid:
        loss = net(x).pow(2).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss])  # summed in the context
        got = dist_autograd.get_gradients(cid)
    out["native_ran"] = _through[0] - before == 2
    out["user_grad_kept"] = params[0].grad is mine and bool((mine == 7.0).all())
    out["others_none"] = all(p.grad is None for p in params[1:])
    params[0].grad = None
    want = torch.autograd.grad(net(x).pow(2).sum(), params)
    out["exact"] = all(torch.allclose(got[p], 2 * w, rtol=1e-6, atol=1e-7)
                       for p, w in zip(params, want))

    # an AccumulateGrad hook runs once; a post-accumulate-grad hook sees the context's sum
    calls = []
    w = torch.ones(3, requires_grad=True)
    y = w * 2
    y.grad_fn.next_functions[0][0].register_prehook(lambda gs: calls.append(1) or (gs[0] * 3,))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [y.sum()], retain_graph=True)
        dist_autograd.backward(cid, [y.sum()])
        gw = dist_autograd.get_gradients(cid)[w]
    out["hooks"] = (calls == [1, 1] and torch.equal(gw, torch.full((3,), 12.0))
                    and [s.tolist() for s in seen] == [[6.0] * 3, [12.0] * 3] and w.grad is None)

    # two threads, one model, concurrent passes: exact in both
    errs, res = [], {}

    def run(k):
        try:
            for _ in range(20):
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [net(x * k).sum()])
                    res[k] = dist_autograd.get_gradients(cid)
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = not errs and all(p.grad is None for p in params)
    for k in (1.0, 2.0):
        want = torch.autograd.grad(net(x * k).sum(), params)
        ok = ok and all(torch.allclose(res[k][p], q, rtol=1e-6, atol=1e-7)
                        for p, q in zip(params, want))
    out["threads"] = ok
    return out


def test_native_pass_keeps_torchs_semantics():
    res = run_workers(_scenarios, world_size=1, timeout=150)[0]
    assert res == {"two_leaves_copied": True, "kept": True, "native_ran": True,
                   "user_grad_kept": True, "others_none": True, "exact": True,
                   "hooks": True, "threads": True}
