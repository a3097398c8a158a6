"""distgrad.optim.DistributedOptimizer on real worker processes."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
from mp_utils import run_workers

STEPS = 5


# ---------------------------------------------------------------------------
# helpers that run on the owners (module-level: pickled by reference)
# ---------------------------------------------------------------------------
def _make_linear(in_f: int, out_f: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f)


def _param_rrefs(module_rref):
    import distgrad.rpc as rpc
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def _state(module_rref):
    m = module_rref.local_value()
    return {"params": [p.detach().clone() for p in m.parameters()],
            "grads_none": all(p.grad is None for p in m.parameters())}


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


OPTIMS = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _match_local(rank, world_size, optim_name):
    """worker0 drives: layer1 on worker1, layer2 on worker2, a bias on worker0 itself."""
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer

    cls, kw = OPTIMS[optim_name]
    l1 = rpc.remote("worker1", _make_linear, args=(4, 8, 1))
    l2 = rpc.remote("worker2", _make_linear, args=(8, 2, 2))
    bias = torch.zeros(2, requires_grad=True)
    params = (rpc.rpc_sync("worker1", _param_rrefs, args=(l1,))
              + rpc.rpc_sync("worker2", _param_rrefs, args=(l2,)) + [rpc.RRef(bias)])
    opt = DistributedOptimizer(cls, params, **kw)
    assert len(opt.remote_optimizers) == 3

    # the same model, trained in this process with plain autograd
    ref1, ref2 = _make_linear(4, 8, 1), _make_linear(8, 2, 2)
    ref_bias = torch.zeros(2, requires_grad=True)
    ref_opt = cls(list(ref1.parameters()) + list(ref2.parameters()) + [ref_bias], **kw)

    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        with dist_autograd.context() as cid:
            h = torch.relu(l1.rpc_sync().forward(x))
            out = l2.rpc_sync().forward(h) + bias
            loss = ((out - y) ** 2).mean()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        losses.append(loss.item())

        ref_opt.zero_grad()
        ref_loss = ((ref2(torch.relu(ref1(x))) + ref_bias - y) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())

    s1 = rpc.rpc_sync("worker1", _state, args=(l1,))
    s2 = rpc.rpc_sync("worker2", _state, args=(l2,))
    got = s1["params"] + s2["params"] + [bias.detach()]
    want = [p.detach() for p in list(ref1.parameters()) + list(ref2.parameters())] + [ref_bias.detach()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # gradients only lived in .grad during the step
    assert s1["grads_none"] and s2["grads_none"] and bias.grad is None
    # parameters really moved
    assert not torch.allclose(got[0], _make_linear(4, 8, 1).weight)
    return losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optim_name", sorted(OPTIMS))
def test_matches_local_optimizer(optim_name):
    losses = run_workers(_match_local, world_size=3, timeout=200, args=(optim_name,))[0]
    assert len(losses) == STEPS


# ---------------------------------------------------------------------------
# concurrent trainers on one parameter server
# ---------------------------------------------------------------------------
_SERVER: dict = {}
LR = 0.25
TRAIN_STEPS = 8


class SlowSGD(torch.optim.SGD):
    """SGD that dawdles inside step, widening any race on the parameters' .grad."""

    def step(self, closure=None):
        st = _SERVER.setdefault("stats", {"inside": 0, "max_inside": 0, "lock": threading.Lock()})
        with st["lock"]:
            st["inside"] += 1
            st["max_inside"] = max(st["max_inside"], st["inside"])
        try:
            time.sleep(0.05)
            return super().step(closure)
        finally:
            with st["lock"]:
                st["inside"] -= 1


def _server_param():
    return _SERVER["w"]


def _arrive():
    """Both trainers call this before each step: returns when both are there."""
    _SERVER["barrier"].wait()


def _server_forward(x):
    return (_SERVER["w"] * x).sum()


def _trainer_x(rank: int, step: int) -> torch.Tensor:
    return torch.full((4,), float(rank * 10 + step))


