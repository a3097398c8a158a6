"""nn.Parameters sent over RPC in the random programs (part of tests/random_programs.py).

torch's rule (tests/torch_differential.py runs it on real torch RPC; docs/compatibility.md):

1. a bare ``torch.nn.Parameter`` in a message (an argument of a Python function's call
   by rpc_sync / rpc_async / remote, a reply, an RRef's value fetched by ``to_here`` on
   another worker) arrives as a NEW leaf nn.Parameter (same values, same
   ``requires_grad``) with no autograd link to the sender: no gradient flows back to the
   sender's Parameter through it; on the receiver the new leaf is an ordinary leaf, its
   gradient goes to the receiver's context (never ``.grad``);
2. a view of a Parameter (``p.view_as(p)``, ``p[...]``, ``p * 1``: any non-Parameter
   tensor computed from it) is linked as any tensor is;
3. a plain tensor flagged ``t._is_param = True`` (nn.Parameter's metaclass takes it for
   one in ``isinstance``) is no Parameter here (an exact type check): linked;
4. a Parameter argument of a BUILTIN operator called over RPC
   (``rpc_sync(w, torch.add, args=(p, x))``) is a tensor like any other: linked.

The local oracle models 1 where a value crosses a call boundary (:func:`cross`, used by
LocalRuntime for arguments, replies and RRef values fetched off their owner; an RRef
fetched on its owner is the owner's value itself, as torch's OwnerRRef gives it), 2 and
3 need nothing (a function call links everything) and 4 is the plain op.

Every exact Parameter bound to a register by a crossing (a block's params, a call's,
wait's, to_here's or chain's outputs) and not yet one of the worker's leaves is
registered as a leaf named after the site (:func:`receive`): ``recv.<site>`` where the
site is the block's ``"site"`` and the param register, or the output register; a
second forward (prog["twice"]) of one site gets ``recv.<site>.f1``. Sites run once per
forward and forwards run one after the other, so the names are the same in both runs,
and the new leaves' gradients are compared like every leaf's.

Instructions (feature "param", group "params")::

    ("pleaf", out, name, shape, requires_grad, kind)   get-or-create a named leaf on this
        worker: kind "nnparam" an nn.Parameter (requires_grad mostly True) with an
        attribute ``origin`` (every Parameter received must have it: reported through
        random_round2's list otherwise), "flagged" a plain tensor with ``_is_param = True``
    ("op", out, "view_as", [p], {})                    p.view_as(p) (a plain tensor)
    ("builtin", out, worker, "add" | "mul", [x, y])     rpc_sync(worker, torch.add/mul,
                                                        args=(x, y)); locally the op

and calls made with a bare Parameter argument, or returning one (a reply, an RRef).
"""
from __future__ import annotations

import torch

PARAM_FEATURES = ("param",)
BUILTINS = {"add": torch.add, "mul": torch.mul}
_Parameter = torch.nn.Parameter


# -- runtime pieces ---------------------------------------------------------------------
class _Message(torch.autograd.Function):
    """A tensor that requires grad crossing a message in the local reference: the same
    values, and in the backward a gradient in memory of its own, as the gradient a
    message carries back arrives in a buffer of its own (torch's RPC, to another worker
    or to itself): a leaf behind it may keep that buffer, never the memory of a
    gradient a hook kept on the other side."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)   # an absent gradient stays absent (not zeros)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return None if g is None else g.clone()


def cross1(v):
    """What a message does to one value (torch's rule 1): an exact nn.Parameter arrives
    as a new leaf Parameter; a tensor that requires grad arrives linked, its gradient
    going back in a buffer of its own (:class:`_Message`); everything else (tensors
    without grad, RRefs) as a function call passes it."""
    if type(v) is _Parameter:
        new = _Parameter(v.detach().clone(), requires_grad=v.requires_grad)
        new.__dict__.update(v.__dict__)   # its attributes travel with it (``origin``)
        return new
    if isinstance(v, torch.Tensor) and v.requires_grad and torch.is_grad_enabled():
        return _Message.apply(v)
    return v


def cross(values) -> tuple:
    """:func:`cross1` over a message's values (a call's arguments or reply)."""
    return tuple(cross1(v) for v in values)


def receive(state, sites: list, values) -> None:
    """Register every exact Parameter of ``values`` bound at ``sites`` (one per value)
    that is none of this worker's leaves yet as a leaf named after its site."""
    for site, v in zip(sites, values):
        if type(v) is not _Parameter:
            continue
        if not isinstance(getattr(v, "origin", None), str):   # every one comes from a pleaf
            with state.lock:
                state.round2.append(f"the nn.Parameter received at {site} lost its attributes "
                                    f"(torch keeps them): {sorted(v.__dict__)}")
        with state.lock:
            if any(t is v for t in state.leaves.values()):
                continue
            k = state.received[site]
            state.received[site] += 1
            state.leaves[f"recv.{site}" + (f".f{k}" if k else "")] = v
            state._hold_accumulator(v)


