"""One program, run on torch's RPC and distributed autograd and on distgrad's, each in
processes of its own (the torch run never imports distgrad): what a user, a hook or
another thread can observe must be the same (issue 34).

    python tests/torch_differential.py --impl torch      # prints one JSON line
    python tests/torch_differential.py --impl distgrad

What worker0 records, on two workers:
  - gradients kept from ``get_gradients`` across two passes in one context: a leaf
    sent to worker1 (a received gradient), a leaf used locally, a sparse embedding
    used locally and one whose lookup runs on worker1;
  - calls of a post-accumulate-grad hook over three distributed passes;
  - ``.grad`` of a leaf seen by a watching thread during those passes;
  - a reply's callback that waits for another reply to the same worker;
  - pre- and post-hooks on a received tensor's recv function (its name, what the hooks
    saw, the gradient that reaches the sender);
  - nn.Parameters sent both ways (a reply of a server's parameters, a view of one, an
    argument with attributes, a Parameter subclass, an UninitializedParameter, a
    Parameter through an RRef and through a RemoteModule): their type, leafness,
    grad_fn, attributes, the gradients each side keeps, and the .grad a local backward
    leaves on them;
  - which workers a context knows on each side after ``rpc.remote`` of a builtin, a
    Python function given a tensor that requires grad returning None, and a builtin
    called under a custom RPC pickler;
  - DistributedOptimizer over a parameter of worker1 that has a .grad of its own, for
    torch's optimizers with functional twins and for a subclass: the parameter after
    three steps, its .grad, and how many torch.optim steps (global pre-hook) ran.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import threading
import time

import torch
from mp_utils import free_port  # no distgrad: mp_utils imports it only inside workers

SECRET = "e6322fbce9c88c169fbd6b1aba3050223d9e940b978cef4791345bab9c71edef"
_MEET: list = [None]


def _modules(impl: str):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    return rpc, dist_autograd


def _arm(parties: int) -> None:
    _MEET[0] = threading.Barrier(parties)


def _meet(i: int) -> torch.Tensor:
    _MEET[0].wait(20)
    return torch.full((2,), float(i))


def _vals(t: torch.Tensor) -> list:
    t = t.to_dense() if t.is_sparse else t
    return [round(v, 9) for v in t.flatten().tolist()]


def _kept(rpc, dist_autograd) -> dict:
    out = {}
    cases = {
        "received": lambda x: rpc.rpc_sync("worker1", torch.mul, args=(x, 2)).sum(),
        "local": lambda x: (x * 2).sum() + rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(3), 0)).sum(),
    }
    for name, loss in cases.items():
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as cid:
            y = loss(x)
            dist_autograd.backward(cid, [y], retain_graph=True)
            g1 = dist_autograd.get_gradients(cid)[x]
            first = _vals(g1)
            dist_autograd.backward(cid, [y])
            g2 = dist_autograd.get_gradients(cid)[x]
            out[name] = [first, _vals(g1), _vals(g2), g2 is g1]
    # (a sparse gradient that comes back over RPC is not compared: torch 2.13's context
    # ends up with no gradient at all for the weight, which distgrad does not copy)
    out["sparse_local"] = _sparse_case(rpc, dist_autograd)
    return out


def _sparse_case(rpc, dist_autograd) -> list:
    """A sparse gradient (nn.Embedding(sparse=True)) kept across two passes."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(5, 2, sparse=True)
    idx = torch.tensor([1, 3, 1])
    with dist_autograd.context() as cid:
        y = (emb(idx) * 2).sum() + rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(1), 0)).sum()
        dist_autograd.backward(cid, [y], retain_graph=True)
        g1 = dist_autograd.get_gradients(cid)[emb.weight]
        first = _vals(g1)
        dist_autograd.backward(cid, [y])
        g2 = dist_autograd.get_gradients(cid)[emb.weight]
        return [first, _vals(g1), _vals(g2), g2 is g1, g1.is_sparse]


def _hooks_and_watch(rpc, dist_autograd) -> dict:
    torch.manual_seed(1)
    p = torch.randn(4, requires_grad=True)
    calls = [0]
    p.register_post_accumulate_grad_hook(lambda t: calls.__setitem__(0, calls[0] + 1))
    user = torch.full((4,), 7.0)
    p.grad = user
    stop, odd = threading.Event(), [0]

    def watch():
        while not stop.is_set():
            if p.grad is not user:
                odd[0] += 1
    t = threading.Thread(target=watch)
    t.start()
    grads = []
    try:
        for _ in range(3):
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", torch.sin, args=(p,))
                dist_autograd.backward(cid, [(y * p).sum()])
                grads.append(_vals(dist_autograd.get_gradients(cid)[p]))
    finally:
        stop.set()
        t.join()
    return {"post_acc_calls": calls[0], "grad_changed_seen": odd[0], "user_grad": _vals(p.grad),
            "grads": grads}


