"""DDP wrapped around a whole hybrid model (the DLRM pattern of PyTorch's "Combining
DDP with Distributed RPC" tutorial): on each trainer a local fc1, then an RPC to a
net on the server, then a local fc2, the whole model in DistributedDataParallel
over the trainers' gloo group. DDP's parameters thus lie on both sides of an RPC,
and their gradients arrive in different runs of the distributed engine.

In every trainer's context, every pass, the gradients of DDP's parameters must be
DDP's average over the trainers of what local autograd gives each trainer; the
server's net gets each trainer's own gradient in that trainer's context. Also with
``find_unused_parameters=True`` (an unused layer stays without gradient) and with
``ddp.join()`` over uneven inputs (a joined trainer counts as a zero gradient).
"""
import contextlib

import pytest
import torch
from mp_utils import free_port, run_workers
from torch import nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(300)
D = 4
NET: dict = {}


def _net():
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()


def _server_net():
    if "net" not in NET:
        NET["net"] = _net()
    return NET["net"]


def _server_forward(h):
    return _server_net()(h)


def _server_grads(cid):
    g = dist_autograd.get_gradients(cid)
    return [g[p].clone() if p in g else None for p in _server_net().parameters()]


class Hybrid(nn.Module):
    def __init__(self, remote_call, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(D, D).double()
        self.fc2 = nn.Linear(D, 3).double()
        self.unused = nn.Linear(D, D).double() if unused else None
        self.remote_call = remote_call

    def forward(self, x):
        h = self.remote_call(self.fc1(x).relu())
        return self.fc2(h)


def _remote(h):
    return rpc.rpc_sync("worker0", _server_forward, args=(h,))


def _batch(rank, i):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(5, D, dtype=torch.float64, generator=g)


def _loss(out):
    return (out * out).sum() + out[:, 0].sum()


def _trainer(rank, mode):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(rank)  # differs per trainer: DDP broadcasts trainer 1's
    model = DDP(Hybrid(_remote, unused=mode == "unused"), find_unused_parameters=mode == "unused")
    local = Hybrid(_net(), unused=mode == "unused")
    local.load_state_dict(model.module.state_dict(), strict=False)
    steps = {"plain": 2, "unused": 2, "join": 2 if rank == 1 else 3}[mode]
    out = []
    with model.join() if mode == "join" else contextlib.nullcontext():
        for i in range(steps):
            x = _batch(rank, i)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [_loss(model(x))])
                g = dist_autograd.get_gradients(cid)
                got = {n: (g[p].clone() if p in g else None) for n, p in model.module.named_parameters()}
                server = rpc.rpc_sync("worker0", _server_grads, args=(cid,))
                assert all(p.grad is None for p in model.parameters())  # context only
            local.zero_grad(set_to_none=True)
            _loss(local(x)).backward()
            want = {n: (p.grad.clone() if p.grad is not None else None)
                    for n, p in local.named_parameters() if not n.startswith("remote_call")}
            want_server = [p.grad.clone() for p in local.remote_call.parameters()]
            out.append((got, want, server, want_server))
    return out



def _main(rank, world, pg_port, modes):
    if rank == 0:
        _server_net()  # before any trainer's call (two first calls at once would race)
        return None
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank - 1, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
    try:
        from distgrad.autograd.engine import ENGINE
        out, stats = {}, {}
        for mode in modes:
            before = dict(ENGINE.stats)
            out[mode] = [(_lists(got), _lists(want), _lists(s), _lists(ws))
                         for got, want, s, ws in _trainer(rank, mode)]
            stats[mode] = {k: v - before.get(k, 0) for k, v in ENGINE.stats.items()}
        out["stats"] = stats   # which engine ran the trainer's passes, per mode
        return out
    finally:
        dist.destroy_process_group()


def _lists(v):
    if isinstance(v, torch.Tensor):
        return ("t", v.tolist())
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    return v


def _t(v):
    return None if v is None else torch.tensor(v[1], dtype=torch.float64)


MODES = ("plain", "unused", "join")


@pytest.fixture(scope="module")
def runs():
    """One cluster, one gloo group of the two trainers, the three modes in turn."""
    res = run_workers(_main, world_size=3, timeout=280, args=(free_port(), MODES))
    out = {mode: (res[1][mode], res[2][mode]) for mode in MODES}
    out["stats"] = (res[1]["stats"], res[2]["stats"])
    return out


def _check(runs, mode):
    a, b = runs[mode]
    compared = 0
    for i in range(max(len(a), len(b))):
        steps = [s[i] if i < len(s) else None for s in (a, b)]
        wants = [{k: _t(v) for k, v in s[1].items()} if s else None for s in steps]
        for s in steps:
            if s is None:
                continue
            got = {k: _t(v) for k, v in s[0].items()}
            for name, g in got.items():
                parts = [w[name] for w in wants if w is not None]
                if any(p is None for p in parts):
                    assert g is None and all(p is None for p in parts), name
                    continue
                # DDP divides by the initial world size; a joined trainer adds zeros
                torch.testing.assert_close(g, sum(parts) / 2, rtol=1e-9, atol=1e-12, msg=name)
                compared += 1
            # the server's net is no DDP member: each trainer's own gradient
            for g, w in zip(s[2], s[3]):
                torch.testing.assert_close(_t(g), _t(w), rtol=1e-9, atol=1e-12)
    # not vacuous: the trainers' own gradients differ
    w0 = {k: _t(v) for k, v in a[0][1].items()}
    w1 = {k: _t(v) for k, v in b[0][1].items()}
    assert not torch.allclose(w0["fc1.weight"], w1["fc1.weight"])
    return compared, a, b


def test_ddp_around_hybrid_model_averages_both_sides(runs):
    compared, a, b = _check(runs, "plain")
    assert compared == 2 * 2 * 4  # two trainers, two passes, fc1 and fc2 (weight, bias)


def test_ddp_hybrid_find_unused_parameters(runs):
    compared, a, b = _check(runs, "unused")
    assert compared == 2 * 2 * 4
    assert a[0][0]["unused.weight"] is None and b[1][0]["unused.bias"] is None


def test_ddp_hybrid_join_uneven_inputs(runs):
    compared, a, b = _check(runs, "join")
    assert len(a) == 2 and len(b) == 3
    assert compared == (2 + 3) * 4


def test_ddp_passes_are_one_graph_task_each(runs):
    """With the native engine, a trainer's every pass is one graph task of torch's engine,
    DDP's parameters included (their gradients go to a torch context of the share, where
    DDP's reducer reads and writes them: dist_share.cpp, ddp_capture); only a DDP with
    find_unused_parameters keeps the Python engine (its flush searches for unused
    parameters with what the pass reached)."""
    import os
    if os.environ.get("DISTGRAD_NATIVE", "1").strip() in ("0", ""):
        pytest.skip("DISTGRAD_NATIVE=0: the Python engine runs every pass")
    for per_mode in runs["stats"]:
        for mode, stats in per_mode.items():
            python = stats.get("passes_shared", 0) + stats.get("passes_native", 0)
            if mode == "unused":
                assert stats.get("passes_graph_task", 0) == 0 and python > 0, (mode, stats)
            else:
                assert stats.get("passes_graph_task", 0) > 0 and python == 0, (mode, stats)
