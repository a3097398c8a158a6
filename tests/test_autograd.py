"""Distributed autograd, checked against single-process autograd (the oracle)."""
import time

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)


# -- functions the workers run (module level so they pickle by reference) ----------
def f_mul_sin(x, y):
    return x * y + x.sin()


def f_back_to(dst, x):
    import distgrad.rpc as rpc
    return rpc.rpc_sync(dst, torch.mul, args=(x, 3.0)) + x


def f_chain(path, x):
    """x -> tanh here -> next worker in path -> ... -> times 2 back here."""
    import distgrad.rpc as rpc
    h = torch.tanh(x)
    if path:
        h = rpc.rpc_sync(path[0], f_chain, args=(path[1:], h))
    return h * 2


def known_of(cid):
    import distgrad.autograd as dist_autograd
    if not dist_autograd._is_valid_context(cid):
        return None
    return sorted(dist_autograd._retrieve_context(cid)._known_worker_ids())


def is_valid(cid):
    import distgrad.autograd as dist_autograd
    return dist_autograd._is_valid_context(cid)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


def f_boom(x):
    return Boom.apply(x)


def debug_info():
    import distgrad.autograd as dist_autograd
    return dist_autograd._get_debug_info()


def make_param_loss(x):
    w = getattr(make_param_loss, "w", None)
    if w is None:
        w = make_param_loss.w = torch.arange(3.0, requires_grad=True)
    return (x * w).sum()


def grads_of_param(cid):
    import distgrad.autograd as dist_autograd
    g = dist_autograd.get_gradients(cid)
    return g[make_param_loss.w].clone()


def _wait_until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


# -- contexts, recording, argument checks -----------------------------------------
def _plus(x, y):
    return x + y


def _contexts(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    out = {}
    out["max_id"] = dist_autograd._get_max_id()
    if rank != 1:
        return out
    with dist_autograd.context() as cid:
        out["cid"] = cid
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
            with dist_autograd.context():
                pass
        ctx = dist_autograd._current_context()
        out["same"] = ctx._context_id() == cid and dist_autograd._retrieve_context(cid) is ctx
        # as torch: a builtin operator's call with no tensor requiring grad carries no
        # autograd information (its callee is not known); a Python function's always does
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 1))
        out["known_builtin"] = sorted(ctx._known_worker_ids())
        rpc.rpc_sync("worker2", _plus, args=(torch.ones(2), 1))
        out["known_no_grad"] = sorted(ctx._known_worker_ids())
        out["no_grad_sends"] = len(ctx._send_functions())
        x = torch.ones(3, requires_grad=True)
        y = rpc.rpc_sync("worker0", f_mul_sin, args=(x, x))
        out["recv_name"] = y.grad_fn.name()
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        out["n_send_recv"] = (len(sends), len(recvs))
        send = next(iter(sends.values()))
        out["send_edges_ok"] = [(type(n).__name__, getattr(n, "variable", None) is x)
                                for n, _ in send.next_functions]
        # chain worker1 -> worker2 -> worker0: worker0's copy is released transitively
        rpc.rpc_sync("worker2", f_chain, args=(["worker0"], x))
        out["remote_valid_before"] = rpc.rpc_sync("worker0", is_valid, args=(cid,))
    out["released_here"] = not dist_autograd._is_valid_context(cid)
    out["released_0"] = _wait_until(lambda: not rpc.rpc_sync("worker0", is_valid, args=(cid,)))
    out["released_2"] = _wait_until(lambda: not rpc.rpc_sync("worker2", is_valid, args=(cid,)))
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd._retrieve_context(cid)
    with pytest.raises(RuntimeError, match="Current thread doesn't have a valid autograd context"):
        dist_autograd._current_context()
    # outside a context nothing is recorded: received tensors keep requires_grad, no grad_fn
    x = torch.ones(2, requires_grad=True)
    y = rpc.rpc_sync("worker0", torch.mul, args=(x, 2.0))
    out["outside"] = (y.requires_grad, y.grad_fn is None)
    # a released context makes backward fail with torch's message
    with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
        dist_autograd.backward(cid, [x.sum()])
    return out


def test_contexts_and_recording():
    res = run_workers(_contexts, world_size=3, timeout=90)
    for rank in range(3):
        assert res[rank]["max_id"] == (rank << 48) + 2**48 - 1
    r = res[1]
    assert r["cid"] == 1 << 48
    assert r["same"]
    assert r["known_builtin"] == [] and r["known_no_grad"] == [2] and r["no_grad_sends"] == 0
    assert r["recv_name"] == "torch::distributed::autograd::RecvRpcBackward"  # torch's name
    assert r["n_send_recv"] == (1, 1)
    assert r["send_edges_ok"] == [("AccumulateGrad", True)]  # x goes once, aliasing kept
    assert r["remote_valid_before"]
    assert r["released_here"] and r["released_0"] and r["released_2"]
    assert r["outside"] == (True, True)