_SERVER: dict = {}


def _server_params() -> list:
    if "m" not in _SERVER:
        torch.manual_seed(0)
        _SERVER["m"] = torch.nn.Linear(3, 2)
    return list(_SERVER["m"].parameters())


def _pull(view: bool) -> list:
    ps = _server_params()
    return [ps[0].view_as(ps[0]), ps[1]] if view else ps


def _describe_param(p) -> list:
    return [type(p).__name__, p.requires_grad, p.is_leaf, p.grad_fn is None, getattr(p, "tag", None)]


def _server_grads(impl: str, cid: int) -> list:
    dist_autograd = _modules(impl)[1]
    return sorted([list(k.shape), _vals(v)] for k, v in dist_autograd.get_gradients(cid).items())


class MyParam(torch.nn.Parameter):
    """A user's Parameter subclass (issue 37's params_cases.py)."""


def _desc(x):
    if isinstance(x, torch.Tensor):
        return [type(x).__name__, x.is_leaf, x.requires_grad,
                None if x.grad_fn is None else x.grad_fn.name(),
                sorted((k, repr(v)) for k, v in x.__dict__.items())]
    if isinstance(x, (list, tuple)):
        return [_desc(v) for v in x]
    return repr(x)


def _counts(dist_autograd, cid) -> list:
    c = dist_autograd._retrieve_context(cid)
    return [len(c._send_functions()), len(c._recv_functions()), sorted(c._known_worker_ids())]


def _take(x):
    return _desc(x)


def _identity(x):
    return x


def _subclass_reply():
    q = MyParam(torch.ones(2))
    q.tag = "sub"
    return q


def _uninit_reply():
    return torch.nn.UninitializedParameter()


def _param_reply():
    return _server_params()[1]


def _rref_local(rr) -> list:
    v = rr.local_value()
    return [_desc(v), v is _server_params()[1]]