def _trainer_loop(rank: int):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer

    w_rref = rpc.remote("worker0", _server_param)
    opt = DistributedOptimizer(SlowSGD, [w_rref], lr=LR)
    spans = []
    for step in range(TRAIN_STEPS):
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("worker0", _server_forward, args=(_trainer_x(rank, step),))
            dist_autograd.backward(cid, [loss])
            rpc.rpc_sync("worker0", _arrive)     # line the two trainers up: steps collide
            t0 = time.time()
            opt.step(cid)
            spans.append((t0, time.time()))
    return spans


def _param_server(rank, world_size):
    if rank != 0:
        return None
    import distgrad.rpc as rpc
    w = torch.zeros(4, requires_grad=True)
    _SERVER["w"] = w
    _SERVER["barrier"] = threading.Barrier(2, timeout=120)
    futs = [rpc.rpc_async(f"worker{r}", _trainer_loop, args=(r,)) for r in (1, 2)]
    spans = [f.wait() for f in futs]
    expected = torch.zeros(4)
    for r in (1, 2):
        for step in range(TRAIN_STEPS):
            expected -= LR * _trainer_x(r, step)
    overlapped = any(a0 < b1 and b0 < a1 for a0, a1 in spans[0] for b0, b1 in spans[1])
    # plain lists: tensors in the result queue would travel as shared memory
    return {"w": w.detach().tolist(), "expected": expected.tolist(), "grad_none": w.grad is None,
            "max_inside": _SERVER["stats"]["max_inside"], "overlapped": overlapped}


@pytest.mark.timeout(240)
def test_concurrent_trainers_on_parameter_server():
    res = run_workers(_param_server, world_size=3, timeout=200)[0]
    assert res["w"] == res["expected"]
    assert res["grad_none"]
    assert res["max_inside"] == 1        # steps on the same parameter never overlapped
    assert res["overlapped"]             # ... although the trainers' step() calls did


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
class BoomOptimizer(torch.optim.SGD):
    def step(self, closure=None):
        raise ValueError("boom from the optimizer")


def _make_param():
    return torch.ones(3, requires_grad=True)


def _forward(p_rref, x):
    return (p_rref.local_value() * x).sum()


def _errors(rank, world_size):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer

    out = {}
    p1 = rpc.remote("worker1", _make_param)
    p2 = rpc.remote("worker2", _make_param)

    # 1. the optimizer's step raises on worker2 only (worker1 steps fine)
    good = DistributedOptimizer(torch.optim.SGD, [p1], lr=0.5)
    bad = DistributedOptimizer(BoomOptimizer, [p2], lr=0.5)
    with dist_autograd.context() as cid:
        loss = (rpc.rpc_sync("worker1", _forward, args=(p1, torch.ones(3)))
                + rpc.rpc_sync("worker2", _forward, args=(p2, torch.ones(3))))
        dist_autograd.backward(cid, [loss])
        good.step(cid)
        try:
            bad.step(cid)
        except Exception as e:  # noqa: BLE001
            out["step"] = (type(e).__name__, str(e))
        both = DistributedOptimizer(BoomOptimizer, [p1, p2], lr=0.5)
        try:
            both.step(cid)
        except Exception as e:  # noqa: BLE001
            out["both"] = (type(e).__name__, str(e), getattr(e, "__notes__", []))
    out["p1"] = p1.to_here().detach().tolist()

    # 2. a bad hyper-parameter fails at construction, naming the owner (Adam's twin
    # refuses a negative lr as torch.optim.Adam does; SGD's twin takes one, as torch)
    try:
        DistributedOptimizer(torch.optim.Adam, [p2], lr=-1.0)
    except Exception as e:  # noqa: BLE001
        out["init"] = (type(e).__name__, str(e))

    # 3. a context the owner never saw (outside any context, so no RPC carries it there)
    try:
        good.step(123456789)
    except Exception as e:  # noqa: BLE001
        out["context"] = (type(e).__name__, str(e))
    return out


