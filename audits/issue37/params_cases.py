"""Change 1: nn.Parameter over RPC, torch vs distgrad, every observation compared.
Run: PYTHONPATH=$PWD DISTGRAD_PURE=1 python audits/issue37/params_cases.py [case ...]"""
from __future__ import annotations

import sys
import threading
import warnings

import torch
from torch import nn

sys.path.insert(0, __import__("os").path.dirname(__file__))
import _harness  # noqa: E402

S: dict = {}   # server (worker1) state


class MyParam(nn.Parameter):
    pass


def _vals(t):
    if t is None:
        return None
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return [round(float(v), 4) for v in t.reshape(-1)]


def desc(x):
    if isinstance(x, torch.Tensor):
        return {"type": type(x).__name__, "leaf": x.is_leaf, "rg": x.requires_grad,
                "grad_fn": None if x.grad_fn is None else x.grad_fn.name(),
                "attrs": sorted((k, repr(v)) for k, v in x.__dict__.items()),
                "layout": str(x.layout)}
    if isinstance(x, (list, tuple)):
        return [desc(v) for v in x]
    if isinstance(x, dict):
        return {k: desc(v) for k, v in x.items()}
    return repr(x)


def ctx_counts(da, cid):
    c = da._retrieve_context(cid)
    return [len(c._send_functions()), len(c._recv_functions()), sorted(c._known_worker_ids())]


def server_param():
    if "p" not in S:
        torch.manual_seed(0)
        S["p"] = nn.Parameter(torch.arange(4.0))
        S["p"].tag = "srv"
    return S["p"]


# ---- functions run on worker1 -----------------------------------------------
def srv_take(x, impl):
    S["got"] = x
    rpc, da = _harness.modules(impl)
    return desc(x)


def srv_take_double(p, impl):
    S["got"] = p
    return p * 2


def srv_grads(impl, cid):
    rpc, da = _harness.modules(impl)
    g = da.get_gradients(cid)
    out = []
    for k, v in g.items():
        who = ("server_param" if k is S.get("p") else "got" if k is S.get("got") else
               "other:" + type(k).__name__)
        out.append([who, list(k.shape), _vals(v)])
    return sorted(out), ctx_counts(da, cid)


def srv_return_param():
    return server_param()


def srv_return_nested():
    p = server_param()
    return {"a": [p, (p,)], "v": p.view_as(p), "d": p.data}


def srv_return_subclass():
    q = MyParam(torch.ones(2))
    q.tag = "sub"
    S["q"] = q
    return q


def srv_return_uninit():
    return nn.UninitializedParameter()


def srv_return_rg_false():
    return nn.Parameter(torch.ones(3), requires_grad=False)


def srv_return_sparse():
    i = torch.tensor([[0, 1], [1, 0]])
    S["q"] = nn.Parameter(torch.sparse_coo_tensor(i, torch.tensor([1., 2.]), (2, 2)))
    return S["q"]


def srv_alias_probe(d):
    # d = {"p": Parameter, "v": view of p}; does writing v change p on the receiver?
    with torch.no_grad():
        d["v"].add_(100)
    return [_vals(d["p"]), d["p"].untyped_storage().data_ptr() == d["v"].untyped_storage().data_ptr()]


def srv_identity(x):
    return x


def srv_is_same(x):
    return x is S.get("p")


# ---- cases, run on worker0 ---------------------------------------------------
def case_arg(rpc, da, impl):
    out = {}
    p = nn.Parameter(torch.ones(2))
    p.tag = "mine"
    with da.context() as cid:
        out["desc_on_server"] = rpc.rpc_sync("worker1", srv_take, args=(p, impl))
        out["client_counts"] = ctx_counts(da, cid)
        y = rpc.rpc_sync("worker1", srv_take_double, args=(p, impl))
        out["reply"] = desc(y)
        out["client_counts2"] = ctx_counts(da, cid)
        da.backward(cid, [y.sum()])
        out["client_grads"] = sorted(["p" if k is p else type(k).__name__, _vals(v)]
                                     for k, v in da.get_gradients(cid).items())
        out["server"] = rpc.rpc_sync("worker1", srv_grads, args=(impl, cid))
        out["p.grad"] = _vals(p.grad)
    return out


