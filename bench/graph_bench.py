"""Graph-size workload: how a local backward's cost grows with the number of
autograd nodes, ``dist_autograd.backward`` beside plain ``loss.backward()``.

One worker (a world_size-1 cluster), ``depth`` x (Linear(16,16) + Tanh),
batch 4: each layer adds AddmmBackward0, TBackward0, TanhBackward0 and two
AccumulateGrad nodes, so depths 30, 120, 600, 1800 give about 150, 600, 3,000
and 9,000 nodes (the count, walked from the loss, is reported). Per depth:
gradients checked against plain autograd once, then fresh forwards inside
``dist_autograd.context()`` with both backwards timed, interleaved (which goes
first alternates); dist/plain is the ratio of the medians. ``paired_backward``
is the timing both this and ``transformer_bench`` use.

    python bench/run_all.py --only graph_size --quick

Rows (``bench/workloads.py``): per depth the ratio (each implementation its own; the
target is on the ms rows: distgrad <= torch) and the distributed backward's median ms.
"""
from __future__ import annotations

import statistics
import time

import common
from autograd_bench import _dist_autograd

DEPTHS = (30, 120, 600, 1800)
#          warmup, reps (>= 7; >= 5 at the largest size), per depth
REPS = {30: (10, 60), 120: (8, 40), 600: (4, 15), 1800: (2, 9)}
QUICK_REPS = {30: (5, 15), 120: (3, 11), 600: (2, 9), 1800: (1, 7)}


def count_nodes(t) -> int:
    """Autograd nodes reachable from ``t.grad_fn`` (AccumulateGrad included)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(m for m, _ in n.next_functions)
    return len(seen)


def check_gradients(dist_autograd, forward, params, rtol=1e-4, atol=1e-5) -> None:
    """Assert that one distributed backward gives plain autograd's gradients."""
    import torch
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [forward()])
        g = dist_autograd.get_gradients(cid)
        for p in params:
            p.grad = None
        forward().backward()
        assert len(g) == len(params), (len(g), len(params))
        for p in params:
            assert torch.allclose(g[p], p.grad, rtol=rtol, atol=atol), \
                (p.shape, (g[p] - p.grad).abs().max().item())
            p.grad = None


def paired_backward(dist_autograd, forward, params, warm: int, reps: int) -> dict:
    """Median ns of ``dist_autograd.backward(cid, [loss])`` and of
    ``loss.backward()``, each on a fresh ``forward()`` inside a context, timed
    alternately (the first of each pair alternates); plus the median of the
    per-pair ratios (robust to drift)."""
    pc = time.perf_counter_ns

    def dist_once():
        with dist_autograd.context() as cid:
            loss = forward()
            t0 = pc()
            dist_autograd.backward(cid, [loss])
            return pc() - t0

    def plain_once():
        with dist_autograd.context():     # the same setting as dist_once
            loss = forward()
            t0 = pc()
            loss.backward()
            dt = pc() - t0
        for p in params:
            p.grad = None
        return dt

    d, p_ = common.interleaved(dist_once, plain_once, warm, reps)
    dist, plain = statistics.median(d), statistics.median(p_)
    return {"dist_ms": dist / 1e6, "plain_ms": plain / 1e6, "ratio": dist / plain,
            "pair_ratio": statistics.median(a / b for a, b in zip(d, p_)), "reps": reps}


def _model(depth: int):
    import torch
    torch.manual_seed(depth)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def graph_size_workload(rpc, quick=False, depths=DEPTHS) -> dict:
    """rank 0 of a 1-worker cluster: per depth ``gs<depth>_ratio``,
    ``gs<depth>_dist_ms``, ``gs<depth>_plain_ms``, ``gs<depth>_pair_ratio``,
    ``gs<depth>_nodes``, ``gs<depth>_reps``."""
    import torch
    dist_autograd = _dist_autograd(rpc)
    torch.set_num_threads(1)  # same for both implementations
    res = {}
    for depth in depths:
        model = _model(depth)
        params = list(model.parameters())
        x = torch.randn(4, 16)

        def forward(model=model, x=x):
            return model(x).sum()

        check_gradients(dist_autograd, forward, params)
        res[f"gs{depth}_nodes"] = count_nodes(forward())
        warm, reps = (QUICK_REPS if quick else REPS).get(depth, (2, 7))
        for k, v in paired_backward(dist_autograd, forward, params, warm, reps).items():
            res[f"gs{depth}_{k}"] = v
    return res
