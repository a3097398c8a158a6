"""Randomly generated computations over 3 and 4 workers: random ops, random
placement through rpc_sync, rpc_async, remote and nested chains, shared
intermediates, round trips and unused RPC results. Every gradient must equal
single-process autograd on the same computation, and a counting Function
after every op proves no node ran twice (nor ran when it should not)."""
import collections
import random

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(300)

D = 4
COUNTS: collections.Counter = collections.Counter()
PARAMS: dict = {}


class Count(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        COUNTS[ctx.tag] += 1
        return g, None


def param(store: dict, tag: str) -> torch.Tensor:
    p = store.get(tag)
    if p is None:
        gen = torch.Generator().manual_seed(sum(map(ord, tag)) * 7919 + len(tag))
        p = store[tag] = (torch.rand(D, generator=gen) + 0.5).requires_grad_()
    return p


def op(name: str, tag: str, store: dict, *xs):
    if name == "sin":
        y = xs[0].sin()
    elif name == "tanh":
        y = torch.tanh(xs[0])
    elif name == "mul":
        y = xs[0] * xs[1]
    elif name == "add":
        y = xs[0] + 2 * xs[1]
    elif name == "param":
        y = xs[0] * param(store, tag)
    else:
        raise ValueError(name)
    return Count.apply(y, tag)


def remote_op(name, tag, *xs):
    return op(name, tag, PARAMS, *xs)


def nested_op(path, name, tag, *xs):
    """Apply ``name`` here, then pass the result along ``path`` (tanh at each hop)."""
    import distgrad.rpc as rpc
    y = op(name, tag, PARAMS, *xs)
    if path:
        y = rpc.rpc_sync(path[0], nested_op, args=(path[1:], "tanh", f"{tag}>{len(path)}", y))
    return y


def local_nested(path, name, tag, store, *xs):
    y = op(name, tag, store, *xs)
    if path:
        y = local_nested(path[1:], "tanh", f"{tag}>{len(path)}", store, y)
    return y


def take_counts():
    out = dict(COUNTS)
    COUNTS.clear()
    return out


def param_grads(cid):
    import distgrad.autograd as dist_autograd
    grads = dist_autograd.get_gradients(cid)
    return {tag: grads[p].clone() for tag, p in PARAMS.items() if p in grads}


def generate(seed: int, world_size: int):
    rnd = random.Random(seed)
    n_nodes = rnd.randint(4, 9)
    nodes = []
    for i in range(n_nodes):
        name = rnd.choice(["sin", "tanh", "mul", "add", "param", "param"])
        arity = 2 if name in ("mul", "add") else 1
        avail = 2 + i  # two leaves, then earlier nodes
        inputs = [rnd.randrange(avail) for _ in range(arity)]
        where = rnd.randrange(world_size)
        mode = rnd.choice(["sync", "async", "remote", "nested"]) if where else "local"
        path = []
        if mode == "nested":
            path = [rnd.randrange(world_size) for _ in range(rnd.randint(1, 3))]
        nodes.append((name, inputs, where, mode, path))
    used = sorted(set(rnd.sample(range(n_nodes), rnd.randint(1, n_nodes))) | {n_nodes - 1})
    return nodes, used


def run_program(nodes, used, x0, x1, distributed: bool, store: dict):
    import distgrad.rpc as rpc
    vals = [x0, x1]
    for i, (name, inputs, where, mode, path) in enumerate(nodes):
        args = [vals[j] for j in inputs]
        tag = f"n{i}"
        if not distributed or mode == "local":
            if mode == "nested":
                v = local_nested(path, name, tag, store, *args)
            else:
                v = op(name, tag, store, *args)
        elif mode == "sync":
            v = rpc.rpc_sync(where, remote_op, args=(name, tag, *args))
        elif mode == "async":
            v = rpc.rpc_async(where, remote_op, args=(name, tag, *args)).wait()
        elif mode == "remote":
            v = rpc.remote(where, remote_op, args=(name, tag, *args)).to_here()
        else:
            v = rpc.rpc_sync(where, nested_op, args=([f"worker{p}" for p in path], name, tag, *args))
        vals.append(v)
    return sum((vals[2 + i] * (i + 1)).sum() for i in used)


def _random_programs(rank, world_size, seeds):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    checked = 0
    for seed in seeds:
        nodes, used = generate(seed, world_size)
        gen = torch.Generator().manual_seed(seed)
        x0 = torch.randn(D, generator=gen).requires_grad_()
        x1 = torch.randn(D, generator=gen).requires_grad_()
        # oracle: one process, plain autograd
        store: dict = {}
        l0, l1 = x0.detach().clone().requires_grad_(), x1.detach().clone().requires_grad_()
        run_program(nodes, used, l0, l1, False, store).backward()
        want_counts = take_counts()
        want_params = {t: p.grad for t, p in store.items() if p.grad is not None}
        # distributed
        with dist_autograd.context() as cid:
            loss = run_program(nodes, used, x0, x1, True, PARAMS)
            assert torch.allclose(loss, run_program(nodes, used, l0, l1, False, store))
            take_counts()  # the oracle's forward above counted nothing; stay clean
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            got_params = {}
            for w in range(world_size):
                got_params.update(rpc.rpc_sync(w, param_grads, args=(cid,)))
        counts = collections.Counter()
        for w in range(world_size):
            counts.update(rpc.rpc_sync(w, take_counts))
        desc = f"seed {seed}: {nodes} used {used}"
        for leaf, oracle in ((x0, l0), (x1, l1)):
            if oracle.grad is None:  # the program never used this leaf
                assert leaf not in grads, desc
            else:
                assert torch.allclose(grads[leaf], oracle.grad, atol=1e-5), desc
        assert set(got_params) == set(want_params), desc
        for tag, g in want_params.items():
            assert torch.allclose(got_params[tag], g, atol=1e-5), f"{desc} param {tag}"
        assert dict(counts) == want_counts, f"{desc}: node runs {dict(counts)} != {want_counts}"
        for w in range(world_size):
            rpc.rpc_sync(w, PARAMS.clear)
        checked += 1
    modes = collections.Counter()
    for w in range(world_size):
        modes.update(rpc.rpc_sync(w, dist_autograd.get_engine_stats))
    # both ways of running a worker's share were exercised
    assert modes["passes_native"] > 0 and modes["passes_shared"] > 0, modes
    assert modes["passes_discovered"] > 0, modes  # the unused-RPC fallback ran too
    return checked


@pytest.mark.parametrize("world_size,seeds", [(3, range(0, 25)), (4, range(100, 125))])
def test_random_graphs(world_size, seeds):
    res = run_workers(_random_programs, world_size=world_size, timeout=280, args=(list(seeds),))
    assert res[0] == len(seeds)
