"""Transformer workloads: 12 x nn.TransformerEncoderLayer(d_model=128, nhead=4,
dim_feedforward=256, batch_first=True, dropout=0.0), batch 8 x seq 32,
loss = mean of the output squared; ``torch.set_num_threads(1)`` on every worker.

``tf_local`` (1 worker): the whole stack on the driver; ``dist_autograd.backward``
beside ``loss.backward()`` on fresh forwards, timed alternately
(``graph_bench.paired_backward``); the ratio dist/plain, as ``local``.

``tf_split`` (2 workers): layers 0-5 on the driver, layers 6-11 on worker1 in a
``Half`` built there by ``rpc.remote`` and held by its RRef. A step:
x -> local half -> ``rpc_sync(worker1, half_forward, (rref, h))`` -> loss ->
``dist_autograd.backward`` -> ``DistributedOptimizer(SGD).step(cid)``;
steps/s = median rate of time-capped blocks (as ``pipeline``: distgrad's idle
ranks give up waiting in ``rpc.shutdown()`` after 60 s, so rank 0 keeps well
inside that). Gradients of both halves are checked once against the same
model run by plain autograd on the driver.

    python bench/run_all.py --only tf_local,tf_split --quick
"""
from __future__ import annotations

import statistics
import time

import graph_bench
from autograd_bench import _dist_autograd

LAYERS, D_MODEL, NHEAD, FF = 12, 128, 4, 256
BATCH, SEQ = 8, 32


def _layers(first: int, n: int):
    """Layers ``first`` .. ``first + n - 1`` of the stack, each seeded by its
    index, so the halves of the split equal the local model's layers."""
    import torch
    out = []
    for i in range(first, first + n):
        torch.manual_seed(100 + i)
        out.append(torch.nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=FF,
                                                    dropout=0.0, batch_first=True))
    return torch.nn.Sequential(*out)


def _input():
    import torch
    torch.manual_seed(0)
    return torch.randn(BATCH, SEQ, D_MODEL)


def _loss(out):
    return out.pow(2).mean()


def tf_local_workload(rpc, quick=False) -> dict:
    """rank 0 of a 1-worker cluster: ``tf_local_ratio``, ``tf_local_dist_ms``, ..."""
    import torch
    dist_autograd = _dist_autograd(rpc)
    torch.set_num_threads(1)
    model = _layers(0, LAYERS)
    params = list(model.parameters())
    x = _input()

    def forward():
        return _loss(model(x))

    graph_bench.check_gradients(dist_autograd, forward, params)
    warm, reps = (3, 9) if quick else (10, 60)
    res = {"tf_local_nodes": graph_bench.count_nodes(forward())}
    for k, v in graph_bench.paired_backward(dist_autograd, forward, params, warm, reps).items():
        res[f"tf_local_{k}"] = v
    return res


class Half:
    """Layers 6-11, built on worker1 by rpc.remote (module-level: pickled by reference)."""

    def __init__(self, first: int, n: int):
        import torch
        torch.set_num_threads(1)
        self.net = _layers(first, n)

    def forward(self, h):
        return self.net(h)


def half_forward(rref, h):
    """RPC target on the owner: the held half's forward."""
    return rref.local_value().forward(h)


def half_param_rrefs(rref, rpc_name: str):
    """RPC target: RRefs of the held half's parameters (for DistributedOptimizer)."""
    import importlib
    rpc = importlib.import_module(rpc_name)
    return [rpc.RRef(p) for p in rref.local_value().net.parameters()]


def half_grads(rref, autograd_name: str, context_id: int):
    """RPC target: the context's gradients of the held half, in parameter order."""
    import importlib
    dist_autograd = importlib.import_module(autograd_name)
    g = dist_autograd.get_gradients(context_id)
    return [g[p] for p in rref.local_value().net.parameters()]


def half_state(rref):
    return {k: v.detach().clone() for k, v in rref.local_value().net.state_dict().items()}


