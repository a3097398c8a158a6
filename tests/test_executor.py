"""The node-by-node executor (what runs a worker's share when entries share
nodes), forced onto random local graphs in one process, must give what torch's
own engine gives: every leaf gradient, every absent gradient, every shape and
dtype. No RPC here, so hundreds of graphs run in seconds; the cross-worker
programs are in test_autograd_random.py.

The graphs use broadcasting (size-1 and 0-dim operands), reductions, views
(split, chunk, narrow, repeated indexing, transpose, expand), cat/stack,
matmul, dtype changes, ops with several outputs, custom Functions that return
None or need materialized gradients, outputs left unused and leaves never
reached.
"""
from __future__ import annotations

import random

import pytest
import torch

from distgrad.autograd.context import CONTAINER, DistAutogradContext
from distgrad.autograd.share import PassState
from distgrad.autograd.walk import below as _below


class FirstOnly(torch.autograd.Function):
    """x * 2 + y; no gradient for y (the engine must leave y's side absent)."""

    @staticmethod
    def forward(ctx, x, k, y):
        return x * k + y

    @staticmethod
    def backward(ctx, g):
        return g * 2, None, None


class Materialized(torch.autograd.Function):
    """Two outputs; backward needs both gradients (zeros when one is absent)."""

    @staticmethod
    def forward(ctx, x):
        return x * 3, x.sin()

    @staticmethod
    def backward(ctx, g1, g2):
        assert g1 is not None and g2 is not None  # materialized, as PyNode does
        return g1 * 3 + g2


class NotMaterialized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 3, x * 5

    @staticmethod
    def backward(ctx, g1, g2):
        # tells an absent gradient from a zero one: the executor must pass None here
        first = g1 * 3 if g1 is not None else 7.0
        second = g2 * 5 if g2 is not None else 11.0
        return first + second


