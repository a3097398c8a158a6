"""torch's own local autograd is unchanged by ``import distgrad`` (and ``init_rpc``).

distgrad patches torch when it is imported (tensor and node hook registration,
``retain_grad``, ``register_post_accumulate_grad_hook``, ``set_materialize_grads``,
the graph task's keep-graph query, reentrant checkpointing, ``torch.autograd.backward``,
DDP's constructor and reducer). Each patch must leave plain local autograd exactly as
it was. The same computations (:data:`SCENARIOS`: hooks of every kind, retain_grad,
checkpoint both ways, DDP on a one-process gloo group, ``set_materialize_grads``,
``autograd.backward``/``grad``, a backward on another thread, and the random-program
interpreter's local half on programs with every feature) run in a process that never
imported distgrad (tests/clean_ref.py) and in a worker that imported distgrad and
initialised RPC; every result (each tensor, ``.grad`` included, each hook's
observation, each absent gradient) must be equal bit for bit. The comparison itself is
checked: a register_hook that scales by 1 + 1e-12 (a faulty patch) is seen.

This module must not import distgrad at import time (the reference process imports it).
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading

import clean_ref
import pytest
import torch
from mp_utils import run_workers
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64


def _randn(*shape, dtype=F64, rg=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(rg)


def _clones(ts):
    return [None if t is None else t.detach().clone() for t in ts]


# -- the scenarios: each returns plain data and tensors, compared bit for bit ------------
def tensor_hooks() -> dict:
    """Hooks on a leaf, intermediates and a view: scaling, masking, clipping, an
    observer, a removed hook, in float64 and float32."""
    out = {}
    for dtype in (F64, torch.float32):
        torch.manual_seed(0)
        x, w = _randn(3, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)
        seen = []
        x.register_hook(lambda g, seen=seen: seen.append(g.clone()))
        y = x.sin() * 2
        y.register_hook(lambda g: g * 0.5)
        mask = (torch.arange(12).reshape(3, 4) % 3 != 0).to(dtype)
        y.register_hook(lambda g, m=mask: g * m)
        y.register_hook(lambda g: g * 100).remove()
        z = y.exp()
        z.register_hook(lambda g: g / g.norm().clamp(min=1.0))
        v = z[1]
        v.register_hook(lambda g: g * 3)
        ((z * w).sum() + v.sum()).backward()
        out[str(dtype)] = {"x.grad": x.grad, "seen": seen}
    return out


def node_hooks() -> dict:
    """Pre- and post-hooks on intermediates' nodes and on a leaf's AccumulateGrad."""
    torch.manual_seed(1)
    x, w = _randn(4), _randn(4)
    obs = []
    y = x * w
    u = y.tanh()
    u.grad_fn.register_prehook(lambda gos: (gos[0] * 3,))
    y.grad_fn.register_hook(lambda gis, gos: (gis[0] * -2, gis[1]))
    u.grad_fn.register_hook(lambda gis, gos: obs.append(_clones(gis) + _clones(gos)))
    acc = torch.autograd.graph.get_gradient_edge(x).node
    acc.register_prehook(lambda gos: (gos[0] * 0.25,))
    acc.register_hook(lambda gis, gos: obs.append(_clones(gos)))
    (u.sum() + (u * u).sum()).backward()
    del acc
    return {"x.grad": x.grad, "w.grad": w.grad, "obs": obs}


def post_accumulate_hooks() -> dict:
    """register_post_accumulate_grad_hook over two backward passes (it changes .grad)."""
    torch.manual_seed(2)
    p = _randn(5)
    log = []

    def hook(t):
        log.append(t.grad.clone())
        t.grad.mul_(0.5)
    p.register_post_accumulate_grad_hook(hook)
    for i in range(2):
        (p * (i + 1)).sin().sum().backward()
    return {"p.grad": p.grad, "log": log}


def retain_grad() -> dict:
    """retain_grad on an intermediate and a view, with a hook registered after it,
    over a retained graph's two passes."""
    torch.manual_seed(3)
    x = _randn(3, 2)
    y = x.exp()
    y.retain_grad()
    v = y[0]
    v.retain_grad()
    y2 = y * 1.5
    y2.retain_grad()
    y2.register_hook(lambda g: g * 2)
    z = (y2 * y).sum() + v.sum()
    z.backward(retain_graph=True)
    z.backward()
    return {"x.grad": x.grad, "y.grad": y.grad, "v.grad": v.grad, "y2.grad": y2.grad}