def param_sites(block: dict) -> list:
    """The sites of a block's params."""
    site = block.get("site", f"w{block['worker']}")
    return [f"{site}.r{p}" for p in block["params"]]


def out_sites(outs) -> list:
    return [f"r{o}" for o in outs]


def make_leaf(name: str, shape: tuple, rg: bool, kind: str, randn) -> torch.Tensor:
    """The tensor of a ("pleaf", ...) instruction."""
    if kind == "nnparam":
        p = _Parameter(randn(name, shape), requires_grad=rg)
        p.origin = name     # an attribute: a Parameter received must still have it
        return p
    if kind == "flagged":
        t = randn(name, shape).requires_grad_(rg)
        t._is_param = True
        return t
    raise ValueError(f"unknown pleaf kind {kind}")


def builtin_dist(worker: int, opname: str, xs: list):
    from random_programs import dist_modules
    rpc = dist_modules()[0]
    return rpc.rpc_sync(f"worker{worker}", BUILTINS[opname], args=tuple(xs))


def builtin_local(opname: str, xs: list):
    return BUILTINS[opname](*xs)


# -- the generator's pieces -------------------------------------------------------------
def g_pleaf(gen, b, kind: str, shape=None) -> int:
    """A named nn.Parameter (or ``_is_param`` tensor) leaf of this worker."""
    r = gen.rnd
    shape = gen.rand_shape() if shape is None else tuple(shape)
    rg = r.random() < 0.85
    name = gen.name(f"w{b.worker}.{kind}")
    out = gen.tensor(shape, rg)
    gen.emit(b, ("pleaf", out, name, shape, rg, kind), out)
    if kind == "nnparam":
        gen.bare.add(out)
    if rg:
        b.leaves.append(out)
        gen.leaf_names[out] = name
        gen.grad_leaves[b.worker].append(name)
    return out


def a_bare(gen, b, fresh: float = 0.4) -> int:
    """A bare Parameter of this block (often a new one)."""
    mine = [x for x in b.env if x in gen.bare]
    if mine and gen.rnd.random() > fresh:
        return gen.rnd.choice(mine)
    return g_pleaf(gen, b, "nnparam")


def g_param(gen, b) -> None:
    """One of the patterns: a bare Parameter (or a view of one, or an ``_is_param``
    tensor) sent as an argument; a call that replies one bare, or holds one in an RRef
    (fetched here, or not); a Parameter argument of a builtin over RPC. What arrives is
    mostly used at once (so its gradient, or its absence, reaches the roots), and a
    Parameter sent is sometimes used on the sender too."""
    r = gen.rnd
    kinds = ["builtin"] + ["arg", "view", "flagged", "reply", "rref"] * (b.depth < 3)
    kind = r.choice(kinds)
    if kind == "builtin":
        x = a_bare(gen, b)
        sx = gen.shape(x)
        fits = [t for t in gen.tensors(b) if t != x and gen.rg(t)
                and len(gen.shape(t)) <= len(sx) and _bcast(sx, gen.shape(t)) == sx]
        y = r.choice(fits) if fits and r.random() < 0.6 else gen.g_leaf(b, gen.partner_shape(sx)
                                                                         if r.random() < 0.3 else sx)
        ins = [x, y] if r.random() < 0.5 else [y, x]
        out = gen.tensor(_bcast(gen.shape(ins[0]), gen.shape(ins[1])), gen.rg(x) or gen.rg(y))
        gen.emit(b, ("builtin", out, r.randrange(gen.world), r.choice(sorted(BUILTINS)), ins), out)
        b.own.append(out)
        gen.received.add(out)
        return
    if kind in ("arg", "view", "flagged"):
        if kind == "flagged":
            x = g_pleaf(gen, b, "flagged")
        else:
            x = a_bare(gen, b)
            if kind == "view":
                x = gen.op(b, "view_as", [x], {}, gen.shape(x))
        gen.g_call(b, extra_args=[x])
        if r.random() < 0.4:
            use(gen, b, x)
        return
    if kind == "reply":
        n = len(b.body)
        gen.g_call(b, mode=r.choice(["sync", "async_now", "remote_here", "async"]), ret_param=True)
        ins = b.body[n] if len(b.body) > n else None
        if ins is not None and ins[0] == "call":
            for o, x in zip(ins[1], ins[3]["returns"]):
                if x in gen.bare and r.random() < 0.8:
                    use(gen, b, o)
        return
    gen.g_call(b, mode="remote", ret_param=True)
    rref = b.env[-1]
    if r.random() < 0.6:
        gen.g_to_here(b, rref)
        ins = b.body[-1]
        rets = ins_returns(b, rref)
        for o, x in zip(ins[1], rets):
            if x in gen.bare:
                gen.bare.add(o)
                if r.random() < 0.8:
                    use(gen, b, o)