def case_arg_and_view(rpc, da, impl):
    out = {}
    p = nn.Parameter(torch.arange(3.0))
    with da.context() as cid:
        d = {"p": p, "v": p.view_as(p), "p2": p}
        out["desc"] = rpc.rpc_sync("worker1", srv_take, args=(d, impl))
        out["client_counts"] = ctx_counts(da, cid)
        out["alias"] = rpc.rpc_sync("worker1", srv_alias_probe, args=(d,))
    return out


def srv_plain():
    return torch.ones(2)


def case_control_plain(rpc, da, impl):
    """Control (no Parameter): a request and a reply with no tensor requiring grad."""
    with da.context() as cid:
        rpc.rpc_sync("worker1", srv_plain)
        return {"client_counts": ctx_counts(da, cid),
                "server": rpc.rpc_sync("worker1", srv_grads, args=(impl, cid))}


def case_reply(rpc, da, impl):
    out = {}
    with da.context() as cid:
        p = rpc.rpc_sync("worker1", srv_return_param)
        out["desc"] = desc(p)
        out["client_counts"] = ctx_counts(da, cid)
        da.backward(cid, [(p * 3).sum()])
        out["client_grads"] = sorted([type(k).__name__, _vals(v)]
                                     for k, v in da.get_gradients(cid).items())
        out["server"] = rpc.rpc_sync("worker1", srv_grads, args=(impl, cid))
    p = rpc.rpc_sync("worker1", srv_return_param)
    (p * 2).sum().backward()
    out["local_grad"] = _vals(p.grad)
    return out


def case_nested(rpc, da, impl):
    out = {}
    with da.context() as cid:
        r = rpc.rpc_sync("worker1", srv_return_nested)
        out["desc"] = desc(r)
        out["same_obj"] = [r["a"][0] is r["a"][1][0]]
        out["alias_v_p"] = r["v"].untyped_storage().data_ptr() == r["a"][0].untyped_storage().data_ptr()
        out["alias_d_p"] = r["d"].untyped_storage().data_ptr() == r["a"][0].untyped_storage().data_ptr()
        out["client_counts"] = ctx_counts(da, cid)
        da.backward(cid, [(r["v"] * 2).sum() + r["a"][0].sum()])
        out["client_grads"] = sorted([type(k).__name__, _vals(v)]
                                     for k, v in da.get_gradients(cid).items())
        out["server"] = rpc.rpc_sync("worker1", srv_grads, args=(impl, cid))
    return out


def case_subclass(rpc, da, impl):
    out = {}
    with da.context() as cid:
        q = rpc.rpc_sync("worker1", srv_return_subclass)
        out["desc"] = desc(q)
        out["client_counts"] = ctx_counts(da, cid)
    q = MyParam(torch.ones(2))
    q.tag = "sub-arg"
    with da.context() as cid:
        out["arg_desc"] = rpc.rpc_sync("worker1", srv_take, args=(q, impl))
        out["arg_counts"] = ctx_counts(da, cid)
    return out


def case_uninit(rpc, da, impl):
    out = {}
    for name, fn in (("reply", lambda: rpc.rpc_sync("worker1", srv_return_uninit)),
                     ("arg", lambda: rpc.rpc_sync("worker1", srv_take,
                                                  args=(nn.UninitializedParameter(), impl)))):
        try:
            out[name] = desc(fn())
        except Exception as e:  # noqa: BLE001
            out[name] = "raised " + type(e).__name__
    return out