def _ckpt(reentrant: bool) -> dict:
    torch.manual_seed(4)
    mods = torch.nn.ModuleList([torch.nn.Linear(4, 4).double() for _ in range(3)])
    x = _randn(2, 4)

    def block(t):
        a = mods[0](t).tanh()
        if a.requires_grad:   # (reentrant: only during the recomputation)
            a.register_hook(lambda g: g * 0.5)
        return mods[1](a).sin()

    def nested(t):
        return mods[2](checkpoint(lambda s: mods[0](s).relu(), t, use_reentrant=reentrant)) * 2

    h = checkpoint(block, x, use_reentrant=reentrant)
    k = checkpoint(nested, h, use_reentrant=reentrant)
    ((k * k).sum() + h.sum()).backward()
    out = {"x.grad": x.grad, "params": [p.grad for p in mods.parameters()]}
    if not reentrant:   # torch.autograd.grad through a non-reentrant checkpoint
        x2 = _randn(2, 4)
        y = checkpoint(block, x2, use_reentrant=False)
        out["grad()"] = torch.autograd.grad((y ** 3).sum(), [x2, *mods[0].parameters()])
    return out


def checkpoint_reentrant() -> dict:
    """torch.utils.checkpoint(use_reentrant=True), nested, a hook in the block."""
    return _ckpt(True)


def checkpoint_non_reentrant() -> dict:
    """torch.utils.checkpoint(use_reentrant=False), nested, a hook, autograd.grad."""
    return _ckpt(False)


class _Two(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x, materialize):
        ctx.set_materialize_grads(materialize)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        _Two.seen.append((g1 is None, g2 is None, None if g2 is None else g2.clone()))
        total = g1 * 2 if g1 is not None else None
        if g2 is not None:
            total = g2 * 3 if total is None else total + g2 * 3
        return total, None


def materialize_grads() -> dict:
    """A custom Function with set_materialize_grads(True / False), one output unused."""
    _Two.seen = []
    out = {}
    for m in (True, False):
        torch.manual_seed(5)
        x = _randn(3)
        a, _b = _Two.apply(x, m)
        (a * a).sum().backward()
        out[m] = x.grad
    return {"grads": out, "seen": _Two.seen}


def backward_api() -> dict:
    """torch.autograd.backward with grad_tensors and inputs=, autograd.grad with
    create_graph (a second derivative), Tensor.backward(gradient)."""
    torch.manual_seed(6)
    x, w = _randn(3), _randn(3)
    y = (x * w).sin()
    torch.autograd.backward([y], [torch.ones(3, dtype=F64) * 0.5], inputs=[x], retain_graph=True)
    gx = x.grad.clone()
    torch.autograd.backward(y.sum(), retain_graph=True)
    y.backward(torch.arange(3, dtype=F64), retain_graph=True)
    (g,) = torch.autograd.grad(y.pow(2).sum(), [w], create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), [x])
    return {"gx": gx, "x.grad": x.grad, "w.grad": w.grad, "g": g.detach(), "h": h}


def backward_on_a_thread() -> dict:
    """A plain backward on another thread, over parameters this thread also uses."""
    torch.manual_seed(7)
    p = _randn(4)
    y1, y2 = (p * 2).tanh().sum(), (p.exp() * p).sum()
    t = threading.Thread(target=y1.backward)
    t.start()
    t.join()
    first = p.grad.clone()
    y2.backward()
    return {"first": first, "p.grad": p.grad}