@pytest.mark.timeout(240)
def test_errors_propagate_and_name_the_worker():
    out = run_workers(_errors, world_size=3, timeout=200)[0]
    kind, msg = out["step"]
    assert kind == "ValueError" and "boom from the optimizer" in msg and "worker2" in msg
    kind, msg, notes = out["both"]
    assert "boom from the optimizer" in msg
    named = [n for n in ("worker1", "worker2") if n in msg]
    assert named, msg
    other = ({"worker1", "worker2"} - set(named)).pop()
    assert len(named) == 2 or any(other in n for n in notes), (msg, notes)
    # the good optimizer stepped once: 1 - 0.5 * 1
    assert out["p1"] == [0.5, 0.5, 0.5]
    kind, msg = out["init"]
    assert kind == "ValueError" and "worker2" in msg and "learning rate" in msg.lower()
    kind, msg = out["context"]
    assert "worker1" in msg and "context" in msg.lower()


def test_param_lock_table_survives_a_weakref_callback_inside_it():
    # The garbage collector can run inside _lock_of (it allocates) and fire a dead
    # parameter's weakref callback, _forget, on the same thread while the guard is
    # held: that must not deadlock (it did with a plain lock).
    import threading

    import torch

    from distgrad.optim import optimizer as opt_mod
    done = threading.Event()

    def nested():
        with opt_mod._locks_guard:
            p = torch.zeros(1)
            lock = opt_mod._lock_of(p)  # the guard taken again on this thread
            key, entry = id(p), opt_mod._param_locks[id(p)]
            opt_mod._forget(key, entry[0])  # a callback run while the guard is held
            assert key not in opt_mod._param_locks and isinstance(lock, type(threading.Lock()))
        done.set()
    t = threading.Thread(target=nested, daemon=True)
    t.start()
    assert done.wait(10), "the parameter lock table deadlocked on its own thread"


# ---------------------------------------------------------------------------
# torch's functional twins: no .grad written (as torch's DistributedOptimizer)
# ---------------------------------------------------------------------------
_SEEN: dict = {}


def _owner_setup():
    """On the owner: a parameter with a .grad of its own, and a global step pre-hook
    that records what every torch.optim step sees in .grad."""
    w = torch.ones(3, requires_grad=True)
    w.grad = torch.full((3,), 7.0)
    _SEEN.update(w=w, own_grad=w.grad, hook_saw=[])

    def pre_hook(opt, args, kwargs):
        _SEEN["hook_saw"].append([None if p.grad is None else p.grad.tolist()
                                  for g in opt.param_groups for p in g["params"]])
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _SEEN["handle"] = register_optimizer_step_pre_hook(pre_hook)
    return w


def _owner_unused():
    _SEEN["u"] = torch.ones(2, requires_grad=True)
    return _SEEN["u"]


def _owner_report():
    w = _SEEN["w"]
    return {"w": w.detach().tolist(), "grad_kept": w.grad is _SEEN["own_grad"],
            "u": _SEEN["u"].detach().tolist() if "u" in _SEEN else None,
            "grad": w.grad.tolist(), "hook_saw": list(_SEEN["hook_saw"])}


class PlainSGD(torch.optim.SGD):
    """A subclass: torch has no functional twin for it, so it reads .grad."""


def _functional(rank, world_size):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.optim import DistributedOptimizer

    w = rpc.remote("worker1", _owner_setup)
    out = {}
    for name, cls, kw in (("SGD", torch.optim.SGD, {"lr": 0.5}),
                          ("SGD differentiable", torch.optim.SGD, {"lr": 0.5, "differentiable": False}),
                          ("subclass", PlainSGD, {"lr": 0.5})):
        opt = DistributedOptimizer(cls, [w], **kw)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("worker1", _forward, args=(w, torch.full((3,), 2.0)))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        out[name] = rpc.rpc_sync("worker1", _owner_report)
    # a parameter without a gradient in the context, listed first: Adagrad's twin run
    # in Python failed on it (torch's TorchScript run steps the wrong parameter)
    u = rpc.remote("worker1", _owner_unused)
    opt = DistributedOptimizer(torch.optim.Adagrad, [u, w], lr=0.5)
    for _ in range(2):
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("worker1", _forward, args=(w, torch.full((3,), 2.0)))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    out["Adagrad unused"] = rpc.rpc_sync("worker1", _owner_report)
    return out