def _optimizer_cls(rpc):
    if rpc.__name__.startswith("torch."):
        from torch.distributed.optim import DistributedOptimizer
    else:
        from distgrad.optim import DistributedOptimizer
    return DistributedOptimizer


def _check_split(rpc, dist_autograd, local, rref, x) -> None:
    """The split's gradients (both halves) equal plain autograd's on one
    process holding the same two halves."""
    import torch
    import transformer_bench as tb
    w1 = "worker1"
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync(w1, tb.half_forward, args=(rref, local(x)))
        dist_autograd.backward(cid, [_loss(out)])
        g_local = dist_autograd.get_gradients(cid)
        g_local = [g_local[p] for p in local.parameters()]
        g_remote = rpc.rpc_sync(w1, tb.half_grads, args=(rref, dist_autograd.__name__, cid))
    second = _layers(LAYERS // 2, LAYERS - LAYERS // 2)
    second.load_state_dict(rpc.rpc_sync(w1, tb.half_state, args=(rref,)))
    first = _layers(0, LAYERS // 2)
    first.load_state_dict(local.state_dict())
    _loss(second(first(x))).backward()
    want = [p.grad for p in first.parameters()] + [p.grad for p in second.parameters()]
    got = g_local + g_remote
    assert len(got) == len(want), (len(got), len(want))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max().item()


def tf_split_workload(rpc, quick=False) -> dict:
    """rank 0 of a 2-worker cluster: ``tf_split_steps_per_s`` (fwd+bwd+step),
    ``tf_split_fwd_ms``, ``tf_split_bwd_ms``, ``tf_split_opt_ms``, ``tf_split_steps``."""
    import torch
    import transformer_bench as tb
    dist_autograd = _dist_autograd(rpc)
    torch.set_num_threads(1)
    w1 = "worker1"
    half = LAYERS // 2
    local = _layers(0, half)
    rref = rpc.remote(w1, tb.Half, args=(half, LAYERS - half))
    x = _input()
    _check_split(rpc, dist_autograd, local, rref, x)
    params = [rpc.RRef(p) for p in local.parameters()]
    params += rpc.rpc_sync(w1, tb.half_param_rrefs, args=(rref, rpc.__name__))
    opt = _optimizer_cls(rpc)(torch.optim.SGD, params, lr=1e-3)
    pc = time.perf_counter_ns

    def step():
        with dist_autograd.context() as cid:
            t0 = pc()
            out = rpc.rpc_sync(w1, tb.half_forward, args=(rref, local(x)))
            loss = _loss(out)
            t1 = pc()
            dist_autograd.backward(cid, [loss])
            t2 = pc()
            opt.step(cid)
            t3 = pc()
        return t1 - t0, t2 - t1, t3 - t2

    warm, blocks, per_block, cap_s = (3, 3, 8, 2.0) if quick else (10, 5, 30, 4.0)
    t0 = pc()
    for i in range(warm):
        step()
        if i >= 2 and pc() - t0 > 5e9:
            break
    fwd, bwd, opt_t, rates = [], [], [], []
    for _ in range(blocks):
        t0, n = pc(), 0
        while n < per_block and (n < 3 or pc() - t0 < cap_s * 1e9):
            a, b, c = step()
            fwd.append(a)
            bwd.append(b)
            opt_t.append(c)
            n += 1
        rates.append(n / ((pc() - t0) / 1e9))
    res = {"tf_split_steps": len(fwd), "tf_split_steps_per_s": statistics.median(rates),
           "tf_split_steps_per_s_best": max(rates),
           "tf_split_fwd_ms": statistics.median(fwd) / 1e6,
           "tf_split_bwd_ms": statistics.median(bwd) / 1e6,
           "tf_split_opt_ms": statistics.median(opt_t) / 1e6}
    opt = params = None  # drop the parameter RRefs before shutdown
    rref = None
    return res