class PMod(torch.nn.Module):
    """forward(x, p) returns (x * self.w, p * 2, self.w, p)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((2,), 3.0))

    def forward(self, x, p):
        return x * self.w, p * 2, self.w, p


def _remote_module_class(impl: str):
    from importlib import import_module  # (torch's generated module, on each worker)
    return import_module("torch.distributed.nn" if impl == "torch" else "distgrad.nn").RemoteModule


def _module_grads(rr, impl: str, cid: int) -> list:
    g = _modules(impl)[1].get_gradients(cid)
    w = rr.local_value().w
    return [_vals(g[w]) if w in g else None, len(g)]


def _odd_parameters(rpc, dist_autograd, impl: str) -> dict:
    """issue 37's params_cases.py: a Parameter subclass, UninitializedParameter, an RRef
    and a RemoteModule, as arguments and values."""
    out = {}
    with dist_autograd.context() as cid:
        out["subclass reply"] = _desc(rpc.rpc_sync("worker1", _subclass_reply))
        out["subclass reply counts"] = _counts(dist_autograd, cid)
    q = MyParam(torch.ones(2))
    q.tag = "sub-arg"
    with dist_autograd.context() as cid:
        out["subclass argument"] = rpc.rpc_sync("worker1", _take, args=(q,))
        out["subclass argument counts"] = _counts(dist_autograd, cid)
    for name, fn in (("uninitialized reply", lambda: rpc.rpc_sync("worker1", _uninit_reply)),
                     ("uninitialized argument", lambda: rpc.rpc_sync(
                         "worker1", _take, args=(torch.nn.UninitializedParameter(),)))):
        try:
            out[name] = _desc(fn())
        except Exception as e:  # noqa: BLE001 - torch's refusal is an observation too
            out[name] = "raised " + type(e).__name__
    with dist_autograd.context() as cid:
        rr = rpc.remote("worker1", _param_reply)
        out["rref to_here"] = _desc(rr.to_here())
        out["rref owner's value"] = rpc.rpc_sync("worker1", _rref_local, args=(rr,))
        p2 = torch.nn.Parameter(torch.ones(2))
        out["rref of an argument"] = _desc(rpc.remote("worker1", _identity, args=(p2,)).to_here())
        out["rref counts"] = _counts(dist_autograd, cid)
        mine = rpc.remote("worker0", _identity, args=(p2,))
        v = mine.to_here()
        out["rref to self"] = [_desc(v), v is p2, _desc(mine.local_value()), mine.local_value() is p2]
        out["rref counts after self"] = _counts(dist_autograd, cid)
    rpc.rpc_sync("worker1", _remote_module_class, args=(impl,))   # imported there as a user would
    m = _remote_module_class(impl)("worker1/cpu", PMod)
    x = torch.ones(2, requires_grad=True)
    p = torch.nn.Parameter(torch.ones(2))
    with dist_autograd.context() as cid:
        a, b, w, r = m.forward(x, p)
        out["remote module values"] = _desc([a, b, w, r])
        out["remote module counts"] = _counts(dist_autograd, cid)
        dist_autograd.backward(cid, [a.sum() + b.sum() + w.sum() + r.sum()])
        g = dist_autograd.get_gradients(cid)
        out["remote module grads here"] = sorted(
            [("x" if k is x else "p" if k is p else "w" if k is w else "r" if k is r
              else type(k).__name__), _vals(v)] for k, v in g.items())
        out["remote module grads there"] = rpc.rpc_sync("worker1", _module_grads,
                                                        args=(m.module_rref, impl, cid))
    return out


def _parameters(rpc, dist_autograd) -> dict:
    out = {}
    impl = "torch" if rpc.__name__.startswith("torch.") else "distgrad"
    for view in (False, True):
        with dist_autograd.context() as cid:
            ps = rpc.rpc_sync("worker1", _pull, args=(view,))
            seen = [[type(p).__name__, p.is_leaf, p.grad_fn is None] for p in ps]
            loss = (torch.ones(4, 3) @ ps[0].t() + ps[1]).pow(2).sum()
            dist_autograd.backward(cid, [loss])
            out[f"pull view={view}"] = {
                "seen": seen, "server": rpc.rpc_sync("worker1", _server_grads, args=(impl, cid)),
                "local": sorted([list(k.shape), _vals(v)]
                                for k, v in dist_autograd.get_gradients(cid).items())}
        ps = rpc.rpc_sync("worker1", _pull, args=(view,))
        (ps[0].sum() * 3 + ps[1].sum()).backward()   # plain local autograd on what arrived
        out[f"local backward view={view}"] = [None if p.grad is None else _vals(p.grad) for p in ps]
    p = torch.nn.Parameter(torch.ones(2))
    p.tag = "mine"
    with dist_autograd.context() as cid:
        out["argument"] = rpc.rpc_sync("worker1", _describe_param, args=(p,))
        out["argument sends"] = len(dist_autograd._retrieve_context(cid)._send_functions())
    # a Parameter argument used on the callee, its result used here: the gradient stops
    # at the callee's new leaf (kept in the callee's context), none comes back for p
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", _scaled_param, args=(p, torch.full((2,), 3.0, requires_grad=True)))
        dist_autograd.backward(cid, [y.sum()])
        out["argument used"] = {"here": sorted(_vals(v) for v in dist_autograd.get_gradients(cid).values()),
                                "there": rpc.rpc_sync("worker1", _server_grads, args=(impl, cid))}
    # a plain tensor that only claims to be a Parameter (nn.Parameter's metaclass takes
    # _is_param for one), sent beside another: both are plain tensors, both linked
    a = torch.full((3, 2), 1.0, requires_grad=True)
    b = torch.full((2, 3), 1.0, requires_grad=True)
    flagged = a.t()
    flagged._is_param = True
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", _weighted, args=(flagged, b))
        dist_autograd.backward(cid, [y])
        g = dist_autograd.get_gradients(cid)
        out["flagged tensor"] = [_vals(g[a]) if a in g else None, _vals(g[b]) if b in g else None]
    # a Parameter argument of a builtin operator is a tensor like any other (torch
    # sends builtin arguments as tensors): its gradient comes back
    q = torch.nn.Parameter(torch.ones(2))
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(q, 2))
        out["builtin on a Parameter"] = [type(y).__name__, y.grad_fn is not None]
        dist_autograd.backward(cid, [y.sum()])
        g = dist_autograd.get_gradients(cid)
        out["builtin on a Parameter"].append(_vals(g[q]) if q in g else None)
    # which workers a context knows, on each side, after a call with no gradient
    for f in (torch.add, _plus):   # a builtin, a Python function
        with dist_autograd.context() as cid:
            rpc.rpc_sync("worker1", f, args=(torch.ones(2), 1))
            out[f"known after a plain call of {f.__name__}"] = [
                sorted(dist_autograd._retrieve_context(cid)._known_worker_ids()),
                rpc.rpc_sync("worker1", _known, args=(impl, cid))]
    out.update(_odd_parameters(rpc, dist_autograd, impl))
    return out


def _context_seen(impl: str, cid: int):
    """On worker1: the workers its share of context ``cid`` knows, or None where it has
    no share (asked from a thread of worker0 with no context: the question itself
    creates none)."""
    dist_autograd = _modules(impl)[1]
    try:
        ctx = dist_autograd._retrieve_context(cid)
    except RuntimeError:
        return None
    return sorted(ctx._known_worker_ids())


def _ask_outside(rpc, impl: str, cid: int):
    box: list = []

    def ask():
        try:
            box.append(rpc.rpc_sync("worker1", _context_seen, args=(impl, cid)))
        except Exception as e:  # noqa: BLE001 - the observation
            box.append(f"{type(e).__name__}: {e}"[:200])
    t = threading.Thread(target=ask)
    t.start()
    t.join(30)
    return box[0] if box else "no answer"


def _returns_none(x):
    return None


def _known_workers(rpc, dist_autograd) -> dict:
    """Which workers a context knows on each side (torch adds one only when it sends
    with autograd information, never on receipt), after calls that carry it or not:
    ``rpc.remote`` of a builtin with no tensor requiring grad, a Python function given a
    tensor that requires grad and returning None, a builtin called under a custom RPC
    pickler."""
    impl = "torch" if rpc.__name__.startswith("torch.") else "distgrad"
    api = __import__(rpc.__name__ + ".api", fromlist=["api"])
    out = {}
    with dist_autograd.context() as cid:
        rr = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        deadline = time.monotonic() + 20
        while not rr.confirmed_by_owner() and time.monotonic() < deadline:
            time.sleep(0.01)
        out["remote builtin, no grad"] = [sorted(dist_autograd._retrieve_context(cid)._known_worker_ids()),
                                          _ask_outside(rpc, impl, cid)]
    with dist_autograd.context() as cid:
        rpc.rpc_sync("worker1", _returns_none, args=(torch.ones(2, requires_grad=True),))
        out["function, grad argument, None back"] = [
            sorted(dist_autograd._retrieve_context(cid)._known_worker_ids()), _ask_outside(rpc, impl, cid)]
    with dist_autograd.context() as cid:
        pickler = type("Pickler", (type(api._internal_rpc_pickler),), {})()
        with api._use_rpc_pickler(pickler):
            y = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        out["builtin under a custom pickler"] = [
            _vals(y), sorted(dist_autograd._retrieve_context(cid)._known_worker_ids()),
            _ask_outside(rpc, impl, cid)]
    return out


def _plus(x, y):
    return x + y


def _weighted(x, y):
    return (x * 2).sum() + (y * 5).sum()


def _known(impl: str, cid: int) -> list:
    return sorted(_modules(impl)[1]._retrieve_context(cid)._known_worker_ids())


def _scaled_param(p, s):
    return p * s


def _chain(rpc) -> list:
    got = []
    for _ in range(3):
        rpc.rpc_sync("worker1", _arm, args=(2,))
        f1 = rpc.rpc_async("worker1", _meet, args=(1,))
        f2 = rpc.rpc_async("worker1", _meet, args=(2,))
        chained = f1.then(lambda f, f2=f2: f.value() + f2.wait())
        box, done = {}, threading.Event()
        chained.add_done_callback(lambda f, box=box, done=done: (box.update(v=f.value()), done.set()))
        got.append(_vals(box["v"]) if done.wait(20) else "hung")
    return got


_OWNER: dict = {"calls": [0]}


def _owner_param(name: str) -> torch.Tensor:
    """On worker1: a parameter with a .grad of its own; a global optimizer step
    pre-hook counts the torch.optim steps that run here."""
    if "hook" not in _OWNER:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _OWNER["hook"] = register_optimizer_step_pre_hook(
            lambda o, a, k: _OWNER["calls"].__setitem__(0, _OWNER["calls"][0] + 1))
    torch.manual_seed(1)
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.full((3,), 7.0)
    _OWNER[name] = w
    return w


def _owner_loss(w_rref, x):
    return (w_rref.local_value() * x).pow(2).sum()


def _owner_report(name: str, with_grad: bool) -> list:
    w = _OWNER[name]
    grad = (None if w.grad is None else _vals(w.grad)) if with_grad else "-"
    return [[round(v, 6) for v in w.detach().tolist()], grad, _OWNER["calls"][0]]


class PlainSGD(torch.optim.SGD):
    """No functional twin: torch and distgrad step it through .grad (torch leaves the
    context's gradient there, distgrad puts the old one back: not compared)."""


def _optimizer(rpc, dist_autograd) -> dict:
    impl = "torch" if rpc.__name__.startswith("torch.") else "distgrad"
    if impl == "torch":
        from torch.distributed.optim import DistributedOptimizer
    else:
        from distgrad.optim import DistributedOptimizer
    out = {}
    for name, cls, args, kw in (
            ("SGD", torch.optim.SGD, (0.1, 0.9), {"nesterov": True, "weight_decay": 0.01}),
            ("Adam", torch.optim.Adam, (), {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
            ("AdamW", torch.optim.AdamW, (0.05,), {"betas": (0.8, 0.9)}),
            ("Adagrad", torch.optim.Adagrad, (), {"lr": 0.1, "lr_decay": 0.01}),
            ("RMSprop", torch.optim.RMSprop, (), {"lr": 0.01, "momentum": 0.5, "centered": True}),
            ("Rprop", torch.optim.Rprop, (), {"lr": 0.01}),
            ("Adamax", torch.optim.Adamax, (), {"lr": 0.05}),
            ("Adadelta", torch.optim.Adadelta, (), {"lr": 0.5}),
            ("PlainSGD", PlainSGD, (0.1,), {"momentum": 0.5})):
        w = rpc.remote("worker1", _owner_param, args=(name,))
        opt = DistributedOptimizer(cls, [w], *args, **kw)
        for step in range(3):
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", _owner_loss, args=(w, torch.full((3,), float(step + 1))))
                dist_autograd.backward(cid, [y])
                opt.step(cid)
        out[name] = rpc.rpc_sync("worker1", _owner_report, args=(name, name != "PlainSGD"))
    return out


def _recv_node_hooks(rpc, dist_autograd) -> dict:
    """Hooks on a received tensor's recv function (a builtin over RPC, to worker1 and to
    worker0 itself): a post-hook sees no gradient to change (torch's RecvRpcBackward
    returns none: its gradients go over the wire), so the leaf's gradient is unscaled;
    a pre-hook scales the gradient it ships."""
    out = {}
    for dest in ("worker1", "worker0"):
        for kind in ("post", "pre"):
            x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
            seen = []
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync(dest, torch.mul, args=(x, torch.tensor([2.0, 3.0, 4.0])))
                if kind == "post":
                    def hook(gis, gos, seen=seen):
                        seen.append([g is None for g in gis] == [True] * len(gis))
                        return tuple(None if g is None else g * 5 for g in gis)
                    y.grad_fn.register_hook(hook)
                else:
                    def hook(gos, seen=seen):
                        seen.append(len(gos))
                        return tuple(g * 3 for g in gos)
                    y.grad_fn.register_prehook(hook)
                dist_autograd.backward(cid, [(y * torch.tensor([1.0, 0.5, -1.0])).sum()])
                out[f"{dest}/{kind}"] = {"grad": _vals(dist_autograd.get_gradients(cid)[x]), "seen": seen,
                                         "name": y.grad_fn.name()}
    return out


def _worker(rank: int, port: int, impl: str, out) -> None:
    os.environ["DISTGRAD_SECRET"] = SECRET
    torch.set_num_threads(1)
    rpc, dist_autograd = _modules(impl)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            res = {}
            for name, part in (("kept", lambda: _kept(rpc, dist_autograd)),
                               ("hooks", lambda: _hooks_and_watch(rpc, dist_autograd)),
                               ("chain", lambda: _chain(rpc)),
                               ("recv_node_hooks", lambda: _recv_node_hooks(rpc, dist_autograd)),
                               ("parameters", lambda: _parameters(rpc, dist_autograd)),
                               ("known workers", lambda: _known_workers(rpc, dist_autograd)),
                               ("optimizer", lambda: _optimizer(rpc, dist_autograd))):
                out.put(json.dumps({"stage": name}))   # where a hang happened, if one does
                res[name] = part()
            out.put(json.dumps(res, sort_keys=True))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    rpc.shutdown()


def run(impl: str, timeout: float = 90.0) -> dict:
    """The program on two spawned workers of ``impl``; worker0's record."""
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, port, impl, out)) for r in range(2)]
    for p in ps:
        p.start()
    stage, end = None, time.monotonic() + timeout
    try:
        while True:
            got = json.loads(out.get(timeout=max(0.0, end - time.monotonic())))
            if set(got) != {"stage"}:
                return got
            stage = got["stage"]
    except queue.Empty:
        return {"error": f"no result within {timeout:g} s (in part {stage!r})", "hung": stage}
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "distgrad"), required=True)
    print(json.dumps(run(ap.parse_args().impl), sort_keys=True))