@pytest.mark.timeout(240)
def test_functional_twin_steps_without_writing_grad():
    out = run_workers(_functional, world_size=2, timeout=200)[0]
    # SGD: torch's functional twin; no torch.optim step ran, .grad untouched
    assert out["SGD"]["w"] == [0.0, 0.0, 0.0]
    assert out["SGD"]["hook_saw"] == [] and out["SGD"]["grad_kept"] and out["SGD"]["grad"] == [7.0] * 3
    # an argument the twin does not take: the class steps, through .grad, then restores it
    assert out["SGD differentiable"]["w"] == [-1.0, -1.0, -1.0]
    assert out["SGD differentiable"]["hook_saw"] == [[[2.0, 2.0, 2.0]]]
    assert out["SGD differentiable"]["grad_kept"] and out["SGD differentiable"]["grad"] == [7.0] * 3
    # a subclass: the same
    assert out["subclass"]["w"] == [-2.0, -2.0, -2.0]
    assert out["subclass"]["hook_saw"] == [[[2.0, 2.0, 2.0]]] * 2
    assert out["subclass"]["grad_kept"]
    # Adagrad: every step adds g^2 = 4 to its sum: steps of 0.5 * 2 / 2, then 0.5 * 2 / sqrt(8)
    expected = -2.0 - 0.5 - 1.0 / 8 ** 0.5
    assert out["Adagrad unused"]["w"] == pytest.approx([expected] * 3)
    assert out["Adagrad unused"]["u"] == [1.0, 1.0] and out["Adagrad unused"]["hook_saw"] == [[[2.0] * 3]] * 2


def test_twins_built_on_many_threads_leave_warnings_as_they_were(monkeypatch):
    # catch_warnings swaps process-wide state; two threads inside it at once (enter A,
    # enter B, exit A, exit B) left the process recording its warnings into a list
    # nobody reads (audit of the twin change: optim_warnings_race.py)
    import warnings

    import torch.distributed.optim.utils as torch_optim_utils

    from distgrad.optim import optimizer as opt_mod
    # the first one imports torch.distributed.optim, whose imports add filters of their own
    opt_mod._functional_twin(torch.optim.SGD, [torch.zeros(2, requires_grad=True)], (0.1,), {})
    real = torch_optim_utils.functional_optim_map[torch.optim.SGD]

    class SlowTwin(real):   # a constructor slow enough that the two windows overlap
        def __init__(self, params, *args, **kwargs):
            time.sleep(0.3 if threading.current_thread().name == "A" else 0.6)
            super().__init__(params, *args, **kwargs)
    monkeypatch.setitem(torch_optim_utils.functional_optim_map, torch.optim.SGD, SlowTwin)
    before_filters, before_show = list(warnings.filters), warnings.showwarning
    before_impl = warnings._showwarnmsg_impl

    def build():
        opt_mod._functional_twin(torch.optim.SGD, [torch.zeros(2, requires_grad=True)], (0.1,), {})
    a, b = threading.Thread(target=build, name="A"), threading.Thread(target=build, name="B")
    a.start()
    time.sleep(0.1)
    b.start()
    a.join(30)
    b.join(30)
    assert warnings.filters == before_filters
    assert warnings.showwarning is before_show and warnings._showwarnmsg_impl is before_impl
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("still shown", stacklevel=1)
    assert [str(w.message) for w in seen] == ["still shown"]