def ins_returns(b, rref: int) -> list:
    """The returns of the block of ``remote`` instruction ``rref`` in ``b``."""
    return next(i[2]["returns"] for i in b.body if i[0] == "remote" and i[1] == rref)


def use(gen, b, x: int) -> int:
    """A use of ``x`` at once (its result is a recent value, so often returned)."""
    r = gen.rnd
    name = r.choice(["square", "sin", "scale"])
    return gen.op(b, name, [x], {"c": r.choice([-1.5, 0.5, 3.0])} if name == "scale" else {}, gen.shape(x))


def _bcast(a: tuple, b: tuple):
    import random_programs as rp
    return rp.broadcast_shape(a, b)


def returned_param(gen, child) -> int:
    """A bare Parameter the child returns (one of its own, or a new one)."""
    return a_bare(gen, child, fresh=0.5)


def used_args(gen, child, extra_args) -> list:
    """Uses of the extra arguments in the callee (returned by it, mostly)."""
    return [use(gen, child, x) for x in extra_args if gen.rnd.random() < 0.85]


# -- walking ----------------------------------------------------------------------------
def bare_registers(prog: dict, walk, sub_block) -> tuple:
    """(registers holding an exact Parameter, flagged ones) of ``prog`` (statically)."""
    bare, flagged = set(), set()
    insns = [ins for _, ins, _, _ in walk(prog["main"])]
    for ins in insns:
        if ins[0] == "pleaf":
            (bare if ins[5] == "nnparam" else flagged).add(ins[1])
    futs = {ins[1]: sub_block(ins)["returns"] for ins in insns if ins[0] in ("async", "remote")}
    changed = True
    while changed:
        changed = False
        for ins in insns:
            if ins[0] == "call":
                rets = ins[3]["returns"]
            elif ins[0] in ("wait", "to_here"):
                rets = futs.get(ins[2], [])
            else:
                continue
            for o, x in zip(ins[1], rets):
                if x in bare and o not in bare:
                    bare.add(o)
                    changed = True
    return bare, flagged


def static_features(prog: dict, walk, sub_block) -> set:
    bare, flagged = bare_registers(prog, walk, sub_block)
    if not bare and not flagged:
        return set()
    f = set()
    views = set()
    for _, ins, _, _ in walk(prog["main"]):
        if ins[0] == "op" and ins[2] == "view_as" and ins[3][0] in bare:
            views.add(ins[1])
        if ins[0] == "builtin" and bare & set(ins[4]):
            f.add("nn.Parameter argument of a builtin over RPC")
        sub = sub_block(ins)
        if sub is None or ins[0] == "ckpt":
            continue
        if bare & set(sub["params"]):
            f.add("nn.Parameter sent bare as an argument")
        if views & set(sub["params"]):
            f.add("view of an nn.Parameter sent")
        if flagged & set(sub["params"]):
            f.add("tensor flagged _is_param sent")
        if bare & set(sub["returns"]):
            f.add("nn.Parameter held in an RRef" if ins[0] == "remote"
                  or (ins[0] == "call" and ins[2] == "remote_here") else "nn.Parameter returned bare")
    return f


FEATURES = ["nn.Parameter sent bare as an argument", "nn.Parameter returned bare",
            "nn.Parameter held in an RRef", "view of an nn.Parameter sent",
            "tensor flagged _is_param sent", "nn.Parameter argument of a builtin over RPC"]


def dump_line(ins) -> str:
    if ins[0] == "pleaf":
        _, out, name, shape, rg, kind = ins
        what = "nn.Parameter" if kind == "nnparam" else "tensor with _is_param=True"
        return f"r{out} = {what} {name.split('.', 1)[1]} {tuple(shape)}{' requires_grad' if rg else ''}"
    _, out, w, opname, xs = ins
    return f"r{out} = rpc_sync(worker{w}, torch.{opname}, args=({', '.join(f'r{x}' for x in xs)}))"
