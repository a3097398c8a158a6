"""A native region (one engine call that captures its leaves' gradients) keeps what
torch's distributed engine gives: the same gradients as local autograd, the same
copy-or-keep decisions, taken when the gradient is accumulated (torch's
test_no_grad_copy; a hook that kept a gradient and changed it later), hooks run once;
and it never reads or writes a leaf's ``.grad``, which the user owns: a hook reading
it during a pass sees the user's value, and a plain ``backward()`` on another thread
over the same parameters loses no accumulation and changes no context."""
import threading

import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd

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


def _scenarios(rank, world):
    if rank != 0:
        return None
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
    with dist_autograd.context() as cid:
        loss = net(x).pow(2).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss])  # summed in the context
        got = dist_autograd.get_gradients(cid)
    out["user_grad_kept"] = params[0].grad is mine and bool((mine == 7.0).all())
    out["others_none"] = all(p.grad is None for p in params[1:])
    params[0].grad = None
    want = torch.autograd.grad(net(x).pow(2).sum(), params)
    out["exact"] = all(torch.allclose(got[p], 2 * w, rtol=1e-6, atol=1e-7)
                       for p, w in zip(params, want))

    # an AccumulateGrad hook runs once a pass; a post-accumulate-grad hook never runs
    # (torch's distributed engine does not run AccumulateGrad)
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
                    and seen == [] and w.grad is None)

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


def _user_owned(rank, world):
    """Scenarios where the user owns .grad or a gradient a hook kept (run in a fresh
    worker: no post-accumulate-grad hook registered before them)."""
    if rank != 0:
        return None
    out = {}
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(10)])
    params = list(net.parameters())
    x = torch.randn(4, 32)

    # a hook on an intermediate reads a leaf's .grad during the pass: the user's value
    v = torch.ones(3, requires_grad=True)
    v.grad = torch.full((3,), 7.0)
    y = v * 2
    seen_grad = []
    y.register_hook(lambda g: seen_grad.append(None if v.grad is None else v.grad.clone()))
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [(y * 3).sum()])
        gv = dist_autograd.get_gradients(cid)[v]
    out["hook_sees_user_grad"] = (len(seen_grad) == 1 and seen_grad[0] is not None
                                  and torch.equal(seen_grad[0], torch.full((3,), 7.0))
                                  and torch.equal(v.grad, torch.full((3,), 7.0))
                                  and torch.equal(gv, torch.full((3,), 6.0)))

    # a plain backward() on another thread over the same parameter while passes run
    p = params[0]
    p.grad = None
    want = torch.autograd.grad(net(x).sum(), [p])[0]
    stop, count, plain_errs = threading.Event(), [0], []

    def plain():
        try:
            while not stop.is_set():
                (p * 1.0).sum().backward()  # adds exactly ones into p.grad
                count[0] += 1
        except Exception as e:  # noqa: BLE001
            plain_errs.append(repr(e))
    t = threading.Thread(target=plain)
    t.start()
    wrong = 0
    try:
        for _ in range(100):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [net(x).sum()])
                wrong += not torch.allclose(dist_autograd.get_gradients(cid)[p], want, atol=1e-5)
    finally:
        stop.set()
        t.join()
    out["plain_thread"] = (not plain_errs and wrong == 0 and count[0] > 0
                           and bool((p.grad == count[0]).all()))
    p.grad = None

    # a hook keeps the gradient it was given and the user changes it in place before
    # get_gradients: the context holds the value at accumulation (a copy decided then)
    c = torch.ones(4, requires_grad=True)
    d = torch.ones(4, requires_grad=True)
    kept_ok = True
    for extra in (lambda: 0 * d.sum(), lambda: (c + d).sum()):
        stash = []
        h = c.register_hook(lambda g, stash=stash: stash.append(g))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [(c * 2).sum() + extra()])
            expect = stash[0].clone()
            stash[0].zero_()
            kept_ok = kept_ok and torch.equal(dist_autograd.get_gradients(cid)[c], expect)
        h.remove()
    out["kept_then_changed"] = kept_ok
    return out


def test_native_pass_keeps_torchs_semantics():
    res = run_workers(_scenarios, world_size=1, timeout=150)[0]
    assert res == {"two_leaves_copied": True, "kept": True,
                   "user_grad_kept": True, "others_none": True, "exact": True,
                   "hooks": True, "threads": True}


def test_user_owned_grads_left_alone():
    res = run_workers(_user_owned, world_size=1, timeout=150)[0]
    assert res == {"hook_sees_user_grad": True, "plain_thread": True, "kept_then_changed": True}