def _arg_checks(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2.0))
        with pytest.raises(TypeError):
            dist_autograd.backward(cid, y.sum())
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(cid, [torch.ones(())])
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(cid, [y])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(cid, [torch.ones((), requires_grad=True)])
        with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
            dist_autograd.backward(cid + 12345, [y.sum()])
        with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
            dist_autograd.get_gradients(cid + 12345)
        info = dist_autograd._get_debug_info()
        assert set(info) == {"num_current_backward_passes", "num_autograd_contexts"}
        assert info == {"num_current_backward_passes": 0, "num_autograd_contexts": 1}
        assert all(type(v) is int for v in info.values())
        merged = rpc._get_debug_info()  # torch merges autograd's counters into rpc's
        assert merged["num_autograd_contexts"] == 1
        assert merged["num_current_backward_passes"] == 0
    return True


def test_backward_argument_checks():
    assert run_workers(_arg_checks, world_size=2, timeout=60)[0]


# -- exact gradients -----------------------------------------------------------------
def _exact(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)

    def check(name, dist_fn, local_fn, leaves=(a, b), **bw):
        with dist_autograd.context() as cid:
            loss = dist_fn()
            dist_autograd.backward(cid, [loss], **bw)
            got = dist_autograd.get_gradients(cid)
            got = [got.get(t) for t in leaves]
        assert all(t.grad is None for t in leaves), f"{name}: .grad was written"
        copies = [t.detach().clone().requires_grad_() for t in leaves]
        local_fn(*copies).backward()
        for g, c in zip(got, copies):
            assert g is not None, f"{name}: missing gradient"
            assert torch.allclose(g, c.grad, atol=1e-6), f"{name}: {g} != {c.grad}"
        return True

    # shared intermediate used locally and remotely
    check("shared", lambda: (rpc.rpc_sync("worker1", torch.sin, args=(a * b,)) + (a * b) * 2).sum(),
          lambda a, b: ((a * b).sin() + (a * b) * 2).sum())
    # the same tensor sent to two workers, plus an unused RPC result (must not hang)
    def two():
        h = a.exp() * b
        u = rpc.rpc_sync("worker1", f_mul_sin, args=(h, a))
        v = rpc.rpc_async("worker2", torch.cos, args=(h,)).wait()
        rpc.rpc_sync("worker2", torch.mul, args=(h, 5.0))  # unused
        rpc.rpc_async("worker1", torch.mul, args=(a, 7.0))  # unused, never waited
        return (u * v).sum()
    check("two_workers", two, lambda a, b: (f_mul_sin(a.exp() * b, a) * (a.exp() * b).cos()).sum())
    # several round trips and a nested chain worker0 -> 1 -> 2 -> 0
    def rounds():
        h = a
        for i in range(3):
            h = rpc.rpc_sync(f"worker{1 + i % 2}", f_mul_sin, args=(h, b)) + h
        h = rpc.rpc_sync("worker1", f_chain, args=(["worker2", "worker0"], h))
        return (h * a).sum()
    def rounds_local(a, b):
        h = a
        for _ in range(3):
            h = f_mul_sin(h, b) + h
        h = torch.tanh(torch.tanh(torch.tanh(h))) * 8
        return (h * a).sum()
    check("rounds", rounds, rounds_local)
    # back to the initiator inside a call; remote() + to_here; RRef proxies
    def refs():
        r = rpc.remote("worker1", f_mul_sin, args=(a, b))
        s = rpc.rpc_sync("worker2", f_back_to, args=("worker0", a))
        t = r.rpc_sync().sum()
        return (r.to_here() * s).sum() + t
    check("refs", refs, lambda a, b: (f_mul_sin(a, b) * (a * 3 + a)).sum() + f_mul_sin(a, b).sum())
    # non-scalar root with grad_tensors
    gt = torch.arange(4.0)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", f_mul_sin, args=(a, b))
        dist_autograd.backward(cid, [y], grad_tensors=[gt])
        ga = dist_autograd.get_gradients(cid)[a]
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    f_mul_sin(a2, b2).backward(gt)
    assert torch.allclose(ga, a2.grad)
    # retain_graph: two passes accumulate as local autograd's do; a third without retain
    # fails like torch
    a2 = a.detach().requires_grad_()
    y2 = f_mul_sin(a2, b.detach()).sum()
    y2.backward(retain_graph=True)
    once = a2.grad.clone()
    y2.backward()
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", f_mul_sin, args=(a, b)).sum()
        dist_autograd.backward(cid, [y], retain_graph=True)
        g1 = dist_autograd.get_gradients(cid)[a].clone()
        dist_autograd.backward(cid, [y])
        g2 = dist_autograd.get_gradients(cid)[a]
        assert torch.allclose(g1, once) and torch.allclose(g2, a2.grad), (g1, once, g2, a2.grad)
        with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
            dist_autograd.backward(cid, [y])
    # leaf hooks apply to what is accumulated
    c = torch.ones(3, requires_grad=True)
    c.register_hook(lambda g: g * 10)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(c, 2.0)).sum()
        dist_autograd.backward(cid, [y])
        assert torch.allclose(dist_autograd.get_gradients(cid)[c], torch.full((3,), 20.0))
    # backward_async and a leaf owned by the remote worker (RRef.backward)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", f_mul_sin, args=(a, b)).sum()
        fut = dist_autograd.backward_async(cid, [y])
        assert fut.wait() is None
        ga = dist_autograd.get_gradients(cid)[a]
    a2 = a.detach().requires_grad_()
    f_mul_sin(a2, b.detach()).sum().backward()
    assert torch.allclose(ga, a2.grad), (ga, a2.grad)
    x3 = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = rpc.remote("worker1", make_param_loss, args=(x3,))
        loss.backward(cid)
        gw = rpc.rpc_sync("worker1", grads_of_param, args=(cid,))
        assert torch.allclose(gw, x3.detach())
        assert torch.allclose(dist_autograd.get_gradients(cid)[x3], torch.arange(3.0))
    return True


