"""What a user, a hook or another thread can observe, as under torch (issue 34, items 2-5).

2. A post-accumulate-grad hook does not run in a distributed backward (torch's engine
   never runs AccumulateGrad), so it never borrows ``.grad``: a plain ``backward()``
   on another thread counts every one of its additions.
3. DDP's flush never shows another thread a ``.grad`` other than the user's, and
   the context holds DDP's average over the group.
4. A gradient taken from ``get_gradients`` is added into in place by a later
   backward in the same context: received (dense), local, and sparse.
5. A static member leaves the store's ledger before the shutdown barrier (after
   it, rank 0 may be gone), and a clean shutdown prints no C++ stack trace.
"""
import os
import subprocess
import sys
import threading

import pytest
import torch
from mp_utils import free_port, run_workers

pytestmark = pytest.mark.timeout(300)


def _post_acc_and_plain(rank, world_size):
    import distgrad.autograd as dist_autograd
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    p = net[0].weight
    x = torch.randn(4, 16)
    want = torch.autograd.grad(net(x).sum(), [p])[0]
    calls = [0]
    p.register_post_accumulate_grad_hook(lambda t: calls.__setitem__(0, calls[0] + 1))
    stop, count, errors = threading.Event(), [0], []

    def plain():
        try:
            while not stop.is_set():
                (p * 1.0).sum().backward()  # adds exactly ones into p.grad
                count[0] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    t = threading.Thread(target=plain)
    t.start()
    wrong = 0
    try:
        for _ in range(150):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [net(x).sum()])
                wrong += not torch.allclose(dist_autograd.get_gradients(cid)[p], want, atol=1e-5)
    finally:
        stop.set()
        t.join()
    return {"errors": errors, "wrong": wrong, "plain": count[0], "hook_calls": calls[0],
            "p.grad": None if p.grad is None else float(p.grad[0, 0])}


def test_post_accumulate_grad_hook_borrows_no_grad():
    out = run_workers(_post_acc_and_plain, world_size=1, timeout=200)[0]
    assert out["errors"] == [] and out["wrong"] == 0, out
    # the hook ran for the plain backward() calls only, and .grad counts every one
    assert out["hook_calls"] == out["plain"] > 0, out
    assert out["p.grad"] == float(out["plain"]), out


def _ddp_watched(rank, world_size, pg_port):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 8).double())
        p = model.module.weight
        user = torch.full_like(p, 7.0)
        p.grad = user
        torch.manual_seed(rank + 1)
        x = torch.randn(4, 8, dtype=torch.double)
        stop, odd = threading.Event(), []

        def watch():
            while not stop.is_set():
                g = p.grad
                if g is not user:
                    odd.append("None" if g is None else "another tensor")
        t = threading.Thread(target=watch)
        t.start()
        got = []
        try:
            for _ in range(20):
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [model(x).sum()])
                    got.append(dist_autograd.get_gradients(cid)[p].clone())
        finally:
            stop.set()
            t.join()
        mine = torch.autograd.grad(model.module(x).sum(), [p])[0]
        avg = mine.clone()
        dist.all_reduce(avg)
        avg /= world_size
        return {"odd": len(odd), "user_kept": p.grad is user and bool((user == 7.0).all()),
                "average": all(torch.allclose(g, avg) for g in got),
                "not_own": not torch.allclose(got[0], mine)}
    finally:
        dist.destroy_process_group()


def test_ddp_flush_shows_no_other_grad():
    outs = run_workers(_ddp_watched, world_size=2, timeout=200, args=(free_port(),))
    for out in outs:
        assert out == {"odd": 0, "user_kept": True, "average": True, "not_own": True}, outs


