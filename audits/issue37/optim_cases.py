"""Audit of b3d5841 (DistributedOptimizer steps torch's functional twin): the same
program on torch.distributed.rpc + torch.distributed.optim and on distgrad.

Run one impl (prints its observations as JSON on the last line):
    PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/optim_cases.py --impl torch|distgrad [--jit0] [case ...]
Compare both: audits/issue37/optim_diff.py.

3 spawned workers on 127.0.0.1: worker0 trainer, worker1 owner, worker2 a second owner
and a second trainer process. The torch run never imports distgrad.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

S: dict = {}          # owner state: name -> Parameter
HOOKS = {"pre": 0, "post": 0, "inst_pre": 0}


def dopt(impl):
    if impl == "torch":
        from torch.distributed.optim import DistributedOptimizer
    else:
        from distgrad.optim import DistributedOptimizer
    return DistributedOptimizer


def r4(t):
    if t is None:
        return None
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return [round(float(v), 5) for v in t.reshape(-1)]


def err(e):
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # first line and the last line (the owner's original error for remote failures)
    tail = lines[-1][:220] if len(lines) > 1 else ""
    return f"{type(e).__name__}: {lines[0][:120] if lines else ''}" + (f" ... {tail}" if tail else "")


class MySGD(torch.optim.SGD):        # a subclass: not in functional_optim_map
    pass


# ---- owner side -------------------------------------------------------------
def mk(name, n, seed, sparse=False):
    g = torch.Generator().manual_seed(seed)
    if sparse:
        emb = nn.Embedding(n, 2, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.randn(n, 2, generator=g))
        S[name] = emb.weight
        S[name + "_emb"] = emb
    else:
        S[name] = nn.Parameter(torch.randn(n, generator=g))
    return S[name]


def fwd(name, x):
    p = S[name]
    return ((p * x) ** 2).sum() + (p * x).sum()


def fwd_emb(name, idx):
    return (S[name + "_emb"](idx) ** 2).sum()


def peek(names):
    return {n: {"v": r4(S[n]), "grad": r4(S[n].grad)} for n in names}


def set_grad(name, val):
    S[name].grad = torch.full_like(S[name], val)


def install_global_hooks():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(opt, a, k):
        HOOKS["pre"] += 1

    def post(opt, a, k):
        HOOKS["post"] += 1
    S["_h"] = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))


def remove_global_hooks():
    for h in S.pop("_h"):
        h.remove()
    out = dict(HOOKS)
    HOOKS.update(pre=0, post=0, inst_pre=0)
    return out


def inst_hook(optim_rref):
    lo = optim_rref.local_value()
    o = getattr(lo, "optim", None)
    desc = type(o).__name__
    if hasattr(o, "register_step_pre_hook"):
        def h(opt, a, k):
            HOOKS["inst_pre"] += 1
        o.register_step_pre_hook(h)
        return ["registered", desc]
    return ["no register_step_pre_hook", desc]


def start_reader(name):
    S["_seen"] = set()
    S["_stop"] = threading.Event()

    def loop():
        while not S["_stop"].is_set():
            g = S[name].grad
            S["_seen"].add("None" if g is None else "tensor")
            time.sleep(0.0005)
    S["_t"] = threading.Thread(target=loop, daemon=True)
    S["_t"].start()


def stop_reader():
    S["_stop"].set()
    S["_t"].join(5)
    return sorted(S["_seen"])


def capture_stderr(rank):
    path = os.path.join(tempfile.gettempdir(), f"optim_audit_{os.getpid()}_{rank}.err")
    f = open(path, "w+")
    os.dup2(f.fileno(), 2)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    S["_errpath"] = path


def read_stderr():
    sys.stderr.flush()
    with open(S["_errpath"]) as f:
        lines = f.read().splitlines()
    os.unlink(S["_errpath"])
    keep = [ln.strip()[:200] for ln in lines if "UserWarning" in ln or "arn" in ln or "TorchScript" in ln or "deprecat" in ln]
    return keep


# ---- trainer side -----------------------------------------------------------
def train(rpc, da, impl, cls, names, steps, *args, owners=None, unused=(), **kw):
    """names: list of (owner, name); returns error or None."""
    DO = dopt(impl)
    rrefs = {}
    for i, (o, n) in enumerate(names):
        rrefs[n] = rpc.remote(o, mk, args=(n, 3, 10 + i))
    for i, (o, n) in enumerate(unused):
        rrefs[n] = rpc.remote(o, mk, args=(n, 3, 50 + i))
    opt = DO(cls, list(rrefs.values()), *args, **kw)
    for s in range(steps):
        with da.context() as cid:
            x = torch.tensor([1.0, -2.0, 0.5]) * (s + 1)
            loss = sum(rpc.rpc_sync(o, fwd, args=(n, x)) for o, n in names)
            da.backward(cid, [loss])
            opt.step(cid)
    return opt, rrefs


def observe(rpc, names):
    out = {}
    for o in sorted({o for o, _ in names}):
        out.update(rpc.rpc_sync(o, peek, args=([n for oo, n in names if oo == o],)))
    return out


CONFIGS = [
    ("SGD", torch.optim.SGD, (), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, dampening=0.0)),
    ("SGD_max", torch.optim.SGD, (), dict(lr=0.05, momentum=0.5, dampening=0.1, maximize=True)),
    ("SGD_foreach", torch.optim.SGD, (), dict(lr=0.05, momentum=0.9, foreach=True)),
    ("SGD_nolr", torch.optim.SGD, (), dict(momentum=0.9)),
    ("Adam", torch.optim.Adam, (), dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=True)),
    ("Adam_max", torch.optim.Adam, (), dict(lr=0.01, maximize=True, eps=1e-3)),
    ("Adam_foreach", torch.optim.Adam, (), dict(lr=0.01, foreach=True)),
    ("AdamW", torch.optim.AdamW, (), dict(lr=0.01, betas=(0.7, 0.9), weight_decay=0.2, amsgrad=True)),
    ("Adagrad", torch.optim.Adagrad, (), dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                              initial_accumulator_value=0.5, eps=1e-4)),
    ("Adadelta", torch.optim.Adadelta, (), dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1, maximize=True)),
    ("RMSprop", torch.optim.RMSprop, (), dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1,
                                              momentum=0.5, centered=True)),
    ("Rprop", torch.optim.Rprop, (), dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-4, 1.0), maximize=True)),
    ("Adamax", torch.optim.Adamax, (), dict(lr=0.01, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.1)),
    ("Adamax_nolr", torch.optim.Adamax, (), dict()),
    ("pos_SGD", torch.optim.SGD, (0.05, 0.9, 0.0, 0.01, True), {}),
    ("pos_Adagrad_eps", torch.optim.Adagrad, (0.1, 0.0, 0.0, 0.0, 1e-3), {}),
    ("pos_RMSprop7", torch.optim.RMSprop, (0.01, 0.9, 1e-8, 0.0, 0.5, False, True), {}),
    ("pos_Adam", torch.optim.Adam, (0.01, (0.8, 0.9), 1e-6, 0.1, True), {}),
    ("subclass", MySGD, (), dict(lr=0.05, momentum=0.9)),
    # kwargs the twin does not take / twin-only kwargs / tensors
    ("kw_SGD_differentiable", torch.optim.SGD, (), dict(lr=0.05, differentiable=True)),
    ("kw_SGD_fused", torch.optim.SGD, (), dict(lr=0.05, fused=True)),
    ("kw_Adam_fused", torch.optim.Adam, (), dict(lr=0.01, fused=True)),
    ("kw_Adam_capturable", torch.optim.Adam, (), dict(lr=0.01, capturable=True)),
    ("kw_Adam_decoupled", torch.optim.Adam, (), dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("kw_SGD_lr_tensor", torch.optim.SGD, (), dict(lr=torch.tensor(0.05))),
    ("kw_Adagrad_warmup", torch.optim.Adagrad, (), dict(lr=0.1, warmup_lr_multiplier=2.0, warmup_num_iters=2)),
    ("kw_SGD_allow_empty", torch.optim.SGD, (), dict(lr=0.1, _allow_empty_param_list=True)),
    # invalid hyper-parameters
    ("bad_SGD_neg_lr", torch.optim.SGD, (), dict(lr=-0.1)),
    ("bad_SGD_neg_momentum", torch.optim.SGD, (), dict(lr=0.1, momentum=-0.5)),
    ("bad_SGD_nesterov_nomom", torch.optim.SGD, (), dict(lr=0.1, nesterov=True)),
    ("bad_Adam_neg_lr", torch.optim.Adam, (), dict(lr=-0.01)),
    ("bad_Adagrad_neg_lr", torch.optim.Adagrad, (), dict(lr=-0.1)),
    ("bad_RMSprop_neg_alpha", torch.optim.RMSprop, (), dict(lr=0.01, alpha=-1.0)),
    ("bad_Rprop_etas", torch.optim.Rprop, (), dict(lr=0.01, etas=(1.5, 0.5))),
]


def case_configs(rank, rpc, da, impl, out):
    for tag, cls, args, kw in CONFIGS:
        names = [("worker1", f"{tag}_a"), ("worker2", f"{tag}_b")]
        unused = [("worker1", f"{tag}_z")]
        try:
            train(rpc, da, impl, cls, names, 3, *args, unused=unused, **kw)
            out[f"cfg.{tag}"] = observe(rpc, names + unused)
        except Exception as e:  # noqa: BLE001
            out[f"cfg.{tag}"] = "raised " + err(e)


def case_dup(rank, rpc, da, impl, out):
    DO = dopt(impl)
    r = rpc.remote("worker1", mk, args=("dup", 3, 1))
    opt = DO(torch.optim.SGD, [r, r], lr=0.1)
    with da.context() as cid:
        da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=("dup", torch.ones(3)))])
        opt.step(cid)
    out["dup_same_rref_twice"] = observe(rpc, [("worker1", "dup")])
    # two RRefs (a fork each) to one owner parameter
    r2 = rpc.remote("worker1", mk, args=("dup2", 3, 1))
    opt = DO(torch.optim.Adam, [r2, r2], lr=0.1)
    with da.context() as cid:
        da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=("dup2", torch.ones(3)))])
        opt.step(cid)
    out["dup_same_rref_twice_adam"] = observe(rpc, [("worker1", "dup2")])


def case_existing_grad(rank, rpc, da, impl, out):
    DO = dopt(impl)
    for cls in (torch.optim.SGD, MySGD):
        n = f"eg_{cls.__name__}"
        r = rpc.remote("worker1", mk, args=(n, 3, 2))
        z = rpc.remote("worker1", mk, args=(n + "_z", 3, 3))
        r.to_here(), z.to_here()        # rpc.remote is asynchronous: the values exist first
        rpc.rpc_sync("worker1", set_grad, args=(n, 100.0))
        rpc.rpc_sync("worker1", set_grad, args=(n + "_z", 7.0))
        opt = DO(cls, [r, z], lr=0.1)
        with da.context() as cid:
            da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(n, torch.ones(3)))])
            opt.step(cid)
        out[f"existing_grad.{cls.__name__}"] = observe(rpc, [("worker1", n), ("worker1", n + "_z")])


def case_hooks(rank, rpc, da, impl, out):
    DO = dopt(impl)
    for cls in (torch.optim.SGD, torch.optim.Adam, MySGD):
        n = f"hk_{cls.__name__}"
        r = rpc.remote("worker1", mk, args=(n, 3, 4))
        rpc.rpc_sync("worker1", install_global_hooks)
        opt = DO(cls, [r], lr=0.1)
        inst = [rpc.rpc_sync(o.owner(), inst_hook, args=(o,)) for o in opt.remote_optimizers]
        for _ in range(2):
            with da.context() as cid:
                da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(n, torch.ones(3)))])
                opt.step(cid)
        out[f"hooks.{cls.__name__}"] = {"counts": rpc.rpc_sync("worker1", remove_global_hooks),
                                        "instance": inst}


def case_reader(rank, rpc, da, impl, out):
    DO = dopt(impl)
    for cls in (torch.optim.SGD, MySGD):
        n = f"rd_{cls.__name__}"
        r = rpc.remote("worker1", mk, args=(n, 3, 5))
        opt = DO(cls, [r], lr=0.01)
        rpc.rpc_sync("worker1", start_reader, args=(n,))
        for _ in range(30):
            with da.context() as cid:
                da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(n, torch.ones(3)))])
                opt.step(cid)
        out[f"reader_sees_grad.{cls.__name__}"] = rpc.rpc_sync("worker1", stop_reader)
        out[f"reader_after.{cls.__name__}"] = observe(rpc, [("worker1", n)])[n]["grad"]


def case_sparse(rank, rpc, da, impl, out):
    DO = dopt(impl)
    for tag, cls, kw in [("SGD", torch.optim.SGD, dict(lr=0.1)),
                         ("SGD_mom", torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                         ("Adagrad", torch.optim.Adagrad, dict(lr=0.1)),
                         ("Adam", torch.optim.Adam, dict(lr=0.1)),
                         ("SparseAdam", torch.optim.SparseAdam, dict(lr=0.1))]:
        n = f"sp_{tag}"
        try:
            r = rpc.remote("worker1", mk, args=(n, 5, 6), kwargs={"sparse": True})
            opt = DO(cls, [r], **kw)
            for s in range(2):
                with da.context() as cid:
                    loss = rpc.rpc_sync("worker1", fwd_emb, args=(n, torch.tensor([0, 2, 2 + s])))
                    da.backward(cid, [loss])
                    opt.step(cid)
            out[f"sparse.{tag}"] = observe(rpc, [("worker1", n)])
        except Exception as e:  # noqa: BLE001
            out[f"sparse.{tag}"] = "raised " + err(e)


def trainer_loop(impl, name, steps, cls_name, lr):
    rpc, da = _harness.modules(impl)
    DO = dopt(impl)
    r = S["shared_rref"]
    opt = DO(getattr(torch.optim, cls_name), [r], lr=lr)
    for s in range(steps):
        with da.context() as cid:
            da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(name, torch.ones(3) * 0.1))])
            opt.step(cid)
    return steps


def set_shared(rref):
    S["shared_rref"] = rref


def case_concurrent(rank, rpc, da, impl, out):
    # Same parameter stepped by two trainer threads on worker0 and a trainer on worker2.
    # SGD without momentum: the result depends only on the order of the steps; with a
    # gradient linear in p ((p*x)^2 + p*x) the orders differ slightly, so compare rounded.
    n = "shared"
    r = rpc.remote("worker1", mk, args=(n, 3, 7))
    S["shared_rref"] = r
    rpc.rpc_sync("worker2", set_shared, args=(r,))
    res = {}

    def th(i):
        res[i] = trainer_loop(impl, n, 20, "SGD", 0.001)
    ts = [threading.Thread(target=th, args=(i,)) for i in range(2)]
    fut = rpc.rpc_async("worker2", trainer_loop, args=(impl, n, 20, "SGD", 0.001))
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    fut.wait()
    v = observe(rpc, [("worker1", n)])[n]
    out["concurrent_3_trainers_SGD"] = {"v": [round(a, 3) for a in v["v"]], "grad": v["grad"],
                                        "done": sorted(res.values())}


def case_adagrad_nograd(rank, rpc, da, impl, out):
    # Adagrad over [z, a] on one owner, only a gets a gradient (z first, then z last).
    DO = dopt(impl)
    for order in ("z_first", "z_last"):
        a, z = f"ag_{order}_a", f"ag_{order}_z"
        ra = rpc.remote("worker1", mk, args=(a, 3, 8))
        rz = rpc.remote("worker1", mk, args=(z, 3, 9))
        opt = DO(torch.optim.Adagrad, [rz, ra] if order == "z_first" else [ra, rz], lr=0.1)
        try:
            with da.context() as cid:
                da.backward(cid, [rpc.rpc_sync("worker1", fwd, args=(a, torch.ones(3)))])
                opt.step(cid)
            out[f"adagrad_nograd.{order}"] = observe(rpc, [("worker1", a), ("worker1", z)])
        except Exception as e:  # noqa: BLE001
            out[f"adagrad_nograd.{order}"] = "raised " + err(e)


def probe_warn():
    warnings.warn("owner UserWarning after the optimizers were built", UserWarning)
    return warnings._showwarnmsg_impl.__qualname__


def build_opt(impl, rref):
    DO = dopt(impl)
    DO(torch.optim.SGD, [rref], lr=0.1)
    return True


def case_warn_race(rank, rpc, da, impl, out):
    # run first in a fresh set of workers: two trainers (worker0, worker2) build a
    # DistributedOptimizer over worker1's parameter at the same moment.
    r = rpc.remote("worker1", mk, args=("wr", 3, 1))
    r.to_here()
    fut = rpc.rpc_async("worker2", build_opt, args=(impl, r))
    build_opt(impl, r)
    fut.wait()
    out["warn_race.owner_showwarnmsg_impl"] = rpc.rpc_sync("worker1", probe_warn)


def case_jitflag(rank, rpc, da, impl, out):
    import torch.jit
    out["jit_enabled_on_trainer"] = bool(torch.jit._state._enabled)


CASES = {"configs": case_configs, "dup": case_dup, "existing_grad": case_existing_grad,
         "hooks": case_hooks, "reader": case_reader, "sparse": case_sparse,
         "concurrent": case_concurrent, "adagrad_nograd": case_adagrad_nograd, "warn_race": case_warn_race, "jitflag": case_jitflag}


def scenario(rank, rpc, da, impl):
    if rank != 0:
        capture_stderr(rank)
    if rank != 0:
        # owners wait for worker0 to be done
        while not S.get("_done"):
            time.sleep(0.05)
        return {"stderr_warnings": read_stderr()}
    out = {}
    for name in os.environ.get("OPTIM_AUDIT_CASES", ",".join(CASES)).split(","):
        t0 = time.time()
        try:
            CASES[name](rank, rpc, da, impl, out)
        except Exception as e:  # noqa: BLE001
            out[f"case.{name}"] = "raised " + err(e)
        print(f"[{impl}] case {name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    for w in ("worker1", "worker2"):
        rpc.rpc_sync(w, set_done)
    return out


def set_done():
    S["_done"] = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["torch", "distgrad"], required=True)
    ap.add_argument("--jit0", action="store_true", help="PYTORCH_JIT=0 in the workers")
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if a.cases:
        os.environ["OPTIM_AUDIT_CASES"] = ",".join(a.cases)
    if a.jit0:
        os.environ["PYTORCH_JIT"] = "0"
    res = _harness.run("optim_cases", "scenario", a.impl, world=3, timeout=400)
    print(json.dumps({str(k): v for k, v in res.items()}, sort_keys=True))


if __name__ == "__main__":
    main()