def test_exact_gradients():
    assert run_workers(_exact, world_size=3, timeout=110)[0]


# -- errors ------------------------------------------------------------------------------
def _errors(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.errors import BackwardError
    if rank != 0:
        return None
    a = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", f_boom, args=(a,))
        z = rpc.rpc_sync("worker2", torch.mul, args=(a, 2.0))
        # torch's type and message: a RuntimeError "Error on Node <rank>: <message>"
        with pytest.raises(RuntimeError, match="Error on Node 1: boom in backward") as ei:
            dist_autograd.backward(cid, [(y + z).sum()])
        assert isinstance(ei.value, BackwardError), type(ei.value)
        assert "worker1" in str(ei.value) and ei.value.worker_name == "worker1"
        assert ei.value.cause_type == "builtins.ValueError"
    for w in ("worker0", "worker1", "worker2"):
        assert _wait_until(lambda w=w: rpc.rpc_sync(w, debug_info)["num_current_backward_passes"] == 0)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(a, 3.0))
        dist_autograd.backward(cid, [y.sum()])
        assert torch.allclose(dist_autograd.get_gradients(cid)[a], torch.full((3,), 3.0))
    return True


def test_error_in_remote_backward():
    assert run_workers(_errors, world_size=3, timeout=90)[0]


def _profiled(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        assert torch.equal(grads[t1], torch.ones(3, 3)) and torch.equal(grads[t2], torch.ones(3, 3))
    names = [e.name for e in prof.function_events]
    # as torch shows a distributed backward: the pass, and each send/recv function it ran here
    assert "torch::distributed::autograd::backward" in names, names
    assert names.count("torch::distributed::autograd::SendRpcBackward") == 1, names
    assert names.count("torch::distributed::autograd::RecvRpcBackward") == 1, names
    return True


def test_backward_under_profiler():
    assert run_workers(_profiled, world_size=2, timeout=60)[0]


def _scale_in_place(x):
    x.mul_(3)  # a received tensor is an ordinary non-leaf tensor, as in torch
    return x + 1


def _set_item(x):
    y = x * 1
    y[0] = 5.0
    return y


def _in_place(rank, ws):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    out = []
    for fn in (_scale_in_place, _set_item):
        t = torch.ones(3, dtype=torch.float64, requires_grad=True)
        local = t.detach().clone().requires_grad_()
        fn(local * 1).sum().backward()
        with dist_autograd.context() as cid:
            r = rpc.rpc_sync("worker1", fn, args=(t,))
            dist_autograd.backward(cid, [r.sum()])
            out.append((dist_autograd.get_gradients(cid)[t].tolist(), local.grad.tolist()))
    return out


def test_received_tensors_modified_in_place():
    for got, want in run_workers(_in_place, world_size=2, timeout=60)[0]:
        assert got == want