def _unary(rnd: random.Random, x: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    """One op on ``x``; returns its outputs (several for multi-output ops)."""
    d = x.dim()
    choices = ["sin", "mul_row", "add_scalar0d", "sum", "mean_dim", "expand", "to32", "cat",
               "stack", "firstonly", "materialized", "notmaterialized", "index", "matmul"]
    if d >= 1 and x.shape[-1] >= 2:
        choices += ["split", "chunk", "narrow"]
    if d >= 2:
        choices += ["transpose"]
    op = rnd.choice(choices)
    if op == "sin":
        return [x.sin()]
    if op == "mul_row":  # broadcast a size-1 leading dim against x
        w = torch.rand((1,) * max(d, 1), generator=gen, dtype=x.dtype) + 0.5
        return [x * w]
    if op == "add_scalar0d":
        return [x + torch.tensor(1.5, dtype=x.dtype)]
    if op == "sum":
        return [x.sum()]
    if op == "mean_dim":
        return [x.mean(dim=-1, keepdim=rnd.random() < 0.5)] if d else [x * 2]
    if op == "expand":
        return [x.unsqueeze(0).expand(2, *x.shape)]
    if op == "to32":
        return [x.float().exp().double() if rnd.random() < 0.5 else x.float() * 2]
    if op == "cat":
        return [torch.cat([x.reshape(-1), x.reshape(-1) * 2])]
    if op == "stack":
        return [torch.stack([x, x.cos()])]
    if op == "firstonly":
        return [FirstOnly.apply(x, 2.0, x.exp())]
    if op == "materialized":
        return list(Materialized.apply(x))
    if op == "notmaterialized":
        return list(NotMaterialized.apply(x))
    if op == "index":
        flat = x.reshape(-1)
        idx = torch.tensor([0, 0, flat.numel() - 1])
        return [flat[idx]]
    if op == "matmul":
        flat = x.reshape(1, -1)
        return [flat @ torch.rand(flat.shape[1], 2, generator=gen, dtype=x.dtype)]
    if op == "split":
        return list(x.split(1, dim=-1))
    if op == "chunk":
        return list(x.chunk(2, dim=-1))
    if op == "narrow":
        return [x.narrow(-1, 1, x.shape[-1] - 1)]
    if op == "transpose":
        return [x.transpose(0, 1)]
    raise AssertionError(op)


def _binary(rnd: random.Random, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a op b with broadcasting: reduce both to scalars or broadcast-compatible shapes."""
    if a.shape == b.shape or b.dim() == 0 or a.dim() == 0:
        pass
    else:
        a, b = a.sum(), b.reshape(-1)[:1]  # shape () and (1,): broadcast
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    return rnd.choice([torch.add, torch.mul, torch.sub])(a, b)


def build(seed: int):
    """A random graph over three leaves (one never used in some programs); returns
    (leaves, roots): torch's engine and the executor run the same roots."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.rand(s, generator=gen, dtype=torch.float64).requires_grad_()
              for s in [(3,), (1,), (2, 3)]]
    leaves.append(torch.rand((), generator=gen, dtype=torch.float64).requires_grad_())
    vals = list(leaves[:-1]) if rnd.random() < 0.3 else list(leaves)
    for _ in range(rnd.randint(3, 10)):
        if rnd.random() < 0.3 and len(vals) >= 2:
            vals.append(_binary(rnd, rnd.choice(vals), rnd.choice(vals)))
        else:
            vals.extend(_unary(rnd, rnd.choice(vals), gen))
    used = [v for v in vals if v.requires_grad and v.grad_fn is not None]
    roots = rnd.sample(used, min(len(used), rnd.randint(1, 3)))
    return leaves, [r.sum() * (i + 1) for i, r in enumerate(roots)]


def _executor_grads(roots: list) -> dict:
    ctx = DistAutogradContext(7)
    state = PassState(ctx, (0, 0), 0, True, roots)
    if not state.shared:  # force the node-by-node executor onto this local graph
        state.shared = True  # (a native pass keeps no node set: walk it again)
        state.nodes = _below([r.grad_fn for r in roots])
        state.count_inputs([r.grad_fn for r in roots], state.nodes)
    state.run_entry("root", list(roots), [torch.ones_like(r) for r in roots])
    assert not state.waiting, "nodes left waiting with every input in"
    return ctx.leaf_gradients()


@pytest.fixture(autouse=True)
def _worker_id():
    prev = CONTAINER.worker_id
    CONTAINER.worker_id = 0
    yield
    CONTAINER.worker_id = prev


@pytest.mark.parametrize("seed", range(250))
def test_executor_matches_torch_engine(seed):
    leaves, roots = build(seed)
    want = torch.autograd.grad(roots, leaves, allow_unused=True, retain_graph=True)
    got = _executor_grads(roots)
    for leaf, w in zip(leaves, want):
        g = got.get(leaf)
        if w is None:
            assert g is None, f"seed {seed}: leaf {tuple(leaf.shape)} got {g}, torch gives none"
            continue
        assert g is not None, f"seed {seed}: leaf {tuple(leaf.shape)} got none, torch gives {w}"
        assert g.shape == w.shape and g.dtype == w.dtype, (seed, g.shape, w.shape, g.dtype)
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-9), (seed, g, w)


def test_graphs_depend_on_their_seed_only():
    """A failing seed replays: the global generator's state changes no graph."""
    for seed in range(40):
        torch.manual_seed(1)
        first = [r.detach() for r in build(seed)[1]]
        torch.manual_seed(2)
        again = [r.detach() for r in build(seed)[1]]
        assert all(torch.equal(a, b) for a, b in zip(first, again)), seed


def test_generator_exercises_broadcast_none_and_materialization():
    """The graphs above do reach the cases that once went wrong."""
    names = set()
    for seed in range(400):
        _, roots = build(seed)
        stack, seen = [r.grad_fn for r in roots], set()
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            names.add(n.name())
            stack.extend(f for f, _ in n.next_functions)
    for want in ("MulBackward0", "ExpandBackward0", "FirstOnlyBackward", "MaterializedBackward",
                 "NotMaterializedBackward", "SplitBackward0", "IndexBackward0", "ToCopyBackward0",
                 "CatBackward0", "StackBackward0", "MmBackward0", "TransposeBackward0"):
        assert want in names, want


def test_error_in_node_names_it():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    x = torch.rand(2, requires_grad=True)
    y = Boom.apply(x).sum()
    with pytest.raises(RuntimeError, match="Error on Node 0: boom.*BoomBackward"):
        _executor_grads_with_agent_name([y])


def _executor_grads_with_agent_name(roots):
    import distgrad.autograd.gradients as gradients

    class _Agent:
        name = "worker0"

    orig = gradients.current_agent
    gradients.current_agent = lambda: _Agent()
    try:
        return _executor_grads(roots)
    finally:
        gradients.current_agent = orig