class _Net(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.m = layers

    def forward(self, x):
        return self.m["b"](self.m["a"](x).tanh())


def ddp() -> dict:
    """DistributedDataParallel on a one-process gloo group: three SGD steps, with and
    without find_unused_parameters (an unused layer), every .grad and the parameters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    store = os.path.join(tempfile.mkdtemp(prefix="clean-torch-"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    out = {}
    try:
        for find_unused in (False, True):
            torch.manual_seed(8)
            layers = {"a": torch.nn.Linear(4, 8), "b": torch.nn.Linear(8, 3)}
            if find_unused:
                layers["unused"] = torch.nn.Linear(8, 3)
            model = torch.nn.ModuleDict(layers).double()

            net = DDP(_Net(model), find_unused_parameters=find_unused)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            steps = []
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                net(torch.randn(5, 4, dtype=F64)).pow(2).sum().backward()
                steps.append({n: p.grad for n, p in net.named_parameters()})
                opt.step()
            out[find_unused] = {"steps": steps, "params": {n: p.detach() for n, p in net.named_parameters()}}
    finally:
        dist.destroy_process_group()
    return out


# programs of tests/random_programs.py covering every feature, as (seed, world, weights):
# test_autograd_random's FEATURE_SEEDS (issue 18), THREAD_SEEDS (issue 26), PARAM_SEEDS
PROGRAMS = [(1157, 2, "company"), (1265, 2, "company"), (1280, 2, "company"), (1298, 2, "company"),
            (1406, 3, "company"), (1463, 3, "company"), (1560, 4, "company"), (1610, 4, "company"),
            (5038, 4, "company"), (357, 2, "threads"), (338, 2, "threads"), (451, 3, "threads"),
            (9625, 2, "params")]


def random_programs_local() -> dict:
    """The random-program interpreter's local half (the oracle of test_autograd_random)."""
    import random_programs as rp
    weights = {"company": rp.COMPANY, "threads": rp.parse_features("plain_thread,keep_grad,rendezvous,"
                                                                    "two_passes=0.3"),
               "params": rp.parse_features("params")}
    return {f"{s}/{w}": rp.run_local(rp.generate(s, w, weights[k])) for s, w, k in PROGRAMS}


SCENARIOS = {f.__name__: f for f in (
    tensor_hooks, node_hooks, post_accumulate_hooks, retain_grad, checkpoint_reentrant,
    checkpoint_non_reentrant, materialize_grads, backward_api, backward_on_a_thread, ddp,
    random_programs_local)}


def run_scenarios(names=None) -> dict:
    """{name: result} for ``names`` (all of :data:`SCENARIOS` when None)."""
    torch.set_num_threads(1)
    return {n: SCENARIOS[n]() for n in (names or SCENARIOS)}


def differences(want, got, path: str = "") -> list:
    """Where ``got`` differs from ``want``: tensors by torch.equal (dtype and shape
    too), containers item by item, other values by ==."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return [f"{path}: {type(got).__name__} != {type(want).__name__}"]
        if want.dtype != got.dtype or want.shape != got.shape or not torch.equal(want, got):
            return [f"{path}: {got.dtype} {tuple(got.shape)} {got.flatten()[:4].tolist()} != "
                    f"{want.dtype} {tuple(want.shape)} {want.flatten()[:4].tolist()}"]
        return []
    if isinstance(want, dict) and isinstance(got, dict):
        if want.keys() != got.keys():
            return [f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in differences(want[k], got[k], f"{path}/{k}")]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(want) != len(got):
            return [f"{path}: {len(got)} items != {len(want)}"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {got!r} != {want!r}"]


def _tensors(x) -> int:
    """How many tensors ``x`` holds (the scenarios must compare something)."""
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(map(_tensors, x.values()))
    if isinstance(x, (list, tuple)):
        return sum(map(_tensors, x))
    return 0


def _after_import(rank, world):
    """In a worker that imported distgrad and initialised RPC: every scenario, then the
    tensor hooks again after a deliberately faulty register_hook (scales by 1 + 1e-12)."""
    import distgrad.rpc as rpc
    assert rpc.get_worker_info().name == "worker0" and "distgrad.autograd" in sys.modules
    normal = run_scenarios()
    clean_ref.break_register_hook(1 + 1e-12)
    return clean_ref.pack((normal, run_scenarios(["tensor_hooks"])))


def test_local_autograd_after_import_distgrad_is_bit_for_bit_torch():
    want = clean_ref.reference(run_scenarios)
    assert all(_tensors(v) >= 2 for v in want.values()), {k: _tensors(v) for k, v in want.items()}
    normal, broken = clean_ref.unpack(run_workers(_after_import, world_size=1, timeout=200)[0])
    assert differences(want, normal) == []
    # the comparison is exact: a faulty patch that changes a hook's result by 1e-12
    # (below test_autograd_random's tolerance) shows
    assert differences(want["tensor_hooks"], broken["tensor_hooks"]) != []
