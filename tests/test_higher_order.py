"""Second derivatives across workers: ``dist_autograd.backward(..., create_graph=True)``.

Three programs a user would write (a gradient penalty on a critic split over the
workers, a Hessian-vector product of a parameter-server model, two inner MAML steps
on a model whose layers live on different workers), each on 2, 3 and 4 real
workers, in float64, against single-process autograd on the same computation:
``loss.backward(create_graph=True)`` then ``f(w.grad).backward()`` for the
accumulated gradients, and ``torch.autograd.grad(..., create_graph=True)`` for what
the user wants out of them (the penalty's gradient, H v, the meta-gradient).
Randomly generated programs get the same check in tests/test_autograd_random.py.
"""
import zlib

import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(180)

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
_PARAMS: dict = {}   # this worker's parameters, by name
_FAST: dict = {}     # MAML's fast weights on this worker, by (layer, step)


def _value(name, shape):
    """The same values for ``name`` in every process (local oracle included)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=DT)


def param(name, shape):
    """Get or create this worker's parameter ``name`` (a leaf that requires grad)."""
    if name not in _PARAMS:
        _PARAMS[name] = _value(name, shape).requires_grad_()
    return _PARAMS[name]


def _grad_here(cid, name):
    import distgrad.autograd as dist_autograd
    g = dist_autograd.get_gradients(cid).get(_PARAMS[name])
    return None if g is None else (g.detach().clone(), g.requires_grad)


def _grads(cid, where):
    """{name: (gradient, requires_grad)} from each name's worker."""
    import distgrad.rpc as rpc
    return {n: rpc.rpc_sync(f"worker{w}", _grad_here, args=(cid, n)) for n, w in where.items()}


# -- 1. a gradient penalty (WGAN-GP) on a critic split over the workers --------------
def _critic_stage(i, world, h):
    """Stage ``i`` of the critic on worker ``i``, then the rest of the chain (nested)."""
    import distgrad.rpc as rpc
    last = i == world - 1
    w = param(f"critic{i}", (h.shape[1], 1 if last else 4))
    h = h @ w if last else torch.tanh(h @ w)
    return h if last else rpc.rpc_sync(f"worker{i + 1}", _critic_stage, args=(i + 1, world, h))


def _penalty(gx):
    return ((gx.norm(2, dim=1) - 1) ** 2).mean()


def gradient_penalty(world):
    import distgrad.autograd as dist_autograd
    _PARAMS.clear()
    x = param("x_interp", (5, 3))
    names = {f"critic{i}": i for i in range(world)}
    with dist_autograd.context() as cid:
        d = _critic_stage(0, world, x)
        dist_autograd.backward(cid, [d.sum()], create_graph=True)
        gx = dist_autograd.get_gradients(cid)[x]
        first = {"x_interp": (gx.detach().clone(), gx.requires_grad), **_grads(cid, names)}
        dist_autograd.backward(cid, [_penalty(gx)])
        final = {"x_interp": (dist_autograd.get_gradients(cid)[x].detach().clone(), False),
                 **_grads(cid, names)}
    # local: the same computation in one process
    p = {n: _value(n, t.shape).requires_grad_() for n, t in [("x_interp", x)]}
    h = p["x_interp"]
    for i in range(world):
        last = i == world - 1
        p[f"critic{i}"] = _value(f"critic{i}", (h.shape[1], 1 if last else 4)).requires_grad_()
        h = h @ p[f"critic{i}"] if last else torch.tanh(h @ p[f"critic{i}"])
    h.sum().backward(create_graph=True)
    local_first = {n: t.grad.detach().clone() for n, t in p.items()}
    _penalty(p["x_interp"].grad).backward()
    # and what a user wants: the penalty's gradient, by torch.autograd.grad
    q = {n: _value(n, t.shape).requires_grad_() for n, t in p.items()}
    h = q["x_interp"]
    for i in range(world):
        h = h @ q[f"critic{i}"] if i == world - 1 else torch.tanh(h @ q[f"critic{i}"])
    (gq,) = torch.autograd.grad(h.sum(), q["x_interp"], create_graph=True)
    want_gp = dict(zip(q, torch.autograd.grad(_penalty(gq), list(q.values()))))
    return first, final, local_first, {n: t.grad.detach() for n, t in p.items()}, want_gp