def case_rg_false(rpc, da, impl):
    out = {}
    with da.context() as cid:
        q = rpc.rpc_sync("worker1", srv_return_rg_false)
        out["desc"] = desc(q)
        p = nn.Parameter(torch.ones(2), requires_grad=False)
        out["arg"] = rpc.rpc_sync("worker1", srv_take, args=(p, impl))
        out["client_counts"] = ctx_counts(da, cid)
    return out


def case_sparse(rpc, da, impl):
    out = {}
    with da.context() as cid:
        try:
            q = rpc.rpc_sync("worker1", srv_return_sparse)
            out["desc"] = desc(q)
            out["client_counts"] = ctx_counts(da, cid)
            da.backward(cid, [torch.sparse.sum(q * 2)])
            out["client_grads"] = sorted([type(k).__name__, _vals(v)]
                                         for k, v in da.get_gradients(cid).items())
        except Exception as e:  # noqa: BLE001
            out["err"] = type(e).__name__
    return out


def case_rref(rpc, da, impl):
    out = {}
    with da.context() as cid:
        rr = rpc.remote("worker1", srv_return_param)
        p = rr.to_here()
        out["to_here"] = desc(p)
        out["owner_local_is_param"] = rpc.rpc_sync("worker1", srv_rref_local, args=(rr,))
        p2 = nn.Parameter(torch.ones(2))
        rr2 = rpc.remote("worker1", srv_identity, args=(p2,))
        out["remote_arg_to_here"] = desc(rr2.to_here())
        out["client_counts"] = ctx_counts(da, cid)
        # self-owned rref of a Parameter
        rr3 = rpc.remote("worker0", srv_identity, args=(p2,))
        v = rr3.to_here()
        out["self_remote"] = [desc(v), v is p2, desc(rr3.local_value()), rr3.local_value() is p2]
        out["client_counts2"] = ctx_counts(da, cid)
    return out


def srv_rref_local(rr):
    v = rr.local_value()
    return [desc(v), v is S.get("p")]


def case_self(rpc, da, impl):
    out = {}
    p = nn.Parameter(torch.ones(2))
    p.tag = "self"
    with da.context() as cid:
        r = rpc.rpc_sync("worker0", srv_identity, args=(p,))
        out["desc"] = desc(r)
        out["same_object"] = r is p
        out["shares"] = r.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        out["counts"] = ctx_counts(da, cid)
    return out


def case_is_param(rpc, da, impl):
    """A plain tensor flagged _is_param (isinstance(t, Parameter) is True for it)."""
    out = {}
    for layout in ("contig", "transposed"):
        a = torch.arange(6.0).reshape(2, 3).requires_grad_()
        b = torch.arange(6.0, 12.0).reshape(2, 3).requires_grad_()
        ta = (a * 1) if layout == "contig" else (a * 1).t()
        ta._is_param = True
        tb = b * 1
        with da.context() as cid:
            try:
                y = rpc.rpc_sync("worker1", srv_identity, args=([ta, tb],))
                out[layout + " types"] = [type(t).__name__ for t in y] + [isinstance(ta, nn.Parameter)]
                out[layout + " counts"] = ctx_counts(da, cid)
                da.backward(cid, [(y[0] * 2).sum() + (y[1] * 5).sum()])
                g = da.get_gradients(cid)
                out[layout + " grads"] = [_vals(g.get(a)), _vals(g.get(b))]
            except Exception as e:  # noqa: BLE001
                out[layout + " err"] = type(e).__name__ + ": " + str(e)[:200]
    return out


def case_is_param_square(rpc, da, impl):
    """Same as is_param with square shapes: does a gradient silently land on the wrong tensor?"""
    a = torch.zeros(2, 2).requires_grad_()
    b = torch.zeros(2, 2).requires_grad_()
    ta = (a + 1).t()           # non-contiguous
    ta._is_param = True
    tb = b + 1
    with da.context() as cid:
        y = rpc.rpc_sync("worker1", srv_identity, args=([ta, tb],))
        da.backward(cid, [(y[0] * 2).sum() + (y[1] * 5).sum()])
        g = da.get_gradients(cid)
        return {"types": [type(t).__name__ for t in y],
                "grad_a": _vals(g.get(a)), "grad_b": _vals(g.get(b))}