def _ddp_accumulating(rank, world_size, pg_port):
    """Two passes in one context through DDP, the first under no_sync() (gradient
    accumulation): as under torch, the second pass's gradient is added into what the
    context holds before DDP's hook reads it, so the context ends with the group's
    average of both passes; the tensor get_gradients gave after the first pass is
    the one that holds it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 3).double())
        p = model.module.weight
        torch.manual_seed(rank + 5)
        x1, x2 = torch.randn(2, 4, dtype=torch.double), torch.randn(2, 4, dtype=torch.double)
        with dist_autograd.context() as cid:
            with model.no_sync():
                dist_autograd.backward(cid, [model(x1).sum()])
            kept = dist_autograd.get_gradients(cid)[p]
            dist_autograd.backward(cid, [model(x2).pow(2).sum()])
            got = dist_autograd.get_gradients(cid)[p]
        want = (torch.autograd.grad(model.module(x1).sum(), [p])[0]
                + torch.autograd.grad(model.module(x2).pow(2).sum(), [p])[0])
        dist.all_reduce(want)
        want /= world_size
        return {"average": torch.allclose(got, want), "kept": got is kept, "grad": p.grad is None}
    finally:
        dist.destroy_process_group()


def test_ddp_gradient_accumulation_in_one_context():
    outs = run_workers(_ddp_accumulating, world_size=2, timeout=200, args=(free_port(),))
    assert outs == [{"average": True, "kept": True, "grad": True}] * 2, outs


def _kept_in_place(rank, world_size):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    out = {}
    for name in ("received", "local"):
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as cid:
            if name == "received":
                y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            else:
                y = x * 2 + rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(3), 0))
            dist_autograd.backward(cid, [y.sum()], retain_graph=True)
            g1 = dist_autograd.get_gradients(cid)[x]
            first = g1.tolist()
            dist_autograd.backward(cid, [y.sum()])
            after = g1.tolist()  # as soon as backward returned, before any other read
            g2 = dist_autograd.get_gradients(cid)[x]
            out[name] = (first, after, g2 is g1)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    torch.nn.init.ones_(emb.weight)
    idx = torch.tensor([1, 3])
    with dist_autograd.context() as cid:
        y = emb(idx) * 2 + rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2, 3), 0))
        dist_autograd.backward(cid, [y.sum()], retain_graph=True)
        g1 = dist_autograd.get_gradients(cid)[emb.weight]
        dist_autograd.backward(cid, [y.sum()])
        after = g1.to_dense()[[1, 3]].tolist()
        g2 = dist_autograd.get_gradients(cid)[emb.weight]
        out["sparse"] = (g1.is_sparse, after, g2 is g1)
    return out


def test_kept_gradients_are_added_into_in_place():
    out = run_workers(_kept_in_place, world_size=2, timeout=120)[0]
    for name in ("received", "local"):
        assert out[name] == ([2.0] * 3, [4.0] * 3, True), (name, out)
    assert out["sparse"] == (True, [[4.0] * 3] * 2, True), out


def _ledger_order(rank, world_size, port):
    """Store calls of a shutdown, in order: leaving the ledger comes before the barrier."""
    import distgrad.rpc as rpc
    from distgrad.launch import rendezvous
    from distgrad.rpc import mixing
    seen = []
    barrier, count_out = rendezvous.barrier, mixing.count_out

    def b(*a, **k):
        seen.append("barrier")
        return barrier(*a, **k)

    def c(*a, **k):
        seen.append("count_out")
        return count_out(*a, **k)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    rendezvous.barrier, mixing.count_out = b, c
    rpc.shutdown()
    return seen


def test_ledger_left_before_the_shutdown_barrier():
    for seen in run_workers(_ledger_order, world_size=2, timeout=120, init=False,
                            args=(free_port(),)):
        assert seen and seen[0] == "count_out" and "barrier" in seen, seen


_CHILD = r'''
import os, sys, threading, torch
rank, port = int(sys.argv[1]), sys.argv[2]
DONE = threading.Event()
def ready():  # the other worker's calls are all done
    DONE.set()
import distgrad.rpc as rpc
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
assert torch.equal(rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(2), 1)),
                   torch.full((2,), 2.0))
rpc.rpc_sync(f"worker{1 - rank}", ready)
assert DONE.wait(60)  # (without the barrier of a graceful shutdown, nobody leaves early)
rpc.shutdown(graceful=sys.argv[3] == "1")
os._exit(0)  # as a script that ends: rank 0's store goes with it at once
'''


@pytest.mark.parametrize("graceful", ["1", "0"])
def test_clean_shutdown_prints_no_stack_trace(graceful):
    env = dict(os.environ, DISTGRAD_SECRET="e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71ed")
    for _ in range(3):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(r), port, graceful], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120))
            finally:
                p.kill()
        assert [p.returncode for p in procs] == [0, 0], outs
        for _, err in outs:
            assert "frame #" not in err and "recvVector" not in err, err


def _static_graph(rank, world_size, pg_port):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=world_size)
    try:
        model = DDP(torch.nn.Linear(3, 3), static_graph=True)
        with dist_autograd.context() as cid:
            try:
                dist_autograd.backward(cid, [model(torch.ones(2, 3)).sum()])
            except RuntimeError as e:
                return str(e)
        return "no error"
    finally:
        dist.destroy_process_group()


def test_ddp_static_graph_is_refused_not_wrong():
    """DDP(static_graph=True) would average nothing in a distributed backward (its
    delayed all-reduce runs before the gradients reach DDP): a clear error instead."""
    out = run_workers(_static_graph, world_size=1, timeout=120, args=(free_port(),))[0]
    assert "static_graph=True) is not supported" in out, out


def _ddp_two_pass_reference(world_size: int) -> dict:
    """Plain local autograd (in tests/clean_ref.py's process, which never imported
    distgrad): for each parameter of the model (and of the second model), the group's
    average of the first pass's gradient plus the average of the second's."""
    out = {}
    for case in ("plain", "bucket_view", "comm_hook", "two_models"):
        sums = None
        for rank in range(world_size):
            models, fwd = _ddp_variant_models(case, rank)
            x1, x2 = _ddp_variant_inputs(rank)
            params = [p for m in models for p in m.parameters()]
            gs = [a + b for a, b in zip(torch.autograd.grad(fwd(models, x1), params),
                                        torch.autograd.grad(fwd(models, x2), params))]
            sums = gs if sums is None else [s + g for s, g in zip(sums, gs)]
        out[case] = [(s / world_size).tolist() for s in sums]
    return out


def _ddp_variant_models(case: str, rank: int):
    torch.manual_seed(1)
    models = [torch.nn.Linear(4, 4).double()]
    if case == "two_models":
        models.append(torch.nn.Linear(4, 4).double())

    def fwd(ms, x):
        return (ms[0](x) ** 2).sum() + ((ms[1](x) ** 3).sum() if len(ms) > 1 else 0)
    return models, fwd


def _ddp_variant_inputs(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(3, 4, dtype=torch.double, generator=g) * (rank + 1),
            torch.randn(3, 4, dtype=torch.double, generator=g) * (rank + 2))


def _ddp_variants(rank, world_size, pg_port):
    """Two synced passes in one context through DDP: plain, gradient_as_bucket_view, a
    comm hook that all-reduces itself, and two DDP models in one pass (the audit of
    issue 34: each as torch, the context ends with avg(pass 1) + avg(pass 2))."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=world_size)
    try:
        out = {}
        for case in ("plain", "bucket_view", "comm_hook", "two_models"):
            models, fwd = _ddp_variant_models(case, rank)
            ddps = [DDP(m, gradient_as_bucket_view=case == "bucket_view") for m in models]
            if case == "comm_hook":
                def hook(state, bucket):
                    buf = bucket.buffer().div_(world_size)
                    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
                ddps[0].register_comm_hook(None, hook)
            x1, x2 = _ddp_variant_inputs(rank)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [fwd(ddps, x1)])
                dist_autograd.backward(cid, [fwd(ddps, x2)])
                got = dist_autograd.get_gradients(cid)
                out[case] = [got[p].tolist() if p in got else None for m in models for p in m.parameters()]
            dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def test_ddp_two_passes_in_one_context_bucket_view_comm_hook_two_models():
    import clean_ref
    want = clean_ref.shared().call(_ddp_two_pass_reference, 2)
    outs = run_workers(_ddp_variants, world_size=2, timeout=200, args=(free_port(),))
    for out in outs:
        for case, grads in want.items():
            assert len(out[case]) == len(grads) and None not in out[case], (case, out[case])
            for g, w in zip(out[case], grads):
                assert torch.allclose(torch.tensor(g), torch.tensor(w), rtol=1e-9, atol=1e-9), (case, g, w)