# -- 2. a Hessian-vector product of a parameter-server model -------------------------
def _ps_embed(x):
    """On the parameter server (worker0)."""
    return torch.tanh(x @ param("ps_w", (3, 4)))


def _trainer_loss(t):
    """On trainer ``t``: its data through the server's layer, then its own head."""
    import distgrad.rpc as rpc
    x, y = _value(f"x{t}", (6, 3)), _value(f"y{t}", (6,))
    e = rpc.rpc_sync("worker0", _ps_embed, args=(x,))
    return ((e @ param(f"head{t}", (4,)) - y) ** 2).mean()


def _dot_v(cid, name):
    """sum(g * v) of ``name``'s first gradient, on its worker (recorded)."""
    import distgrad.autograd as dist_autograd
    g = dist_autograd.get_gradients(cid)[_PARAMS[name]]
    return (g * _value("v_" + name, g.shape)).sum()


def hessian_vector(world):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    _PARAMS.clear()
    trainers = list(range(1, world))
    names = {"ps_w": 0, **{f"head{t}": t for t in trainers}}
    with dist_autograd.context() as cid:
        loss = sum(rpc.rpc_sync(f"worker{t}", _trainer_loss, args=(t,)) for t in trainers)
        dist_autograd.backward(cid, [loss], create_graph=True)
        first = _grads(cid, names)
        s = _dot_v(cid, "ps_w") + sum(rpc.rpc_sync(f"worker{t}", _dot_v, args=(cid, f"head{t}"))
                                      for t in trainers)
        dist_autograd.backward(cid, [s])
        final = _grads(cid, names)
    p = {"ps_w": _value("ps_w", (3, 4)).requires_grad_(),
         **{f"head{t}": _value(f"head{t}", (4,)).requires_grad_() for t in trainers}}
    loss = sum(((torch.tanh(_value(f"x{t}", (6, 3)) @ p["ps_w"]) @ p[f"head{t}"] - _value(f"y{t}", (6,)))
                ** 2).mean() for t in trainers)
    g = torch.autograd.grad(loss, list(p.values()), create_graph=True)
    hv = torch.autograd.grad(sum((gi * _value("v_" + n, gi.shape)).sum() for n, gi in zip(p, g)),
                             list(p.values()))
    return first, final, dict(zip(p, [gi.detach() for gi in g])), dict(zip(p, hv))


# -- 3. two inner MAML steps on a model whose layers live on different workers -------
ALPHA = 0.1
SHAPES = [(3, 4), (4, 4), (4, 2)]


def _layers(world):
    """(worker, shape) of each layer: 2 workers hold one layer each; with more, the
    driver (worker0) holds none."""
    owners = [0, 1] if world == 2 else list(range(1, world))
    return [(w, SHAPES[min(i, 1)] if i < len(owners) - 1 else SHAPES[2]) for i, w in enumerate(owners)]


def _maml_layer(i, layers, step, h, offsets):
    """Layer ``i`` on its worker with the fast weights of ``step`` (0 = theta), then
    the next layers (nested calls)."""
    import distgrad.rpc as rpc
    w = param(f"theta{i}", layers[i][1]) if step == 0 else _FAST[(i, step)]
    if offsets:
        w = w + _offset_here(i, step, layers[i][1])
    h = h @ w
    if i == len(layers) - 1:
        return h
    h = torch.tanh(h)
    return rpc.rpc_sync(f"worker{layers[i + 1][0]}", _maml_layer, args=(i + 1, layers, step, h, offsets))


def _offset_here(i, step, shape):
    """MAML's fast weights as leaves: a zero offset whose gradient is the gradient with
    respect to the fast weights (dL(phi + z)/dz at z = 0 is dL/dphi)."""
    z = torch.zeros(shape, dtype=DT, requires_grad=True)
    _PARAMS[f"z{i}_{step}"] = z
    return z


def _inner_update(cid, i, step):
    """phi_i^{step+1} = phi_i^step - alpha * dL/dphi_i^step, kept on this worker."""
    import distgrad.autograd as dist_autograd
    g = dist_autograd.get_gradients(cid)[_PARAMS[f"z{i}_{step}"]]
    w = _PARAMS[f"theta{i}"] if step == 0 else _FAST[(i, step)]
    _FAST[(i, step + 1)] = w - ALPHA * g
    return g.requires_grad