def srv_alias_plain(d):
    with torch.no_grad():
        d["v"].add_(100)
    return [_vals(d["t"]), d["t"].untyped_storage().data_ptr() == d["v"].untyped_storage().data_ptr()]


def case_control_alias_plain(rpc, da, impl):
    """Control (no Parameter): a plain tensor and a view of it in one message."""
    t = torch.arange(3.0)
    return {"alias": rpc.rpc_sync("worker1", srv_alias_plain, args=({"t": t, "v": t.view_as(t)},))}


def case_hooks(rpc, da, impl):
    out = {}
    p = nn.Parameter(torch.ones(2))
    p.register_hook(lambda g: g)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            out["desc"] = rpc.rpc_sync("worker1", srv_take, args=(p, impl))
        except Exception as e:  # noqa: BLE001
            out["desc"] = "raised " + type(e).__name__
        out["warned"] = sorted({type(x.message).__name__ for x in w})
    return out


def case_retain_graph(rpc, da, impl):
    out = {}
    with da.context() as cid:
        p = rpc.rpc_sync("worker1", srv_return_param)
        v = rpc.rpc_sync("worker1", srv_view)
        loss = (p ** 2).sum() + (v ** 2).sum()
        da.backward(cid, [loss], retain_graph=True)
        g = da.get_gradients(cid)
        out["client"] = sorted([type(k).__name__, _vals(x)] for k, x in g.items())
        out["server"] = rpc.rpc_sync("worker1", srv_grads, args=(impl, cid))
    return out


def srv_view():
    p = server_param()
    return p.view_as(p)


def srv_param_rref():
    return rpc_mod().RRef(server_param())


def rpc_mod():
    return S["rpc"]


def srv_set(impl):
    S["rpc"] = _harness.modules(impl)[0]
    return True


def srv_value():
    return _vals(server_param())


def case_distopt(rpc, da, impl):
    from importlib import import_module
    DO = import_module("torch.distributed.optim" if impl == "torch" else "distgrad.optim").DistributedOptimizer
    out = {}
    rpc.rpc_sync("worker1", srv_set, args=(impl,))
    rr = rpc.rpc_sync("worker1", srv_param_rref)
    opt = DO(torch.optim.SGD, [rr], lr=0.5)
    for how in ("param", "view"):
        with da.context() as cid:
            p = rpc.rpc_sync("worker1", srv_return_param if how == "param" else srv_view)
            da.backward(cid, [(p * 2).sum()])
            opt.step(cid)
        out[how] = rpc.rpc_sync("worker1", srv_value)
    return out


class PMod(nn.Module):
    """forward(x, p) returns (x * self.w, p * 2, self.w, p)."""
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((2,), 3.0))

    def forward(self, x, p):
        return x * self.w, p * 2, self.w, p


def case_remote_module(rpc, da, impl):
    from importlib import import_module
    RM = import_module("torch.distributed.nn" if impl == "torch" else "distgrad.nn").RemoteModule
    m = RM("worker1/cpu", PMod)
    out = {}
    x = torch.ones(2, requires_grad=True)
    p = nn.Parameter(torch.ones(2))
    with da.context() as cid:
        a, b, w, q = m.forward(x, p)
        out["types"] = desc([a, b, w, q])
        out["counts"] = ctx_counts(da, cid)
        da.backward(cid, [a.sum() + b.sum() + w.sum() + q.sum()])
        g = da.get_gradients(cid)
        out["client_grads"] = sorted([("x" if k is x else "p" if k is p else "w" if k is w
                                       else "q" if k is q else type(k).__name__), _vals(v)]
                                     for k, v in g.items())
        out["remote_params_grad"] = rpc.rpc_sync("worker1", srv_mod_grads,
                                                 args=(m.module_rref, impl, cid))
    return out