def _maml_reset():
    _PARAMS.clear()
    _FAST.clear()


def maml(world):
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    layers = _layers(world)
    for w in range(world):
        rpc.rpc_sync(f"worker{w}", _maml_reset)
    xs, ys, xq, yq = (_value("xs", (5, 3)), _value("ys", (5, 2)), _value("xq", (5, 3)), _value("yq", (5, 2)))
    names = {f"theta{i}": w for i, (w, _) in enumerate(layers)}
    first0 = layers[0][0]
    with dist_autograd.context() as cid:
        recorded = []
        for step in range(2):
            out = rpc.rpc_sync(f"worker{first0}", _maml_layer, args=(0, layers, step, xs, True))
            dist_autograd.backward(cid, [((out - ys) ** 2).mean()], create_graph=True)
            recorded += [rpc.rpc_sync(f"worker{w}", _inner_update, args=(cid, i, step))
                         for i, (w, _) in enumerate(layers)]
        before = _grads(cid, names)
        out = rpc.rpc_sync(f"worker{first0}", _maml_layer, args=(0, layers, 2, xq, False))
        dist_autograd.backward(cid, [((out - yq) ** 2).mean()])
        after = _grads(cid, names)
    meta = {n: after[n][0] - before[n][0] for n in names}
    # local MAML, as usually written: fast weights and torch.autograd.grad
    theta = [_value(f"theta{i}", s).requires_grad_() for i, (_, s) in enumerate(layers)]

    def model(ws, x):
        for j, w in enumerate(ws):
            x = x @ w if j == len(ws) - 1 else torch.tanh(x @ w)
        return x
    fast = theta
    for _ in range(2):
        g = torch.autograd.grad(((model(fast, xs) - ys) ** 2).mean(), fast, create_graph=True)
        fast = [w - ALPHA * gi for w, gi in zip(fast, g)]
    want = torch.autograd.grad(((model(fast, xq) - yq) ** 2).mean(), theta)
    return recorded, meta, dict(zip(names, want))


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _check_all(rank, world):
    """On worker0: run the three programs and return what differs from local autograd
    (tensors stay here: a spawned worker's tensors do not outlive it)."""
    if rank != 0:
        return None
    bad = []

    def expect(ok, what):
        if not ok:
            bad.append(what)

    first, final, local_first, local_final, want_gp = gradient_penalty(world)
    expect(set(final) == set(local_final), f"gp: gradients of {sorted(final)}, want {sorted(local_final)}")
    for n in local_final:
        expect(_close(first[n][0], local_first[n]), f"gp: first-pass gradient of {n}")
        expect(_close(final[n][0], local_final[n]), f"gp: accumulated gradient of {n}: "
                                                     f"{final[n][0]} != {local_final[n]}")
        # what the second pass added is the penalty's gradient
        expect(_close(final[n][0] - first[n][0], want_gp[n]), f"gp: penalty gradient of {n}")
        expect(first[n][1], f"gp: first-pass gradient of {n} does not require grad")
    expect(any(t.abs().max() > 1e-3 for t in want_gp.values()), "gp: vacuous (zero penalty gradient)")

    first, final, g, hv = hessian_vector(world)
    for n in g:
        expect(first[n][1], f"hvp: first-pass gradient of {n} does not require grad")
        expect(_close(first[n][0], g[n]), f"hvp: gradient of {n}")
        expect(_close(final[n][0], g[n] + hv[n]), f"hvp: H v of {n}: {final[n][0] - first[n][0]} != {hv[n]}")
        expect(hv[n].abs().max() > 1e-3, f"hvp: vacuous (H v of {n} is zero)")

    recorded, meta, want = maml(world)
    expect(all(recorded), "maml: an inner gradient does not require grad")
    for n in want:
        expect(_close(meta[n], want[n]), f"maml: meta-gradient of {n}: {meta[n]} != {want[n]}")
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_second_derivatives_match_local_autograd(world):
    bad = run_workers(_check_all, world_size=world, timeout=150)[0]
    assert bad == []