def srv_mod_grads(rr, impl, cid):
    da = _harness.modules(impl)[1]
    mod = rr.local_value()
    g = da.get_gradients(cid)
    return [_vals(g.get(mod.w)), len(g)]


def srv_attr_probe(p, impl):
    out = desc(p)
    out["aux"] = desc(p.aux) if hasattr(p, "aux") else None
    out["other_is"] = (type(p.other).__name__, p.other.tag) if hasattr(p, "other") else None
    S["got"] = p
    return out


def srv_aux_double(p):
    S["got"] = p
    return p.aux * 2


def case_state_tensors(rpc, da, impl):
    """A Parameter whose attributes hold a grad-requiring tensor / another Parameter / itself."""
    out = {}
    import os
    which = os.environ.get("AUDIT37_STATE", "aux,other").split(",")
    base = torch.ones(2, requires_grad=True)
    p = nn.Parameter(torch.zeros(2))
    p.aux = base * 3 if "aux" in which else torch.ones(2)
    q = nn.Parameter(torch.ones(1))
    q.tag = "q"
    if "other" in which:
        p.other = q
    with da.context() as cid:
        out["desc"] = rpc.rpc_sync("worker1", srv_attr_probe, args=(p, impl))
        out["counts"] = ctx_counts(da, cid)
        y = rpc.rpc_sync("worker1", srv_aux_double, args=(p,))
        if y.requires_grad:
            da.backward(cid, [y.sum()])
        out["grad_base"] = _vals(da.get_gradients(cid).get(base))
    return out


def case_self_ref(rpc, da, impl):
    """A Parameter whose attribute is itself (torch: worker0 dies, see README)."""
    out = {}
    r = nn.Parameter(torch.ones(1))
    r.me = r
    try:
        rpc.rpc_sync("worker1", srv_identity, args=(r,))
        out["self_ref"] = "sent"
    except Exception as e:  # noqa: BLE001
        out["self_ref"] = "raised"
    return out


CASES = [n[5:] for n in list(globals()) if n.startswith("case_")]


def scenario(rank, rpc, da, impl):
    if rank != 0:
        return None
    res = {}
    for name in SELECTED:
        try:
            res[name] = globals()["case_" + name](rpc, da, impl)
        except Exception as e:  # noqa: BLE001
            res[name] = {"raised": f"{type(e).__name__}: {str(e)[:300]}"}
    return res


SELECTED = CASES


def main():
    import json
    import os
    names = sys.argv[1:] or CASES
    os.environ["AUDIT37_CASES"] = ",".join(names)
    got = {impl: _harness.run("params_cases", "scenario_env", impl, timeout=int(os.environ.get("AUDIT37_TIMEOUT", "180")))
           for impl in ("torch", "distgrad")}
    for impl, r in got.items():
        for k, v in r.items():
            if k == "timeout" or v[0] != "ok":
                print(f"[{impl}] {k}: {v}")
    a, b = got["torch"][0][1], got["distgrad"][0][1]
    fails = []
    for case in names:
        ca, cb = a[case], b[case]
        for k in sorted(set(ca) | set(cb)):
            same = json.dumps(ca.get(k), sort_keys=True, default=str) == \
                json.dumps(cb.get(k), sort_keys=True, default=str)
            if same:
                print(f"PASS {case}.{k}: {ca.get(k)}")
            else:
                fails.append(f"{case}.{k}")
                print(f"FAIL {case}.{k}:\n     torch   ={ca.get(k)}\n     distgrad={cb.get(k)}")
    print("RESULT:", "PASS" if not fails else "FAIL " + ", ".join(fails))


def scenario_env(rank, rpc, da, impl):
    import os
    global SELECTED
    SELECTED = os.environ["AUDIT37_CASES"].split(",")
    return scenario(rank, rpc, da, impl)


if __name__ == "__main__":
    main()
