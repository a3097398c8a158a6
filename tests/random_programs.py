"""Random distributed autograd programs: generator, interpreter, oracle, shrinker and CLI.

A *program* is plain data (dicts, lists, tuples, ints, strings): picklable, printable,
and small enough to shrink. One interpreter (:func:`run_block`) runs it either

- locally: one process, plain torch autograd, every "call" is a function call; this is
  the oracle, computed in a process that never imported distgrad (tests/clean_ref.py:
  :func:`reference`, :func:`prepare`), so no patch distgrad applies to torch can
  change it, or
- distributed: the main block runs on worker0 inside a ``dist_autograd.context()``,
  every call block runs on its worker through ``rpc_sync`` / ``rpc_async`` /
  ``remote``, and ``dist_autograd.backward`` runs over the same roots.

Every leaf's gradient (present or absent), every root's forward value and the number
of times each counting node ran must agree with the oracle (float64, tight tolerance).

Program layout::

    program = {"seed", "world", "retain": bool, "roots": [reg, ...], "main": block}
    block   = {"worker": int, "params": [reg, ...], "body": [instr, ...], "returns": [reg, ...],
               "site": str (call blocks of programs with feature "param": names received Parameters)}

Registers are ints, each defined once in the whole program. A block's params are the
caller's argument registers (same ids: the callee sees copies of those values), so a
block only ever refers to its params and to registers it defines itself. Instructions::

    ("leaf", out, name, shape, requires_grad)  get-or-create a float64 leaf (or constant)
                                               named ``name`` on this block's worker
    ("op", out, opname, [in, ...], attrs)      one-output op (see apply_op)
    ("multi", [out, ...], opname, in, attrs)   split / chunk / unbind
    ("call", [out, ...], mode, block)          mode: sync | async_now | remote_here
    ("async", fut, block)  + ("wait", [out, ...], fut)        rpc_async, waited later
    ("remote", rref, block) + ("to_here", [out, ...], rref)   an RRef; to_here anywhere
    ("stash", name, in) / ("unstash", out, name)   a worker-level dict kept across calls

What users combine with autograd (issue 18; each drawn per program with the probability
in FEATURE_WEIGHTS, ``--features`` restricts or forces them)::

    ("hook", reg, kind, attrs)        reg.register_hook: scale {c} | mask {mask} |
                                      masked_fill {mask, value} (masks fixed by name)
    ("nodehook", reg, kind, {"c"})    reg.grad_fn.register_prehook (pre) / register_hook
                                      returning scaled grad_inputs (post) / the leaf's
                                      AccumulateGrad.register_prehook (acc)
    ("module", out, name, in, attrs)  a float64 nn.Linear of this worker fixed by name (its
                                      parameters are leaves), with a full backward hook
                                      scaling grad_input and/or a pre-hook scaling grad_output
    ("ckpt", [out, ...], reentrant, block)   block (local ops only) under checkpoint()
    ("inplace", reg, mul_|add_, [z], attrs)  on a fresh result whose op saves no output,
                                             or on a clone
    ("op", out, "compiled" | "ac_matmul" | "ac_linear" | "clone", ...)  torch.compile
                                      (aot_eager), bfloat16 under autocast, clone

Threads (issue 26; tests/random_threads.py): plain ``backward()`` on another thread
during the passes (``prog["plain"]``, ``("plain_hook", leaf)``; every leaf's ``.grad``
is checked exactly), two passes at once over shared parameters (``prog["twice"]``),
gradients kept by hooks and changed after the passes (``("keep", reg, {"op"})``), and
rpc_asyncs whose bodies wait on each other (``("signal", key, worker)``,
``("wait_for", key)``).

nn.Parameters over RPC (tests/random_params.py; feature ``param``, group ``params``),
by torch's rule: a bare nn.Parameter in a message (argument, reply, RRef value fetched
off its owner) arrives as a new leaf with no link back (the local runtime converts it at
every crossing, random_params.cross; each received one is a leaf named after its site,
so its gradient is compared too); a view, a tensor flagged ``_is_param`` and a builtin's
Parameter argument are linked::

    ("pleaf", out, name, shape, rg, kind)   a named leaf: nn.Parameter ("nnparam") or a
                                            plain tensor with _is_param = True ("flagged")
    ("op", out, "view_as", [p], {})         p.view_as(p)
    ("builtin", out, worker, add|mul, [x, y])   rpc_sync(worker, torch.add/mul, args=(x, y))

plus calls given a bare Parameter argument, or returning one (a reply, an RRef).

What torch ties to one graph task (issue 43; tests/random_round3.py; group ``round3``,
off by default): multi-grad hooks, queue_callback from a hook, dispatch / function modes
around backward, hooks that open contexts or take seconds, checkpoint outputs used and
sent, anomaly mode with a NaN in a shared region, grad_dtype, backward again without
retain_graph, a leaf sent while a thread uses it. These programs are compared with
torch's own distributed autograd run on the same program in processes that never
imported distgrad (:data:`IMPL` selects whose RPC a process's distributed runs use).

CLI (see ``--help``); without ``--seed`` the base seed is fresh (and printed)::

    python tests/random_programs.py --programs 500 --workers 2,3,4 [--seed S] [--shrink 2]
    python tests/random_programs.py --programs 60 --features hooks,checkpoint   # only these
    python tests/random_programs.py --programs 60 --workers 2,3 --features params
    python tests/random_programs.py --programs 500 --features default,threads=0.5
    python tests/random_programs.py --programs 20 --workers 2,3 --features round3=0.4
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zlib

import random_params as rt_params
import random_round2 as rt_round2
import random_round3 as rt_round3
import random_threads as rt_threads
import torch

# a module whose input needs no grad: torch warns that its full backward hook sees grad_output
warnings.filterwarnings("ignore", message="Full backward hook is firing")

DTYPE = torch.float64
RTOL, ATOL = 1e-9, 1e-10     # float64: only summation order may differ
MAX_DIM = 6                  # no dimension grows past this (keeps programs fast)
MAX_NDIM = 3
BACKWARD_TIMEOUT = 20.0      # s; a backward that takes longer is reported as a hang


# ---------------------------------------------------------------------------------------
# autograd Functions used by programs
# ---------------------------------------------------------------------------------------
class Count(torch.autograd.Function):
    """Identity whose backward counts its runs (per tag) in the runtime's counter, so a
    node that runs twice, or runs when local autograd would not run it, is caught."""

    @staticmethod
    def forward(ctx, x, tag, counter):
        ctx.tag, ctx.counter = tag, counter
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.counter(ctx.tag)
        return g, None, None


class FirstOnly(torch.autograd.Function):
    """``2 * x + y.sum()`` whose backward returns None for ``y``: y (and whatever only
    feeds y) must end with no gradient at all, not a zero one."""

    @staticmethod
    def forward(ctx, x, y):
        return x * 2 + y.sum()

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def _named_randn(name: str, shape: tuple) -> torch.Tensor:
    """Deterministic values for ``name`` in every process (crc32, not hash(): Python's
    string hash differs between processes)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=DTYPE)


class Poison(torch.autograd.Function):
    """Identity whose backward returns NaN (``--anomaly``: injected after one op)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def apply_op(name: str, xs: list, a: dict, counter) -> torch.Tensor:
    """One single-output op of the program language (``a["poison"]``: its result goes
    through :class:`Poison`)."""
    out = _apply_op(name, xs, a, counter)
    if a.get("poison") and out.requires_grad:
        out = Poison.apply(out)
    return out


def _apply_op(name: str, xs: list, a: dict, counter) -> torch.Tensor:
    x = xs[0]
    if name == "sin":
        return x.sin()
    if name == "tanh":
        return torch.tanh(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "square":
        return x * x
    if name == "scale":
        return x * a["c"]
    if name == "add":
        return xs[0] + xs[1]
    if name == "sub":
        return xs[0] - xs[1]
    if name == "mul":
        return xs[0] * xs[1]
    if name == "div":
        return xs[0] / (1.0 + xs[1] * xs[1])
    if name in ("sum", "mean"):
        fn = torch.sum if name == "sum" else torch.mean
        return fn(x) if a["dims"] is None else fn(x, dim=tuple(a["dims"]), keepdim=a["keepdim"])
    if name == "narrow":
        return x.narrow(a["dim"], a["start"], a["length"])
    if name == "index":           # advanced indexing on dim 0, repeated indices
        return x[torch.tensor(a["idx"])]
    if name == "index_select":
        return x.index_select(a["dim"], torch.tensor(a["idx"]))
    if name == "select":
        return x.select(a["dim"], a["i"])
    if name == "transpose":
        return x.transpose(a["d0"], a["d1"])
    if name == "permute":
        return x.permute(*a["perm"])
    if name == "expand":
        return x.expand(*a["shape"])
    if name == "unsqueeze":
        return x.unsqueeze(a["dim"])
    if name == "squeeze":
        return x.squeeze(a["dim"])
    if name == "reshape":
        return x.reshape(a["shape"])
    if name == "cat":
        return torch.cat(xs, a["dim"])
    if name == "stack":
        return torch.stack(xs, a["dim"])
    if name == "matmul":
        return torch.matmul(xs[0], xs[1])
    if name == "first_only":
        return FirstOnly.apply(xs[0], xs[1])
    if name == "detach":
        return x.detach()
    if name == "count":
        return Count.apply(x, a["tag"], counter)
    if name == "dot":             # fixed random weights: a wrong slot or permutation shows
        return (x * _named_randn(a["w"], tuple(x.shape))).sum()
    if name == "clone":
        return x.clone()
    if name == "view_as":         # of an nn.Parameter: a plain tensor, linked (random_params)
        return x.view_as(x)
    if name == "lowgrad":         # a float32 gradient for a float64 input (random_round3)
        return rt_round3.LowGrad.apply(x)
    if name == "embed":           # sparse gradients (issue 34)
        return torch.nn.functional.embedding(torch.tensor(a["idx"]), x, sparse=True)
    if name == "compiled":        # torch.compile(backend="aot_eager"), once per process
        return (_compiled(a["fn"]) if torch.is_grad_enabled() else COMPILE_FNS[a["fn"]])(*xs)
    if name in ("ac_matmul", "ac_linear"):   # bfloat16 compute (autocast leaves float64 alone)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fs = [t.to(torch.float32) for t in xs]
            y = torch.matmul(*fs) if name == "ac_matmul" else torch.nn.functional.linear(*fs)
        return y.to(DTYPE)
    raise ValueError(f"unknown op {name}")


def apply_multi(name: str, x: torch.Tensor, a: dict) -> tuple:
    """Ops with several outputs (views of one input)."""
    if name == "split":
        return x.split(a["size"], a["dim"])
    if name == "chunk":
        return x.chunk(a["n"], a["dim"])
    if name == "unbind":
        return x.unbind(a["dim"])
    raise ValueError(f"unknown multi op {name}")


# -- what users combine with autograd (issue 18): hooks, modules, checkpoint, compile,
# autocast, in-place ops. Programs stay plain data: the closures are built here.
def _c_sin_mul(x):
    return torch.sin(x) * x + 0.5 * x


def _c_tanh_mix(x, y):
    return torch.tanh(x) * y - x


COMPILE_FNS = {"sin_mul": _c_sin_mul, "tanh_mix": _c_tanh_mix}   # name -> eager function
_COMPILED: dict = {}
_COMPILE_LOCK = threading.Lock()


def _compiled(name: str):
    """COMPILE_FNS[name] under torch.compile(backend="aot_eager"), made once per process
    (dynamo recompiles per new shape itself)."""
    with _COMPILE_LOCK:
        fn = _COMPILED.get(name)
        if fn is None:
            fn = _COMPILED[name] = torch.compile(COMPILE_FNS[name], backend="aot_eager")
        return fn


def _named_mask(name: str, shape: tuple) -> torch.Tensor:
    """A fixed boolean mask for ``name`` (about half True), the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.rand(shape, generator=gen, dtype=DTYPE) < 0.5


def _scaled(gs, c: float) -> tuple:
    """Every present gradient of ``gs`` times ``c`` (absent ones stay absent)."""
    return tuple(g * c if g is not None else None for g in gs)


def grad_hook(kind: str, a: dict):
    """The tensor hook of a ("hook", reg, kind, attrs) instruction (an absent gradient,
    None, as behind FirstOnly, stays absent)."""
    if kind == "scale":
        def fn(g):
            return g * a["c"]
    elif kind == "mask":
        def fn(g):
            return g * _named_mask(a["mask"], tuple(g.shape)).to(g.dtype)
    elif kind == "masked_fill":
        def fn(g):
            return g.masked_fill(_named_mask(a["mask"], tuple(g.shape)), a["value"])
    else:
        raise ValueError(f"unknown hook {kind}")
    return lambda g: None if g is None else fn(g)


def register_node_hook(t: torch.Tensor, kind: str, a: dict, keep: list) -> None:
    """("nodehook", reg, kind, attrs): a pre-hook ("pre") or post-hook ("post", it
    returns new grad_inputs) on ``t.grad_fn``, or a pre-hook on the AccumulateGrad node
    of leaf ``t`` ("acc"; the node is kept alive in ``keep``); each scales by a["c"]."""
    c = a["c"]
    if kind == "acc":
        node = torch.autograd.graph.get_gradient_edge(t).node
        keep.append(node)
        node.register_prehook(lambda gos: _scaled(gos, c))
    elif kind == "pre":
        t.grad_fn.register_prehook(lambda gos: _scaled(gos, c))
    elif kind == "post":
        t.grad_fn.register_hook(lambda gis, gos: _scaled(gis, c))
    else:
        raise ValueError(f"unknown node hook {kind}")


def make_linear(name: str, a: dict) -> torch.nn.Module:
    """nn.Linear(a["in"], a["out"]) in float64 with weights fixed by ``name``, and full
    backward hooks (a["hook"]: "full" scales grad_input, "pre" grad_output, "both")."""
    lin = torch.nn.utils.skip_init(torch.nn.Linear, a["in"], a["out"], dtype=DTYPE)
    lin.weight = torch.nn.Parameter(_named_randn(name + ".weight", (a["out"], a["in"])))
    lin.bias = torch.nn.Parameter(_named_randn(name + ".bias", (a["out"],)))
    c = a["c"]
    if a["hook"] in ("full", "both"):
        lin.register_full_backward_hook(lambda m, gin, gout: _scaled(gin, c))
    if a["hook"] in ("pre", "both"):
        lin.register_full_backward_pre_hook(lambda m, gout: _scaled(gout, c))
    return lin


def apply_inplace(x: torch.Tensor, kind: str, zs: list, a: dict) -> None:
    """("inplace", reg, kind, [z], attrs): x.mul_(c) or x.add_(z)."""
    if kind == "mul_":
        x.mul_(a["c"])
    elif kind == "add_":
        x.add_(zs[0])
    else:
        raise ValueError(f"unknown in-place op {kind}")


def run_checkpoint(sub: dict, xs: list, reentrant: bool, rt) -> tuple:
    """("ckpt", outs, reentrant, block): ``block`` (local ops only) under
    torch.utils.checkpoint; run plainly without grad mode (shape-only runs)."""
    def fn(*args):
        return run_block(sub, args, rt)
    if not torch.is_grad_enabled():
        return fn(*xs)
    from torch.utils.checkpoint import checkpoint
    return tuple(checkpoint(fn, *xs, use_reentrant=reentrant))


# ---------------------------------------------------------------------------------------
# the interpreter
# ---------------------------------------------------------------------------------------
class WorkerState:
    """What one worker keeps across the calls of a program: leaves/parameters by name,
    the stash, the counting nodes' runs and the remote-call balance."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.leaves: dict = {}
        self.modules: dict = {}
        self.keep: list = []          # AccumulateGrad nodes that carry hooks
        self.stash: dict = {}
        self.counts: collections.Counter = collections.Counter()
        self.remote_issued = 0
        self.remote_done = 0
        self.kept: list = []          # (gradient, op) kept by ("keep", ...) hooks
        self.events: dict = {}        # rendezvous key -> threading.Event
        self.plain = None             # the running random_threads.PlainThread
        self.accumulators: list = []  # every leaf's AccumulateGrad node (see _hold_accumulator)
        self.post_acc: dict = {}      # leaf name -> its ("post_acc", ...) hook's calls
        self.kept_between: dict = {}  # context id -> {leaf name: tensor get_gradients gave}
        self.round2: list = []        # what random_round2's checks found here
        self.watcher = None           # the running random_round2.Watcher
        self.received: collections.Counter = collections.Counter()  # site -> Parameters received

    def event(self, key: str) -> threading.Event:
        """The rendezvous event ``key`` of this worker (get-or-create)."""
        with self.lock:
            return self.events.setdefault(key, threading.Event())

    def leaf(self, name: str, shape: tuple, requires_grad: bool, kind: str | None = None) -> torch.Tensor:
        """Get-or-create leaf ``name``: a plain tensor, or with ``kind`` an nn.Parameter or
        ``_is_param`` tensor (random_params.make_leaf)."""
        # under the lock: concurrent bodies (rpc_async, remote) may share a parameter,
        # and both must see the same tensor
        with self.lock:
            t = self.leaves.get(name)
            if t is None:
                t = self.leaves[name] = (
                    _named_randn(name, shape).requires_grad_(requires_grad) if kind is None
                    else rt_params.make_leaf(name, shape, requires_grad, kind, _named_randn))
                self._hold_accumulator(t)
            return t

    def _hold_accumulator(self, t: torch.Tensor) -> None:
        """Create ``t``'s AccumulateGrad node now, on one thread, and hold it. torch
        2.13 can deadlock when two threads use a leaf whose node does not exist yet:
        one creates it holding the leaf's mutex and waits for the GIL (to take a
        reference to the tensor's Python object), the other holds the GIL in a custom
        Function's ``apply`` and waits for the mutex. Seen in the clean reference
        process (no distgrad loaded) with two rendezvous bodies on threads; a node
        that lives is returned without either lock order."""
        if t.requires_grad and t.grad_fn is None:
            self.accumulators.append(torch.autograd.graph.get_gradient_edge(t).node)

    def module(self, name: str, attrs: dict) -> torch.nn.Module:
        """Get-or-create the Linear ``name``; its parameters are leaves like the others."""
        with self.lock:
            m = self.modules.get(name)
            if m is None:
                m = self.modules[name] = make_linear(name, attrs)
                self.leaves[name + ".weight"], self.leaves[name + ".bias"] = m.weight, m.bias
                self._hold_accumulator(m.weight)
                self._hold_accumulator(m.bias)
            return m

    def count(self, tag: str) -> None:
        with self.lock:
            self.counts[tag] += 1


def run_block(block: dict, values, rt) -> tuple:
    """Run ``block`` with its params bound to ``values``; returns its return values."""
    env = dict(zip(block["params"], values))
    state = rt.state(block["worker"])
    rt_params.receive(state, rt_params.param_sites(block), values)

    def bind(outs: list, got) -> None:
        """Values a message brought back (a reply, a wait, to_here, a chain)."""
        rt_params.receive(state, rt_params.out_sites(outs), got)
        env.update(zip(outs, got))
    for ins in block["body"]:
        op = ins[0]
        if op == "leaf":
            _, out, name, shape, rg = ins
            env[out] = state.leaf(name, tuple(shape), rg)
        elif op == "pleaf":
            _, out, name, shape, rg, kind = ins
            env[out] = state.leaf(name, tuple(shape), rg, kind)
        elif op == "builtin":
            _, out, worker, name, xs = ins
            xs = [env[r] for r in xs]
            env[out] = (rt_params.builtin_dist(worker, name, xs) if isinstance(rt, DistRuntime)
                        else rt_params.builtin_local(name, xs))
        elif op == "op":
            _, out, name, ins_, attrs = ins
            env[out] = apply_op(name, [env[r] for r in ins_], attrs, state.count)
        elif op == "multi":
            _, outs, name, x, attrs = ins
            env.update(zip(outs, apply_multi(name, env[x], attrs)))
        elif op == "call":
            _, outs, mode, sub = ins
            bind(outs, rt.call(mode, sub, [env[r] for r in sub["params"]], block["worker"]))
        elif op == "async":
            _, fut, sub = ins
            env[fut] = rt.call_async(sub, [env[r] for r in sub["params"]])
        elif op == "wait":
            _, outs, fut = ins
            bind(outs, rt.wait(env.pop(fut)))
        elif op == "remote":
            _, rref, sub = ins
            env[rref] = rt.remote(sub, [env[r] for r in sub["params"]])
        elif op == "to_here":
            _, outs, rref = ins
            bind(outs, rt.to_here(env[rref], block["worker"]))
        elif op == "stash":
            _, name, x = ins
            state.stash[name] = env[x]
        elif op == "unstash":
            _, out, name = ins
            env[out] = state.stash[name]
        elif op == "hook":        # a value without grad (shape-only runs; shrunk variants
            _, x, kind, attrs = ins   # that bypassed an op) has nothing to hook
            if env[x].requires_grad:
                env[x].register_hook(grad_hook(kind, attrs))
        elif op == "nodehook":
            _, x, kind, attrs = ins
            if env[x].requires_grad and (kind == "acc" or env[x].grad_fn is not None):
                register_node_hook(env[x], kind, attrs, state.keep)
        elif op == "module":
            _, out, name, x, attrs = ins
            env[out] = state.module(name, attrs)(env[x])
        elif op == "ckpt":
            _, outs, reentrant, sub = ins
            env.update(zip(outs, run_checkpoint(sub, [env[r] for r in sub["params"]], reentrant, rt)))
        elif op == "inplace":
            _, x, kind, zs, attrs = ins
            apply_inplace(env[x], kind, [env[z] for z in zs], attrs)
        elif op == "keep":
            _, x, attrs = ins
            if env[x].requires_grad:
                env[x].register_hook(rt_threads.keeper(state.kept, attrs["op"]))
        elif op == "plain_hook":   # (local autograd: no plain thread, no hook)
            if isinstance(rt, DistRuntime) and env[ins[1]].requires_grad:
                env[ins[1]].register_hook(rt_threads.plain_hook(state))
        elif op == "signal":
            _, key, worker = ins
            rt.signal(block["worker"], worker, key)
        elif op == "wait_for":
            rt_threads.wait_for(state.event(ins[1]), ins[1])
        elif op == "chain":
            _, outs, fa, fb, kind = ins
            fa, fb = env.pop(fa), env.pop(fb)
            bind(outs, rt_round2.chain_dist(fa, fb, kind) if isinstance(rt, DistRuntime)
                 else rt_round2.chain_local(rt, fa, fb))
        elif op in rt_round3.OPS:   # (local autograd: grad_dtype only)
            rt_round3.run_ins(ins, env, state, isinstance(rt, DistRuntime))
        elif op == "post_acc":      # (local autograd: no hook; it changes nothing)
            t = env[ins[1]]
            if isinstance(rt, DistRuntime) and t.requires_grad and t.grad_fn is None:
                name = next((n for n, v in state.leaves.items() if v is t), None)
                if name is not None:
                    rt_round2.register_post_acc(state, name, t)
        else:
            raise ValueError(f"unknown instruction {ins!r}")
        if isinstance(rt, LocalRuntime):
            rt.shapes.update((r, tuple(v.shape)) for r, v in env.items() if isinstance(v, torch.Tensor))
    return tuple(env[r] for r in block["returns"])


class LocalRRef:
    """The oracle's RRef: the values, computed eagerly, on worker ``owner``."""

    def __init__(self, values: tuple, owner: int) -> None:
        self.values, self.owner = values, owner


class LocalRuntime:
    """Single process: a call is a function call; one WorkerState per simulated worker.
    ``shapes`` maps every tensor register to its shape once the program ran. What a
    message does to its values (a bare nn.Parameter arrives as a new leaf) is done by
    random_params.cross on every argument, reply and RRef value fetched off its owner."""

    def __init__(self) -> None:
        self.states: dict[int, WorkerState] = collections.defaultdict(WorkerState)
        self.shapes: dict[int, tuple] = {}

    def state(self, worker: int) -> WorkerState:
        return self.states[worker]

    def call(self, mode, block, values, me=None):
        out = run_block(block, rt_params.cross(values), self)
        if mode == "remote_here" and me == block["worker"]:
            return out    # to_here on the owner: the value itself
        return rt_params.cross(out)

    def call_async(self, block, values):
        def body():
            return rt_params.cross(run_block(block, rt_params.cross(values), self))
        if rt_threads.waits(block):   # it waits on another body: both run at once
            return rt_threads.LocalFuture(body)
        return body()

    def wait(self, handle):
        return handle.wait() if isinstance(handle, rt_threads.LocalFuture) else handle

    def signal(self, me: int, worker: int, key: str) -> None:
        self.state(worker).event(key).set()

    def remote(self, block, values):
        return LocalRRef(run_block(block, rt_params.cross(values), self), block["worker"])

    def to_here(self, rref, me=None):
        # on its owner the value itself, elsewhere a copy sent in a message
        return rref.values if me == rref.owner else rt_params.cross(rref.values)


STATE = WorkerState()   # this process's state as a distributed worker

# whose RPC and distributed autograd this process's distributed runs use: "distgrad", or
# "torch" (torch.distributed.rpc / .autograd, in workers that never import distgrad: the
# reference of tests/random_round3.py)
IMPL = "distgrad"


def dist_modules() -> tuple:
    """(rpc, dist_autograd) of :data:`IMPL`."""
    if IMPL == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import distgrad.autograd as dist_autograd
        import distgrad.rpc as rpc
    return rpc, dist_autograd


def _serve(block: dict, values) -> tuple:
    """RPC target: run a call block on this worker."""
    return run_block(block, values, DistRuntime())


def _serve_remote(block: dict, values) -> tuple:
    """RPC target of ``remote``: as _serve, and counted so the driver can wait until
    every remote body has finished before the backward starts."""
    try:
        return run_block(block, values, DistRuntime())
    finally:
        with STATE.lock:
            STATE.remote_done += 1


class DistRuntime:
    """Distributed: a call block runs on ``block["worker"]`` through RPC."""

    def state(self, worker: int) -> WorkerState:
        return STATE

    def call(self, mode, block, values, me=None):
        rpc = dist_modules()[0]
        to, args = f"worker{block['worker']}", (block, tuple(values))
        if mode == "sync":
            return rpc.rpc_sync(to, _serve, args=args)
        if mode == "async_now":
            return rpc.rpc_async(to, _serve, args=args).wait()
        if mode == "remote_here":
            return self.remote(block, values).to_here()
        raise ValueError(mode)

    def call_async(self, block, values):
        rpc = dist_modules()[0]
        return rpc.rpc_async(f"worker{block['worker']}", _serve, args=(block, tuple(values)))

    def wait(self, fut):
        return fut.wait()

    def remote(self, block, values):
        rpc = dist_modules()[0]
        with STATE.lock:
            STATE.remote_issued += 1
        return rpc.remote(f"worker{block['worker']}", _serve_remote, args=(block, tuple(values)))

    def to_here(self, rref, me=None):
        return rref.to_here()

    def signal(self, me: int, worker: int, key: str) -> None:
        if worker == me:
            STATE.event(key).set()
        else:
            rpc = dist_modules()[0]
            rpc.rpc_sync(f"worker{worker}", rt_threads.signal, args=(key,))


# -- helpers the driver calls on every worker ------------------------------------------
def _reset() -> None:
    """Forget the previous program's leaves, stash, counts and remote balance."""
    STATE.clear()


def _remote_balance() -> tuple:
    """(remote() calls issued from here, remote() bodies finished here)."""
    with STATE.lock:
        return STATE.remote_issued, STATE.remote_done


def _take_counts() -> dict:
    """The counting nodes' runs here since the last call (and reset them)."""
    with STATE.lock:
        out = dict(STATE.counts)
        STATE.counts.clear()
    return out


def _collect_grads(cid: int) -> tuple:
    """({leaf name: grad}, [descriptions of entries that are none of our leaves]) from
    this worker's context; no context here means no gradients here."""
    dist_autograd = dist_modules()[1]
    try:
        grads = dist_autograd.get_gradients(cid)
    except RuntimeError as e:  # only this one means "no gradients"; any other is an error
        if "Could not find autograd context" not in str(e):
            raise
        return {}, []
    names = {id(t): n for n, t in STATE.leaves.items()}
    found, unknown = {}, []
    for t, g in grads.items():
        name = names.get(id(t))
        if name is None or not t.requires_grad:
            unknown.append(f"tensor of shape {tuple(t.shape)} (grad_fn={type(t.grad_fn).__name__})")
        else:
            found[name] = g.detach().clone()
    return found, unknown


def _engine_stats() -> dict:
    """distgrad's engine counters here, {} when the engine has none."""
    import distgrad.autograd as dist_autograd
    try:
        return dict(dist_autograd.get_engine_stats())
    except AttributeError:  # the engine may drop its counters; they are only a sanity check
        return {}


# ---------------------------------------------------------------------------------------
# the generator
# ---------------------------------------------------------------------------------------
def broadcast_shape(a: tuple, b: tuple):
    """The broadcast of two shapes, or None when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(reversed(out))


def matmul_shape(a: tuple, b: tuple):
    """torch.matmul's result shape, or None when invalid (or too many dims for us)."""
    if not a or not b:
        return None
    if len(a) == 1 and len(b) == 1:
        return () if a == b else None
    if len(b) == 1:
        return a[:-1] if a[-1] == b[0] else None
    if len(a) == 1:
        return b[:-2] + b[-1:] if a[0] == b[-2] else None
    if a[-1] != b[-2]:
        return None
    batch = broadcast_shape(a[:-2], b[:-2])
    if batch is None or len(batch) + 2 > MAX_NDIM:
        return None
    return batch + (a[-2], b[-1])


def reduce_shape(shape: tuple, dims, keepdim: bool) -> tuple:
    """The shape of sum/mean over ``dims`` (None: all)."""
    if dims is None:
        return ()
    return tuple(1 if i in dims else s for i, s in enumerate(shape) if keepdim or i not in dims)


# The features of issue 18, each drawn per program (on its own random stream) with
# this probability; a program that draws none is exactly what the generator made before
# them. The CLI's --features restricts or forces them; order 2 leaves out the ones
# torch cannot differentiate twice.
FEATURE_WEIGHTS = {
    "hook": 0.3,            # ("hook", reg, scale|mask|masked_fill, attrs) on an intermediate
    "nodehook": 0.25,       # ("nodehook", reg, pre|post|acc, {"c"}): grad_fn / AccumulateGrad
    "module": 0.2,          # ("module", out, name, in, attrs): Linear + full backward (pre-)hook
    "ckpt": 0.2,            # ("ckpt", outs, False, block): checkpoint(use_reentrant=False)
    "ckpt_reentrant": 0.1,  # ("ckpt", outs, True, block): checkpoint(use_reentrant=True)
    "compile": 0.05,        # ("op", out, "compiled", ins, {"fn"}) on a callee (costs compiles)
    "autocast": 0.15,       # ("op", out, "ac_matmul"|"ac_linear", ins, {}) on a callee
    "inplace": 0.25,        # ("inplace", reg, mul_|add_, [z], attrs) on a fresh result or a clone
}
COMPANY = dict(FEATURE_WEIGHTS)   # issue 18's features alone (the fixed seeds chosen for them)
FEATURE_WEIGHTS.update({          # issue 26: threads (tests/random_threads.py)
    "plain_thread": 0.25,   # prog["plain"]: plain backward() on another thread during the passes
    "two_passes": 0.2,      # prog["twice"]: two forwards, then both backward passes at once
    "keep_grad": 0.25,      # ("keep", reg, {"op"}): a hook keeps a gradient, changed after the passes
    "rendezvous": 0.2,      # two rpc_asyncs whose bodies wait on each other (signal / wait_for)
})
FEATURE_WEIGHTS.update({          # issue 34 (tests/random_round2.py)
    "chain": 0.2,           # ("chain", outs, fa, fb, kind): a reply's callback waits for another reply
    "post_acc": 0.2,        # ("post_acc", leaf): a counting post-accumulate-grad hook
    "watch": 0.3,           # prog["watch"]: every leaf's .grad watched during the passes
    "keep_between": 0.4,    # prog["keep_between"]: get_gradients' tensors kept between two passes
    "sparse": 0.2,          # ("op", out, "embed", [leaf], {"idx"}): sparse gradients
})
FEATURE_WEIGHTS.update({          # nn.Parameters over RPC (tests/random_params.py)
    "param": 0.25,          # bare / viewed / _is_param / builtin-argument Parameters sent
})
FEATURE_GROUPS = {"hooks": ("hook", "nodehook", "module"), "checkpoint": ("ckpt", "ckpt_reentrant"),
                  "threads": rt_threads.THREAD_FEATURES, "round2": rt_round2.ROUND2_FEATURES + ("sparse",),
                  "params": rt_params.PARAM_FEATURES,
                  "all": tuple(FEATURE_WEIGHTS), "none": ()}
# issue 43 (tests/random_round3.py): off by default, and in no group but their own;
# their programs are compared with torch's distributed autograd, not with local autograd
FEATURE_WEIGHTS.update(dict.fromkeys(rt_round3.ROUND3_FEATURES, 0.0))
FEATURE_GROUPS["round3"] = rt_round3.ROUND3_FEATURES
NOT_TWICE_DIFFERENTIABLE = ("compile", "ckpt_reentrant", "sparse")
STEP_WEIGHTS = {"hook": 0.7, "nodehook": 0.5, "module": 0.5, "ckpt": 0.4, "ckpt_reentrant": 0.3,
                "compile": 0.5, "autocast": 0.5, "inplace": 0.5, "keep_grad": 0.5, "rendezvous": 0.5,
                "plain_thread": 0.6, "chain": 0.5, "post_acc": 0.4, "sparse": 0.5, "param": 1.2,
                **rt_round3.STEP_WEIGHTS}
# ops whose backward does not save their output: a fresh result may be modified in place
INPLACE_SAFE = {"scale", "add", "sub", "mul", "div", "square", "sin", "sum", "mean", "index",
                "index_select", "cat", "stack", "matmul", "first_only", "count", "dot", "clone"}


def parse_features(spec) -> dict:
    """``--features``: comma-separated feature or group names (FEATURE_WEIGHTS,
    FEATURE_GROUPS), each ``name`` (in every program) or ``name=p``; the others are off;
    ``default`` starts from FEATURE_WEIGHTS. None: FEATURE_WEIGHTS."""
    if spec is None:
        return dict(FEATURE_WEIGHTS)
    out = {f: 0.0 for f in FEATURE_WEIGHTS}
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        name, _, p = tok.partition("=")
        if name == "default":
            out.update(FEATURE_WEIGHTS)
            continue
        for n in FEATURE_GROUPS.get(name, (name,)):
            if n not in FEATURE_WEIGHTS:
                known = ", ".join([*FEATURE_WEIGHTS, *FEATURE_GROUPS])
                raise ValueError(f"unknown feature {n!r} (known: {known})")
            out[n] = float(p) if p else 1.0
    return out


def weights_for(cfg: dict) -> dict:
    """The feature weights a run uses: ``cfg["features"]`` or FEATURE_WEIGHTS, less
    what a second-order run cannot differentiate twice, and less the threads in
    second-order and anomaly runs (their oracles know one first-order pass)."""
    w = dict(FEATURE_WEIGHTS if cfg.get("features") is None else cfg["features"])
    if cfg.get("order", 1) == 2:
        w.update(dict.fromkeys(NOT_TWICE_DIFFERENTIABLE, 0.0))
    if cfg.get("order", 1) == 2 or cfg.get("anomaly"):
        w.update(dict.fromkeys(rt_threads.THREAD_FEATURES + rt_round2.ROUND2_FEATURES
                               + rt_round3.ROUND3_FEATURES, 0.0))
    return w


class _BlockGen:
    """A block being generated: its worker, visible registers and body."""

    def __init__(self, worker, params, depth, seq, caller):
        self.worker, self.depth, self.seq, self.caller = worker, depth, seq, caller
        self.params = list(params)
        self.env = list(dict.fromkeys(params))
        self.body: list = []
        self.pending: list = []       # futures of rpc_async calls not waited yet
        self.sent: list = []          # registers already passed to some call
        self.own: list = []           # results of this block's ops (hook / in-place targets)
        self.leaves: list = []        # grad-requiring leaves this block fetched


class Generator:
    """Builds a random, valid-by-construction program for ``seed`` on ``world`` workers.

    Every register's kind and shape are tracked, so each op is drawn among the operands
    that fit it (or gets a fresh leaf of a fitting shape). Bodies that run concurrently
    with their caller (rpc_async waited later, remote) never touch the stash, so the
    program's meaning does not depend on timing.
    """

    def __init__(self, seed: int, world: int, weights=None) -> None:
        self.rnd = random.Random(seed)
        self.seed, self.world = seed, world
        weights = FEATURE_WEIGHTS if weights is None else weights
        draw = random.Random(f"features{seed}")       # its own stream: see FEATURE_WEIGHTS
        self.on = {f for f in FEATURE_WEIGHTS if draw.random() < weights.get(f, 0.0)}
        self.modules = {w: [] for w in range(world)}   # worker -> [(name, attrs)] reusable
        self.compiled = False                          # a torch.compile op was drawn
        self.meta: dict = {}                  # reg -> ("t", shape, rg) | ("rref"/"fut", rets)
        self.n = 0
        self.stashes = {w: [] for w in range(world)}   # worker -> [(name, shape, rg)]
        self.params = {w: [] for w in range(world)}    # worker -> [(name, shape)] reusable
        self.grad_leaves = {w: [] for w in range(world)}   # worker -> leaf names (plain threads)
        self.leaf_names: dict = {}                     # leaf register -> its name
        self.kept_leaves: set = set()                  # leaves a "keep" hook is on
        self.plain_hooks: dict = {}                    # worker -> leaves with a plain_hook
        self.bare: set = set()                         # registers holding an exact nn.Parameter
        # registers holding a received tensor that is an op result of this block (a
        # builtin over RPC): its grad_fn is a recv function, not the op's node
        self.received: set = set()
        self.sites = 0                                 # call blocks given a "site" (param)

    # -- registers ---------------------------------------------------------------------
    def new(self, kind: str, *info) -> int:
        r = self.n
        self.n += 1
        self.meta[r] = (kind, *info)
        return r

    def tensor(self, shape: tuple, rg: bool) -> int:
        return self.new("t", tuple(shape), bool(rg))

    def shape(self, r: int) -> tuple:
        return self.meta[r][1]

    def rg(self, r: int) -> bool:
        return self.meta[r][2]

    def tensors(self, b: _BlockGen, pred=None) -> list:
        return [r for r in b.env if self.meta[r][0] == "t" and (pred is None or pred(self.shape(r)))]

    def pick(self, b: _BlockGen, pred=None):
        """A tensor of the block, mostly a recent one (chains), else any (reuse)."""
        ts = self.tensors(b, pred)
        if not ts:
            return None
        return self.rnd.choice(ts[-4:] if self.rnd.random() < 0.6 else ts)

    def emit(self, b: _BlockGen, ins: tuple, *outs: int) -> None:
        b.body.append(ins)
        b.env.extend(outs)

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"s{self.seed}.{prefix}{self.n}"

    # -- shapes ------------------------------------------------------------------------
    def rand_shape(self) -> tuple:
        """0 to 3 dims of size 1 to 4 (size 1 often, for broadcasting)."""
        nd = self.rnd.choices([0, 1, 2, 3], [0.15, 0.35, 0.35, 0.15])[0]
        return tuple(self.rnd.choices([1, 2, 3, 4], [0.25, 0.3, 0.25, 0.2])[0] for _ in range(nd))

    def partner_shape(self, s: tuple) -> tuple:
        """A shape that broadcasts with ``s``, often a different one."""
        kind = self.rnd.choice(["same", "ones", "drop", "grow", "scalar"])
        if kind == "scalar":
            return ()
        if kind == "ones" and s:
            return tuple(1 if self.rnd.random() < 0.5 else d for d in s)
        if kind == "drop" and s:
            k = self.rnd.randrange(len(s))
            return tuple(1 if self.rnd.random() < 0.3 else d for d in s[k:])
        if kind == "grow":
            t = tuple(self.rnd.randint(2, 3) if d == 1 and self.rnd.random() < 0.6 else d for d in s)
            if len(t) < MAX_NDIM and self.rnd.random() < 0.5:
                t = (self.rnd.randint(1, 3),) + t
            return t
        return s

    # -- instructions ------------------------------------------------------------------
    def g_leaf(self, b: _BlockGen, shape=None, kind=None) -> int:
        """A new grad-requiring leaf, a (reused) parameter of this worker, or a constant."""
        kind = kind or self.rnd.choices(["leaf", "param", "const"], [0.45, 0.3, 0.25])[0]
        free = shape is None
        shape = self.rand_shape() if free else tuple(shape)
        if kind == "param":
            same = [(n, s) for n, s in self.params[b.worker] if s == shape or free]
            if same and self.rnd.random() < 0.6:
                name, shape = self.rnd.choice(same)
            else:
                name = self.name(f"w{b.worker}.param")
                self.params[b.worker].append((name, shape))
        else:
            name = self.name(f"w{b.worker}.{kind}")
        out = self.tensor(shape, kind != "const")
        self.emit(b, ("leaf", out, name, shape, kind != "const"), out)
        if kind != "const":
            b.leaves.append(out)
            self.leaf_names[out] = name
            self.grad_leaves[b.worker].append(name)
        return out

    def op(self, b: _BlockGen, name: str, ins: list, attrs: dict, shape: tuple, rg=None) -> int:
        rg = any(self.rg(r) for r in ins) if rg is None else rg
        out = self.tensor(shape, rg)
        self.emit(b, ("op", out, name, list(ins), attrs), out)
        b.own.append(out)
        return out

    def g_unary(self, b):
        """sin / tanh / sigmoid / square / scale."""
        x = self.pick(b)
        name = self.rnd.choice(["sin", "tanh", "sigmoid", "square", "scale"])
        attrs = {"c": self.rnd.choice([-1.5, 0.5, 3.0])} if name == "scale" else {}
        self.op(b, name, [x], attrs, self.shape(x))

    def g_binary(self, b):
        """add / sub / mul / div with a broadcast-compatible partner (often another shape)."""
        x = self.pick(b)
        sx = self.shape(x)
        fits = [r for r in self.tensors(b) if broadcast_shape(sx, self.shape(r)) is not None
                and len(broadcast_shape(sx, self.shape(r))) <= MAX_NDIM]
        if fits and self.rnd.random() < 0.65:
            y = self.rnd.choice(fits)
        else:
            y = self.g_leaf(b, self.partner_shape(sx))
        if self.rnd.random() < 0.5:
            x, y = y, x
        name = self.rnd.choice(["add", "sub", "mul", "mul", "div"])
        self.op(b, name, [x, y], {}, broadcast_shape(self.shape(x), self.shape(y)))

    def g_reduce(self, b):
        """sum / mean over everything or over some dims, keepdim or not."""
        x = self.pick(b)
        s = self.shape(x)
        name = self.rnd.choice(["sum", "mean"])
        if not s or self.rnd.random() < 0.3:
            dims, keepdim = None, False
        else:
            dims = sorted(self.rnd.sample(range(len(s)), self.rnd.randint(1, len(s))))
            keepdim = self.rnd.random() < 0.5
        self.op(b, name, [x], {"dims": dims, "keepdim": keepdim}, reduce_shape(s, dims, keepdim))

    def g_view(self, b):
        """One view or indexing op that fits the operand's shape."""
        x = self.pick(b)
        s = self.shape(x)
        nd = len(s)
        options = ["expand"]
        if nd >= 1:
            options += ["narrow", "index", "index_select", "select"]
        if nd >= 2:
            options += ["transpose", "reshape"]
        if nd == 3:
            options.append("permute")
        if nd < MAX_NDIM:
            options.append("unsqueeze")
        if 1 in s:
            options.append("squeeze")
        name = self.rnd.choice(options)
        r = self.rnd
        if name == "narrow":
            d = r.randrange(nd)
            length = r.randint(1, s[d])
            start = r.randint(0, s[d] - length)
            self.op(b, name, [x], {"dim": d, "start": start, "length": length},
                    s[:d] + (length,) + s[d + 1:])
        elif name in ("index", "index_select"):
            d = 0 if name == "index" else r.randrange(nd)
            idx = [r.randrange(s[d]) for _ in range(r.randint(1, 4))]
            if len(idx) > 1 and r.random() < 0.6:
                idx[-1] = idx[0]          # a repeated index: its gradients must add up
            self.op(b, name, [x], {"dim": d, "idx": idx}, s[:d] + (len(idx),) + s[d + 1:])
        elif name == "select":
            d = r.randrange(nd)
            self.op(b, name, [x], {"dim": d, "i": r.randrange(s[d])}, s[:d] + s[d + 1:])
        elif name == "transpose":
            d0, d1 = r.sample(range(nd), 2)
            t = list(s)
            t[d0], t[d1] = t[d1], t[d0]
            self.op(b, name, [x], {"d0": d0, "d1": d1}, tuple(t))
        elif name == "permute":
            perm = r.sample(range(3), 3)
            self.op(b, name, [x], {"perm": perm}, tuple(s[p] for p in perm))
        elif name == "reshape":
            numel = 1
            for d in s:
                numel *= d
            opts = [(a, numel // a) for a in range(1, numel + 1)
                    if numel % a == 0 and a <= MAX_DIM and numel // a <= MAX_DIM]
            opts += [(numel,)] * (numel <= 16) + [(s[0] * s[1],) + s[2:]] * (nd == 3 and s[0] * s[1] <= 8)
            if not opts:
                return self.g_unary(b)
            shape = r.choice(opts)
            self.op(b, name, [x], {"shape": list(shape)}, tuple(shape))
        elif name == "unsqueeze":
            d = r.randint(0, nd)
            self.op(b, name, [x], {"dim": d}, s[:d] + (1,) + s[d:])
        elif name == "squeeze":
            d = r.choice([i for i, v in enumerate(s) if v == 1])
            self.op(b, name, [x], {"dim": d}, s[:d] + s[d + 1:])
        else:  # expand: size-1 dims grow, maybe a new leading dim (gradients reduce back)
            t = tuple(r.randint(2, 4) if d == 1 and r.random() < 0.7 else d for d in s)
            if nd < MAX_NDIM and (r.random() < 0.5 or t == s):
                t = (r.randint(2, 3),) + t
            self.op(b, name, [x], {"shape": list(t)}, t)

    def g_multi(self, b):
        """split / chunk / unbind: several outputs, often not all used."""
        x = self.pick(b, lambda s: len(s) >= 1)
        if x is None:
            return self.g_view(b)
        s, r = self.shape(x), self.rnd
        d = r.randrange(len(s))
        name = r.choice(["split", "chunk", "unbind"])
        if name == "split":
            size = r.randint(1, max(1, s[d] - 1))
            attrs, sizes = {"size": size, "dim": d}, [min(size, s[d] - i) for i in range(0, s[d], size)]
        elif name == "chunk":
            n = r.randint(1, 3)
            c = -(-s[d] // n)
            attrs, sizes = {"n": n, "dim": d}, [min(c, s[d] - i) for i in range(0, s[d], c)]
        else:
            attrs, sizes = {"dim": d}, [None] * s[d]
        outs = [self.tensor(s[:d] + ((k,) if k is not None else ()) + s[d + 1:], self.rg(x)) for k in sizes]
        self.emit(b, ("multi", outs, name, x, attrs), *outs)
        b.own.extend(outs)

    def g_catstack(self, b):
        """cat along a dim (partners of matching shape, or new leaves) or stack."""
        r = self.rnd
        if r.random() < 0.5:
            x = self.pick(b, lambda s: len(s) >= 1)
            if x is None:
                return self.g_unary(b)
            s = self.shape(x)
            d = r.randrange(len(s))
            parts, total = [x], s[d]
            for _ in range(r.randint(1, 2)):
                fits = [t for t in self.tensors(b) if len(self.shape(t)) == len(s)
                        and all(a == c for i, (a, c) in enumerate(zip(self.shape(t), s)) if i != d)
                        and total + self.shape(t)[d] <= MAX_DIM + 2]
                if fits and r.random() < 0.7:
                    y = r.choice(fits)
                elif total < MAX_DIM:
                    y = self.g_leaf(b, s[:d] + (r.randint(1, 2),) + s[d + 1:])
                else:
                    break
                parts.append(y)
                total += self.shape(y)[d]
            r.shuffle(parts)
            self.op(b, "cat", parts, {"dim": d}, s[:d] + (total,) + s[d + 1:])
        else:
            x = self.pick(b, lambda s: len(s) < MAX_NDIM)
            if x is None:
                return self.g_unary(b)
            s = self.shape(x)
            same = [t for t in self.tensors(b) if self.shape(t) == s]
            parts = [x] + [r.choice(same) if r.random() < 0.7 else self.g_leaf(b, s)
                           for _ in range(r.randint(1, 2))]
            d = r.randint(0, len(s))
            self.op(b, "stack", parts, {"dim": d}, s[:d] + (len(parts),) + s[d:])

    def g_matmul(self, b):
        """matmul with an existing or new right operand (1-D, 2-D or batched)."""
        r = self.rnd
        x = self.pick(b, lambda s: len(s) >= 1)
        if x is None:
            return self.g_binary(b)
        sx = self.shape(x)
        fits = [t for t in self.tensors(b) if matmul_shape(sx, self.shape(t)) is not None]
        if fits and r.random() < 0.5:
            y = r.choice(fits)
        else:
            k = sx[-1]
            opts = [(k,), (k, r.randint(1, 4))]
            if len(sx) == 2:
                opts.append((r.choice([1, 2]), k, r.randint(1, 3)))
            y = self.g_leaf(b, r.choice(opts))
        self.op(b, "matmul", [x, y], {}, matmul_shape(sx, self.shape(y)))

    def g_first_only(self, b):
        """FirstOnly(x, y): y gets no gradient through it."""
        x, y = self.pick(b), self.pick(b)
        self.op(b, "first_only", [x, y], {}, self.shape(x))

    def g_detach(self, b):
        """A value without grad."""
        x = self.pick(b)
        self.op(b, "detach", [x], {}, self.shape(x), rg=False)

    def g_count(self, b):
        """A counting identity (its backward runs are compared with local autograd)."""
        x = self.pick(b)
        self.op(b, "count", [x], {"tag": f"n{self.n}"}, self.shape(x))

    def g_stash(self, b):
        """Keep a value on this worker for a later call."""
        x = self.pick(b)
        name = f"st{self.n}"
        self.n += 1
        self.emit(b, ("stash", name, x))
        self.stashes[b.worker].append((name, self.shape(x), self.rg(x)))

    def g_unstash(self, b):
        """Reuse a value an earlier call kept on this worker."""
        name, shape, rg = self.rnd.choice(self.stashes[b.worker])
        out = self.tensor(shape, rg)
        self.emit(b, ("unstash", out, name), out)

    def outs_for(self, rets: list) -> list:
        return [self.tensor(s, rg) for s, rg in rets]

    def g_to_here(self, b, rref=None):
        """Fetch an RRef's values here (on its owner, a third worker or the creator)."""
        if rref is None:
            rref = self.rnd.choice([r for r in b.env if self.meta[r][0] == "rref"])
        outs = self.outs_for(self.meta[rref][1])
        self.emit(b, ("to_here", outs, rref), *outs)

    def g_wait(self, b, fut=None):
        """Wait for an rpc_async issued earlier in this block."""
        fut = fut if fut is not None else self.rnd.choice(b.pending)
        b.pending.remove(fut)
        outs = self.outs_for(self.meta[fut][1])
        self.emit(b, ("wait", outs, fut), *outs)

    def g_call(self, b, target=None, mode=None, inject=None, extra_args=(), ret_param=False):
        """A call to any worker (a third one, the caller, itself) in one of five modes,
        with a body generated recursively (up to 3 deep); ``inject``: two instructions
        put into the body, in order (random_threads.g_rendezvous); ``extra_args``: also
        these arguments; ``ret_param``: the body returns a bare nn.Parameter too."""
        r = self.rnd
        if target is None:
            # anyone: another worker, the caller (a call back) or this worker itself
            target = r.choice(list(range(self.world)) + [b.caller] * (b.caller is not None))
        if mode is None:
            mode = r.choices(["sync", "async_now", "remote_here", "async", "remote"], [3, 1, 1, 1, 1.5])[0]
        avail = [x for x in b.env if self.meta[x][0] in ("t", "rref")]
        n_args = min(len(avail), r.choices([0, 1, 2, 3], [0.1, 0.4, 0.3, 0.2])[0])
        args = r.sample(avail[-6:] if r.random() < 0.5 else avail, min(n_args, len(avail)))
        sent = [x for x in b.sent if x in avail and x not in args]
        if sent and r.random() < 0.4:            # the same value to a second worker
            args.append(r.choice(sent))
        args += [x for x in extra_args if x not in args]
        b.sent.extend(args)
        rrefs = [x for x in avail if self.meta[x][0] == "rref"]
        if rrefs and r.random() < 0.5:           # hand an RRef on (often to a third worker)
            args.append(r.choice(rrefs))
        seq = b.seq and mode in ("sync", "async_now", "remote_here")
        steps = r.randint(1, max(1, 6 - 2 * b.depth))
        child = self.gen_block(target, args, b.depth + 1, seq, b.worker, steps)
        used = rt_params.used_args(self, child, extra_args) if extra_args else []
        rets = self.pick_returns(child)
        rets += [y for y in used if y not in rets and r.random() < 0.8]
        if ret_param:
            x = rt_params.returned_param(self, child)
            if x not in rets:
                rets.insert(r.randint(0, len(rets)), x)
        if inject:
            rt_threads.inject(r, child.body, inject)
        block = {"worker": target, "params": child.params, "body": child.body, "returns": rets}
        if "param" in self.on:      # names the Parameters its params receive (random_params)
            block["site"] = f"b{self.sites}"
            self.sites += 1
        meta = [(self.shape(x), self.rg(x)) for x in rets]
        if mode in ("sync", "async_now", "remote_here"):
            outs = self.outs_for(meta)
            self.bare.update(o for o, x in zip(outs, rets) if x in self.bare)
            self.emit(b, ("call", outs, mode, block), *outs)
        elif mode == "async":
            fut = self.new("fut", meta)
            self.emit(b, ("async", fut, block))
            b.pending.append(fut)
        else:
            rref = self.new("rref", meta)
            self.emit(b, ("remote", rref, block), rref)

    def pick_returns(self, child: _BlockGen) -> list:
        """1-3 results, sometimes one detached or a constant (outputs without grad)."""
        r = self.rnd
        if not self.tensors(child):
            self.g_leaf(child)
        ts = self.tensors(child)
        rets = r.sample(ts[-4:] if r.random() < 0.6 else ts, min(len(ts), r.randint(1, 3)))
        if r.random() < 0.25:
            x = r.choice(ts)
            self.op(child, "detach", [x], {}, self.shape(x), rg=False)
            rets.insert(r.randint(0, len(rets)), child.env[-1])
        if r.random() < 0.1:
            rets.insert(r.randint(0, len(rets)), self.g_leaf(child, kind="const"))
        return rets

    def step(self, b: _BlockGen) -> None:
        """One random instruction among those that fit the block."""
        if not self.tensors(b):
            self.g_leaf(b)
            return
        kinds = {"leaf": 0.5, "unary": 1.0, "binary": 1.4, "reduce": 0.7, "view": 1.4, "multi": 0.6,
                 "catstack": 0.6, "matmul": 0.6, "first_only": 0.35, "detach": 0.2, "count": 0.5}
        if b.depth < 3:
            kinds["call"] = 1.8 if b.depth == 0 else 0.9
        if any(self.meta[r][0] == "rref" for r in b.env):
            kinds["to_here"] = 0.9
        if b.pending:
            kinds["wait"] = 0.7
        if b.seq:
            kinds["stash"] = 0.5
            if self.stashes[b.worker]:
                kinds["unstash"] = 1.0
        kinds.update((f, STEP_WEIGHTS[f]) for f in self.feature_kinds(b))
        kind = self.rnd.choices(list(kinds), list(kinds.values()))[0]
        getattr(self, "g_" + kind)(b)

    # -- what users combine (issue 18; drawn only for the features this program has) ----
    def own_rg(self, b: _BlockGen) -> list:
        """This block's op results that require grad (tensor / node hook targets)."""
        return [r for r in b.own if self.rg(r)]

    def feature_kinds(self, b: _BlockGen) -> list:
        """The feature instructions of self.on that fit block ``b`` now."""
        ok = {"hook": bool(self.own_rg(b)), "nodehook": bool(self.own_rg(b) or b.leaves),
              "module": bool(self.tensors(b, len)), "ckpt": True,
              "ckpt_reentrant": any(self.rg(t) for t in self.tensors(b)),
              "compile": b.depth >= 1, "autocast": b.depth >= 1 and bool(self.tensors(b, len)),
              "inplace": True, "keep_grad": bool(self.own_rg(b) or b.leaves), "rendezvous": b.depth < 2,
              "plain_thread": bool(b.leaves), "two_passes": False,
              "chain": b.depth < 2, "post_acc": bool(b.leaves), "watch": False, "keep_between": False,
              "sparse": True, "param": True, **rt_round3.fits(self, b)}
        return [f for f in FEATURE_WEIGHTS if f in self.on and ok[f]]

    def g_hook(self, b):
        """A tensor hook on an intermediate (often one already sent to another worker):
        scale, a fixed 0/1 mask, or masked_fill."""
        r = self.rnd
        cands = self.own_rg(b)
        sent = [x for x in cands if x in b.sent]
        x = r.choice(sent if sent and r.random() < 0.4 else cands[-4:] if r.random() < 0.6 else cands)
        kind = r.choice(["scale", "scale", "mask", "masked_fill"])
        if kind == "scale":
            attrs = {"c": r.choice([0.5, -2.0, 3.0])}
        else:
            attrs = {"mask": self.name("mask")}
            if kind == "masked_fill":
                attrs["value"] = r.choice([0.0, 0.0, 0.25])
        self.emit(b, ("hook", x, kind, attrs))

    def g_nodehook(self, b):
        """A pre- or post-hook on an intermediate's grad_fn, or a pre-hook on a leaf's
        AccumulateGrad node, scaling the gradients."""
        r = self.rnd
        x = r.choice(self.own_rg(b) + b.leaves)
        kind = "acc" if x in b.leaves else r.choice(["pre", "post"])
        if kind == "post" and x in self.received:
            # a post-hook on a recv function scales its grad_inputs, and torch's
            # RecvRpcBackward has none (its gradients go over the wire): the hook changes
            # nothing there, where on the local op's node it would scale the op's inputs'
            # gradients; a pre-hook means the same in both
            kind = "pre"
        self.emit(b, ("nodehook", x, kind, {"c": r.choice([0.5, 2.0, -1.5])}))

    def g_module(self, b):
        """A (maybe reused) Linear of this worker with full backward hooks."""
        r = self.rnd
        x = self.pick(b, len)
        s = self.shape(x)
        same = [(n, a) for n, a in self.modules[b.worker] if a["in"] == s[-1]]
        if same and r.random() < 0.5:
            name, attrs = r.choice(same)
        else:
            attrs = {"in": s[-1], "out": r.randint(1, 4), "hook": r.choice(["full", "pre", "both"]),
                     "c": r.choice([0.5, 2.0, -1.0])}
            name = self.name(f"w{b.worker}.lin")
            self.modules[b.worker].append((name, attrs))
        out = self.tensor(s[:-1] + (attrs["out"],), True)
        self.emit(b, ("module", out, name, x, attrs), out)
        b.own.append(out)

    def g_ckpt(self, b, reentrant=False):
        """A few local ops under torch.utils.checkpoint (reentrant: at least one input and
        one result require grad, as torch needs)."""
        r = self.rnd
        ts = self.tensors(b)
        ins = r.sample(ts[-4:] if r.random() < 0.6 else ts, min(len(ts), r.randint(1, 2)))
        if reentrant and not any(self.rg(x) for x in ins):
            ins.append(r.choice([t for t in ts if self.rg(t)]))
        child = _BlockGen(b.worker, ins, b.depth, False, b.caller)
        kinds = {"unary": 1.0, "binary": 1.2, "reduce": 0.5, "view": 0.5, "matmul": 0.5, "count": 0.4}
        for _ in range(r.randint(1, 4)):
            getattr(self, "g_" + r.choices(list(kinds), list(kinds.values()))[0])(child)
        own = child.own
        rets = r.sample(own[-3:], min(len(own[-3:]), r.randint(1, 2)))
        if reentrant and not any(self.rg(x) for x in rets):
            x = next(t for t in ins if self.rg(t))
            rets.append(self.op(child, "sin", [x], {}, self.shape(x)))
        outs = [self.tensor(self.shape(x), reentrant or self.rg(x)) for x in rets]
        block = {"worker": b.worker, "params": ins, "body": child.body, "returns": rets}
        self.emit(b, ("ckpt", outs, reentrant, block), *outs)
        b.own.extend(outs)

    def g_ckpt_reentrant(self, b):
        self.g_ckpt(b, reentrant=True)

    def g_keep_grad(self, b):
        rt_threads.g_keep(self, b)

    def g_rendezvous(self, b):
        rt_threads.g_rendezvous(self, b)

    def g_plain_thread(self, b):
        rt_threads.g_plain_hook(self, b)

    def g_chain(self, b):
        rt_round2.g_chain(self, b)

    def g_post_acc(self, b):
        rt_round2.g_post_acc(self, b)

    def g_sparse(self, b):
        rt_round2.g_sparse(self, b)

    def g_param(self, b):
        rt_params.g_param(self, b)

    def g_multi_grad(self, b):
        rt_round3.g_multi_grad(self, b)

    def g_queue_callback(self, b):
        rt_round3.g_queue_callback(self, b)

    def g_ctx_hook(self, b):
        rt_round3.g_ctx_hook(self, b)

    def g_ckpt_shared(self, b):
        rt_round3.g_ckpt_shared(self, b)

    def g_grad_dtype(self, b):
        rt_round3.g_grad_dtype(self, b)

    def g_leaf_thread(self, b):
        rt_round3.g_leaf_thread(self, b)

    def g_anomaly_nan(self, b):
        rt_round3.g_anomaly_nan(self, b)

    def g_slow_hook(self, b):
        rt_round3.g_slow_hook(self, b)

    def g_compile(self, b):
        """A small function under torch.compile(backend="aot_eager")."""
        r = self.rnd
        fn = r.choice(sorted(COMPILE_FNS))
        x = self.pick(b)
        ins = [x]
        if fn == "tanh_mix":
            same = [t for t in self.tensors(b) if self.shape(t) == self.shape(x)]
            ins.append(r.choice(same) if r.random() < 0.5 else self.g_leaf(b, self.shape(x)))
        self.op(b, "compiled", ins, {"fn": fn}, self.shape(x))
        self.compiled = True

    def g_autocast(self, b):
        """matmul or linear in bfloat16 under autocast, the result cast back to float64."""
        r = self.rnd
        x = self.pick(b, len)
        s, m = self.shape(x), r.randint(1, 4)
        if r.random() < 0.5:
            w = self.g_leaf(b, (s[-1], m))
            self.op(b, "ac_matmul", [x, w], {}, matmul_shape(s, (s[-1], m)))
        else:
            ins = [x, self.g_leaf(b, (m, s[-1]))]
            if r.random() < 0.7:
                ins.append(self.g_leaf(b, (m,)))          # the bias
            self.op(b, "ac_linear", ins, {}, s[:-1] + (m,))

    def g_inplace(self, b):
        """x.mul_(c) or x.add_(z) on the result of the op just emitted when its backward
        does not need it (nothing used it yet), else on a fresh clone."""
        r = self.rnd
        last = b.body[-1] if b.body else None
        if last is not None and last[0] == "op" and last[2] in INPLACE_SAFE and r.random() < 0.65:
            x = last[1]
        else:
            src = self.pick(b)
            x = self.op(b, "clone", [src], {}, self.shape(src))
        s = self.shape(x)
        fits = [z for z in self.tensors(b) if z != x and broadcast_shape(s, self.shape(z)) == s]
        if fits and r.random() < 0.5:
            z = r.choice(fits)
            self.emit(b, ("inplace", x, "add_", [z], {}))
            self.meta[x] = ("t", s, self.rg(x) or self.rg(z))
        else:
            self.emit(b, ("inplace", x, "mul_", [], {"c": r.choice([2.0, -0.5, 3.0])}))

    def gen_block(self, worker, params, depth, seq, caller, steps) -> _BlockGen:
        """A block of ``steps`` instructions on ``worker``; waits its rpc_asyncs at the end."""
        b = _BlockGen(worker, params, depth, seq, caller)
        if any(self.meta[p][0] == "rref" for p in params) and self.rnd.random() < 0.7:
            self.g_to_here(b)   # an RRef handed to this worker is mostly fetched here
        for _ in range(steps):
            self.step(b)
        for fut in list(b.pending):  # nothing may still run when the block returns
            self.g_wait(b, fut)
        return b

    def program(self) -> dict:
        """The whole program: a few leaves on worker0, steps (one a call to another
        worker), then the roots."""
        r = self.rnd
        steps = r.choice([2, 3, 4, 6, 8, 10, 12])
        main = _BlockGen(0, [], 0, True, None)
        for _ in range(r.randint(1, 3)):
            self.g_leaf(main, kind=r.choice(["leaf", "param"]))
        forced = r.randrange(steps)   # every program crosses workers at least once
        for i in range(steps):
            if i == forced:
                self.g_call(main, target=r.randrange(1, self.world))
            else:
                self.step(main)
        for fut in list(main.pending):
            self.g_wait(main, fut)
        roots = self.gen_roots(main)
        # torch refuses retain_graph=True through a compiled backward with donated buffers
        retain = r.random() < 0.3 and not self.compiled
        return {"seed": self.seed, "world": self.world, "retain": retain, "roots": roots,
                "main": {"worker": 0, "params": [], "body": main.body, "returns": roots},
                **rt_threads.program_extras(self), **rt_round2.program_extras(self)}

    def gen_roots(self, b: _BlockGen) -> list:
        """1-3 scalar roots, each a weighted sum over results (call results preferred);
        a later root may include an earlier one (roots sharing graph)."""
        r = self.rnd
        produced = {o for ins in b.body if ins[0] in ("call", "wait", "to_here") for o in ins[1]}
        cands = [x for x in self.tensors(b) if self.rg(x)]
        if not cands:
            cands = [self.g_leaf(b, kind="leaf")]
        roots: list = []
        for _ in range(r.choices([1, 2, 3], [0.55, 0.3, 0.15])[0]):
            favoured = [x for x in cands if x in produced] or cands
            picks = {r.choice(favoured)} | {r.choice(cands) for _ in range(r.randint(0, 2))}
            acc = None
            for x in sorted(picks):
                term = self.op(b, "dot", [x], {"w": self.name("weight")}, ())
                acc = term if acc is None else self.op(b, "add", [acc, term], {}, ())
            if roots and r.random() < 0.25:
                acc = self.op(b, "add", [acc, r.choice(roots)], {}, ())
            roots.append(acc)
        return roots


def generate(seed: int, world: int, weights=None) -> dict:
    """The program for ``seed`` on ``world`` workers (deterministic; ``weights``: the
    features' probabilities, FEATURE_WEIGHTS when None; with a feature of issue 43 on,
    random_round3's generator)."""
    if round3(weights):
        return rt_round3.generate(seed, world, weights)
    return Generator(seed, world, weights).program()


def round3(weights) -> bool:
    """Whether ``weights`` draw a feature of issue 43 (tests/random_round3.py)."""
    w = FEATURE_WEIGHTS if weights is None else weights
    return any(w.get(f, 0.0) > 0 for f in rt_round3.ROUND3_FEATURES)


# ---------------------------------------------------------------------------------------
# program walking: dump, size, features
# ---------------------------------------------------------------------------------------
def _sub_block(ins):
    """The block a call / async / remote / ckpt instruction runs, else None."""
    if ins[0] in ("call", "async", "remote", "ckpt"):
        return ins[3] if ins[0] in ("call", "ckpt") else ins[2]
    return None


def walk(block: dict, depth: int = 0, caller=None):
    """Yield (block, instruction, depth, caller worker) for every instruction, in order."""
    for ins in block["body"]:
        yield block, ins, depth, caller
        sub = _sub_block(ins)
        if sub is not None:
            yield from walk(sub, depth + 1, block["worker"])


def size(prog: dict) -> int:
    """Instructions in the program, nested blocks included."""
    return sum(1 for _ in walk(prog["main"]))


def _r(x) -> str:
    """Register(s) as text: r3 or r3, r4."""
    return ", ".join(f"r{v}" for v in x) if isinstance(x, (list, tuple)) else f"r{x}"


def dump(prog: dict) -> str:
    """A readable listing of the program."""
    lines = [f"program seed={prog['seed']} world={prog['world']} roots=[{_r(prog['roots'])}]"
             f"{' backward twice (retain_graph=True)' if prog['retain'] else ''}"
             f"{'; forward twice, both backward passes at once' if prog.get('twice') else ''}"
             f"{'; every .grad watched' if prog.get('watch') else ''}"
             f"{'; get_gradients kept between the passes' if prog.get('keep_between') else ''}"
             f"{rt_round3.header(prog)}"]
    for spec in prog.get("plain", []):
        lines.append(f"  during the passes, on worker{spec['worker']}: loop plain backward() of "
                     f"sum(tanh(leaf) . {spec['w']}) over {spec['leaves']}")

    def block_lines(block, indent):
        pad = "  " * indent
        params = f"({_r(block['params'])})" if block["params"] else "()"
        lines.append(f"{pad}on worker{block['worker']} {params}:")
        pad += "  "
        for ins in block["body"]:
            op = ins[0]
            if op == "leaf":
                _, out, name, shape, rg = ins
                kind = name.split(".")[-1].rstrip("0123456789")
                lines.append(f"{pad}r{out} = {kind} {name.split('.', 1)[1]} {tuple(shape)}"
                             f"{' requires_grad' if rg else ''}")
            elif op == "op":
                _, out, name, ins_, attrs = ins
                a = ", ".join(f"{k}={v}" for k, v in attrs.items())
                lines.append(f"{pad}r{out} = {name}({_r(ins_)}{', ' + a if a else ''})")
            elif op == "multi":
                _, outs, name, x, attrs = ins
                a = ", ".join(f"{k}={v}" for k, v in attrs.items())
                lines.append(f"{pad}{_r(outs)} = {name}(r{x}, {a})")
            elif op in ("call", "async", "remote"):
                sub = _sub_block(ins)
                what = {"sync": "rpc_sync", "async_now": "rpc_async().wait()",
                        "remote_here": "remote().to_here()"}
                if op == "call":
                    head = f"{_r(ins[1]) or '_'} = {what[ins[2]]}"
                else:
                    head = f"r{ins[1]} = {'rpc_async' if op == 'async' else 'remote'}"
                lines.append(f"{pad}{head} worker{sub['worker']}:")
                block_lines(sub, indent + 2)
                lines.append(f"{pad}    return {_r(sub['returns'])}")
            elif op == "wait":
                lines.append(f"{pad}{_r(ins[1])} = r{ins[2]}.wait()")
            elif op == "to_here":
                lines.append(f"{pad}{_r(ins[1])} = r{ins[2]}.to_here()")
            elif op in ("pleaf", "builtin"):
                lines.append(pad + rt_params.dump_line(ins))
            elif op == "stash":
                lines.append(f"{pad}STASH[{ins[1]!r}] = r{ins[2]}")
            elif op == "unstash":
                lines.append(f"{pad}r{ins[1]} = STASH[{ins[2]!r}]")
            elif op == "ckpt":
                lines.append(f"{pad}{_r(ins[1])} = checkpoint(use_reentrant={ins[2]}):")
                block_lines(ins[3], indent + 2)
                lines.append(f"{pad}    return {_r(ins[3]['returns'])}")
            else:
                lines.append(pad + _feature_line(ins))

    block_lines(prog["main"], 1)
    return "\n".join(lines)


def _feature_line(ins) -> str:
    """dump()'s line for a hook, module or in-place instruction (issue 18)."""
    op = ins[0]
    if op == "hook":
        _, x, kind, a = ins
        what = f"g * {a['c']}" if kind == "scale" else f"g * mask {a['mask']}" if kind == "mask" \
            else f"g.masked_fill(mask {a['mask']}, {a['value']})"
        return f"r{x}.register_hook(lambda g: {what})"
    if op == "nodehook":
        _, x, kind, a = ins
        where = {"pre": "grad_fn.register_prehook", "post": "grad_fn.register_hook (grad_inputs)",
                 "acc": "AccumulateGrad.register_prehook"}[kind]
        return f"r{x}.{where}(scale {a['c']})"
    if op == "module":
        _, out, name, x, a = ins
        return (f"r{out} = Linear {name.split('.', 1)[1]}({a['in']}->{a['out']}, "
                f"full backward {a['hook']} hook x{a['c']})(r{x})")
    if op == "inplace":
        _, x, kind, zs, a = ins
        return f"r{x}.{kind}({_r(zs) if zs else a['c']})"
    if op in ("keep", "signal", "wait_for", "plain_hook"):
        return rt_threads.dump_line(ins)
    if op in ("chain", "post_acc"):
        return rt_round2.dump_line(ins)
    if op in rt_round3.OPS:
        return rt_round3.dump_line(ins)
    raise ValueError(f"unknown instruction {ins!r}")


FEATURES = [
    "broadcast, differing shapes", "0-dim tensor operand", "size-1 dim broadcast", "sum/mean all",
    "sum/mean over dims", "keepdim", "split", "chunk", "unbind", "narrow", "index (repeated)",
    "index_select", "select", "transpose/permute", "expand", "reshape/unsqueeze/squeeze", "cat",
    "stack", "matmul", "custom Function returning None", "detached value", "counting node",
    "rpc_sync", "rpc_async().wait()", "rpc_async waited later", "remote().to_here()",
    "RRef to_here on a third worker", "RRef to_here on its owner", "RRef handed on as argument",
    "RRef never fetched", "call back to the caller", "call to itself", "nesting 3 deep",
    "call result unused", "call output without grad", "value sent to 2 workers + used locally",
    "stash reused by a later call", "leaf/param on worker>0", "param reused across calls",
    "several roots", "root inside another root", "backward twice (retain_graph)",
    # issue 18: what users combine with autograd
    "tensor hook: scale", "tensor hook: mask", "tensor hook: masked_fill", "tensor hook in a call block",
    "tensor hook on a value sent to another worker", "tensor hook on a value with several uses",
    "grad_fn pre-hook", "grad_fn post-hook", "AccumulateGrad pre-hook", "module full backward hook",
    "module full backward pre-hook", "module reused", "checkpoint (use_reentrant=False)",
    "checkpoint (use_reentrant=True)", "torch.compile (aot_eager)", "autocast bf16 matmul/linear",
    "in-place on a fresh result", "in-place on a clone",
] + rt_threads.FEATURES + rt_round2.FEATURES + rt_params.FEATURES


def _company_features(block: dict, ins, depth: int, module_uses: collections.Counter) -> set:
    """features() for the instructions of issue 18 (hooks, modules, checkpoint, compile,
    autocast, in-place)."""
    f: set = set()
    op, body = ins[0], block["body"]
    if op == "hook":
        x = ins[1]
        f.add("tensor hook: " + ins[2])
        if depth >= 1:
            f.add("tensor hook in a call block")
        if any(_sub_block(i) is not None and i[0] != "ckpt" and x in _sub_block(i)["params"]
               and _sub_block(i)["worker"] != block["worker"] for i in body):
            f.add("tensor hook on a value sent to another worker")
        n = sum(_uses(i).count(x) for i in body
                if i[0] not in ("hook", "nodehook", "inplace", "keep", "plain_hook"))
        if n + block["returns"].count(x) >= 2:
            f.add("tensor hook on a value with several uses")
    elif op == "nodehook":
        f.add({"pre": "grad_fn pre-hook", "post": "grad_fn post-hook",
               "acc": "AccumulateGrad pre-hook"}[ins[2]])
    elif op == "module":
        module_uses[ins[2]] += 1
        if ins[4]["hook"] in ("full", "both"):
            f.add("module full backward hook")
        if ins[4]["hook"] in ("pre", "both"):
            f.add("module full backward pre-hook")
    elif op == "ckpt":
        f.add(f"checkpoint (use_reentrant={ins[2]})")
    elif op == "op" and ins[2] == "compiled":
        f.add("torch.compile (aot_eager)")
    elif op == "op" and ins[2] in ("ac_matmul", "ac_linear"):
        f.add("autocast bf16 matmul/linear")
    elif op == "inplace":
        clones = {i[1] for i in body if i[0] == "op" and i[2] == "clone"}
        f.add("in-place on a clone" if ins[1] in clones else "in-place on a fresh result")
    return f


def features(prog: dict) -> set:
    """Which of FEATURES the program exercises (static analysis)."""
    f: set = set()
    uses = collections.Counter()
    rt = LocalRuntime()
    with torch.no_grad():
        run_block(prog["main"], [], rt)
    shapes = rt.shapes
    param_uses = collections.Counter()
    module_uses: collections.Counter = collections.Counter()
    rref_home: dict = {}
    for block, ins, depth, caller in walk(prog["main"]):
        op, w = ins[0], block["worker"]
        f |= _company_features(block, ins, depth, module_uses)
        if op == "leaf":
            if ins[4] and w != 0:
                f.add("leaf/param on worker>0")
            if ".param" in ins[2]:
                param_uses[ins[2]] += 1
        elif op == "op":
            name, xs = ins[2], ins[3]
            uses.update(xs)
            if name in ("add", "sub", "mul", "div"):
                sa, sb = (shapes.get(x) for x in xs)
                if sa is not None and sb is not None and sa != sb:
                    f.add("broadcast, differing shapes")
                    if () in (sa, sb):
                        f.add("0-dim tensor operand")
                    if any(d == 1 for d in sa + sb):
                        f.add("size-1 dim broadcast")
            if name in ("sum", "mean"):
                f.add("sum/mean all" if ins[4]["dims"] is None else "sum/mean over dims")
                if ins[4]["keepdim"]:
                    f.add("keepdim")
            table = {"narrow": "narrow", "index_select": "index_select", "select": "select",
                     "transpose": "transpose/permute", "permute": "transpose/permute", "expand": "expand",
                     "reshape": "reshape/unsqueeze/squeeze", "unsqueeze": "reshape/unsqueeze/squeeze",
                     "squeeze": "reshape/unsqueeze/squeeze", "cat": "cat", "stack": "stack",
                     "matmul": "matmul", "first_only": "custom Function returning None",
                     "detach": "detached value", "count": "counting node"}
            if name in table:
                f.add(table[name])
            if name == "index" and len(set(ins[4]["idx"])) < len(ins[4]["idx"]):
                f.add("index (repeated)")
            if name == "add" and any(x in prog["roots"] for x in xs):
                f.add("root inside another root")
        elif op == "multi":
            uses[ins[3]] += 1
            f.add(ins[2])
        elif op in ("call", "async", "remote"):
            sub = _sub_block(ins)
            uses.update(sub["params"])
            mode = ins[2] if op == "call" else op
            f.add({"sync": "rpc_sync", "async_now": "rpc_async().wait()", "async": "rpc_async waited later",
                   "remote_here": "remote().to_here()", "remote": "remote().to_here()"}[mode])
            if sub["worker"] == w:
                f.add("call to itself")
            if caller is not None and sub["worker"] == caller and caller != w:
                f.add("call back to the caller")
            if depth >= 2:
                f.add("nesting 3 deep")
            if op == "remote":
                rref_home[ins[1]] = (w, sub["worker"])
            if any(p in rref_home for p in sub["params"]):
                f.add("RRef handed on as argument")
        elif op == "to_here":
            uses[ins[2]] += 1
            creator, owner = rref_home[ins[2]]
            f.add("RRef to_here on its owner" if owner == w else "RRef to_here on a third worker"
                  if creator != w else "remote().to_here()")
        elif op == "stash":
            uses[ins[2]] += 1
        elif op == "builtin":
            uses.update(ins[4])
        elif op == "unstash":
            f.add("stash reused by a later call")
        elif op in ("module", "ckpt"):
            uses.update(_uses(ins))
    # second pass: uses are known now
    for block, ins, _depth, _caller in walk(prog["main"]):
        op = ins[0]
        if op in ("call", "wait", "to_here"):
            if any(uses[o] == 0 and o not in prog["roots"] for o in ins[1]):
                f.add("call result unused")
        if op == "remote" and uses[ins[1]] == 0:
            f.add("RRef never fetched")
        sub = _sub_block(ins)
        if sub is not None:
            # a returned detached value or constant is an output without grad
            defs = {i[1]: i for i in sub["body"] if i[0] in ("op", "leaf")}
            for ret in sub["returns"]:
                d = defs.get(ret)
                if d is not None and ((d[0] == "op" and d[2] == "detach") or (d[0] == "leaf" and not d[4])):
                    f.add("call output without grad")
        if op in ("leaf", "op", "multi", "call", "wait", "to_here", "unstash"):
            for x in ([ins[1]] if isinstance(ins[1], int) else ins[1]):
                sent_to = {i[3 if i[0] == "call" else 2]["worker"] for i in block["body"]
                           if i[0] in ("call", "async", "remote")
                           and x in _sub_block(i)["params"]} - {block["worker"]}
                local = any(i[0] == "op" and x in i[3] for i in block["body"])
                if len(sent_to) >= 2 and local:
                    f.add("value sent to 2 workers + used locally")
    if any(n > 1 for n in param_uses.values()):
        f.add("param reused across calls")
    if any(n > 1 for n in module_uses.values()):
        f.add("module reused")
    instructions = [(b["worker"], ins) for b, ins, _, _ in walk(prog["main"])]
    f |= rt_threads.static_features(prog, instructions)
    f |= rt_round2.static_features(prog, instructions)
    f |= rt_params.static_features(prog, walk, _sub_block)
    f |= rt_round3.static_features(prog, instructions, rt_round3.shared_registers(prog))
    if len(prog["roots"]) > 1:
        f.add("several roots")
    if prog["retain"]:
        f.add("backward twice (retain_graph)")
    return f


# ---------------------------------------------------------------------------------------
# the oracle and the distributed run
# ---------------------------------------------------------------------------------------
class Hang(RuntimeError):
    """dist_autograd.backward did not return in time."""


def _square_sum(grads: list):
    """The second pass's root: the sum of squared first gradients (those with a graph);
    None when no gradient has one (the program is linear in every leaf)."""
    parts = [(g ** 2).sum() for g in grads if g is not None and g.requires_grad]
    return sum(parts[1:], parts[0]) if parts else None


def run_local(prog: dict) -> dict:
    """The oracle: the whole program in this process with plain torch autograd.
    ``prog["order"] == 2``: a first backward with ``create_graph=True``, then a second
    one over the sum of squared gradients (which accumulates, as ``.grad`` does).
    ``prog["twice"]``: two forwards, then each one's backward (``"second"``: the
    second's roots and gradients); ``prog["plain"]``: one plain backward()'s gradients
    per leaf (``"plain"``), taken after the forwards (tests/random_threads.py)."""
    rt = LocalRuntime()
    forwards = []
    for _ in range(2 if prog.get("twice") else 1):
        for st in rt.states.values():
            st.events.clear()
        forwards.append(list(run_block(prog["main"], [], rt)))
    plain = rt_threads.plain_reference(prog, rt) if prog.get("plain") else None

    def leaves():
        return [(w, name, t) for w, st in rt.states.items() for name, t in st.leaves.items()
                if t.requires_grad]
    passes = []
    for roots in forwards:
        if prog.get("order", 1) == 2:
            torch.autograd.backward(roots, create_graph=True)
            pen = _square_sum([t.grad for _, st in sorted(rt.states.items())
                               for _, t in sorted(st.leaves.items()) if t.requires_grad])
            if pen is not None:
                roots.append(pen)
                pen.backward()
        else:
            torch.autograd.backward(roots, retain_graph=prog["retain"])
            if prog["retain"]:
                torch.autograd.backward(roots)
        passes.append({"roots": [t.detach() for t in roots],
                       "grads": {(w, name): t.grad for w, name, t in leaves()}})
        for _, _, t in leaves():
            t.grad = None
    # the same computation as the distributed run's: after the passes, the gradients the
    # ("keep", ...) hooks kept change in place (random_threads.run_passes). A gradient
    # torch's AccumulateGrad took in without a copy (a view of a kept one: stack's,
    # a sparse embedding's values) changes with it, in local autograd as in torch's
    # distributed engine; the recorded .grad tensors are those very tensors.
    for st in rt.states.values():
        rt_threads.mutate_kept(st.kept)
    counts = collections.Counter()
    for st in rt.states.values():
        counts.update(st.counts)
    out = {"roots": passes[0]["roots"], "grads": passes[0]["grads"], "counts": dict(counts)}
    if len(passes) > 1:
        out["second"] = passes[1]
    if plain is not None:
        out["plain"] = plain
    return out


def _square_grads(cid: int):
    """This worker's part of the second pass's root (see :func:`_square_sum`)."""
    import distgrad.autograd as dist_autograd
    grads = dist_autograd.get_gradients(cid)
    names = {id(t): n for n, t in STATE.leaves.items()}
    return _square_sum([g for t, g in sorted(grads.items(), key=lambda kv: names.get(id(kv[0]), ""))])


def _backward(cid: int, roots: list, retain: bool, timeout: float, create_graph: bool = False) -> None:
    """dist_autograd.backward, in a helper thread so a hang is reported, not waited out."""
    import distgrad.autograd as dist_autograd
    box: dict = {}

    def run():
        try:
            if create_graph:
                dist_autograd.backward(cid, roots, create_graph=True)
            else:
                dist_autograd.backward(cid, roots, retain_graph=retain)
        except BaseException as e:  # handed to the caller's thread
            box["err"] = e
    t = threading.Thread(target=run, daemon=True, name="random-programs-backward")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Hang(f"dist_autograd.backward did not return within {timeout:g} s (hang)")
    if "err" in box:
        raise box["err"]


def _drain(world: int, timeout: float = 10.0) -> None:
    """Wait until every remote() body of the program has finished on its owner, so the
    backward never overlaps the forward (an unfetched RRef's body may still run)."""
    rpc = dist_modules()[0]
    deadline = time.monotonic() + timeout
    while True:
        bal = [rpc.rpc_sync(f"worker{w}", _remote_balance) for w in range(world)]
        if sum(i for i, _ in bal) == sum(d for _, d in bal):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"remote() bodies still running after {timeout} s: {bal}")
        time.sleep(0.005)


# -- NaN injection (--anomaly) ----------------------------------------------------------
def poisoned(prog: dict, rng: random.Random, tries: int = 6):
    """A copy of ``prog`` with a NaN-producing node after one random op whose backward
    runs (local anomaly mode names it), and that op's worker; (None, None) if none of
    ``tries`` candidates is reached by the backward."""
    import warnings
    ops = [(b["worker"], i, blk) for blk, ins, _, _ in walk(prog["main"]) for b in [blk]
           for i, x in enumerate(blk["body"]) if x is ins and x[0] == "op"]
    rng.shuffle(ops)
    for worker, i, blk in ops[:tries]:
        ins = blk["body"][i]
        blk["body"][i] = (*ins[:4], dict(ins[4], poison=True))
        cand = _copy(prog)
        blk["body"][i] = ins
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autograd.detect_anomaly(check_nan=True):
                    torch.autograd.backward(list(run_block(cand["main"], [], LocalRuntime())))
        except RuntimeError as e:
            # the poison identity changes no forward value: anomaly mode naming it is the
            # one error expected here (a backward that never reaches it raises nothing)
            if "Function 'PoisonBackward' returned nan values" not in str(e):
                raise
            return cand, worker
    return None, None


def check_anomaly(prog: dict, worker: int, backward_timeout: float = BACKWARD_TIMEOUT) -> dict:
    """Run poisoned ``prog`` on the cluster under ``dist_autograd.detect_anomaly()``: the
    error must name ``PoisonBackward`` on ``worker``, its chain must start there."""
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.errors import AnomalyError
    rec = {"seed": prog["seed"], "world": prog["world"], "size": size(prog), "ok": False,
           "poison_worker": worker}
    for w in range(prog["world"]):
        rpc.rpc_sync(f"worker{w}", _reset)
    err = None
    try:
        with dist_autograd.detect_anomaly(), dist_autograd.context() as cid:
            roots = list(run_block(prog["main"], [], DistRuntime()))
            _drain(prog["world"])
            _backward(cid, roots, False, backward_timeout)
    except AnomalyError as e:
        err = e
    except Hang as e:
        rec.update(group="hang: dist_autograd.backward never returned", detail=str(e), hang=True)
        return rec
    except Exception as e:  # noqa: BLE001
        rec.update(group="error: " + group_of(_error_text(e)), detail=traceback.format_exc()[-3000:])
        return rec
    want = f"worker{worker}"
    if err is None:
        rec.update(group="anomaly not reported", detail="backward returned without an AnomalyError")
    elif err.node_name != "PoisonBackward" or err.worker_name != want:
        rec.update(group="anomaly misplaced", detail=f"reported {err.node_name} on {err.worker_name}, "
                                                     f"want PoisonBackward on {want}: {err}")
    elif not err.chains or any(c[0] != want for c in err.chains) or "PoisonBackward" not in str(err):
        rec.update(group="anomaly chain", detail=str(err))
    else:
        rec["ok"] = True
        rec["chain"] = err.chains
    return rec


def _backward_all(cid: int, roots: list, prog: dict, backward_timeout: float) -> list:
    """The program's backward in context ``cid`` (retained and repeated, or second
    order: then the roots with the penalty appended)."""
    import distgrad.rpc as rpc
    world = prog["world"]
    if prog.get("order", 1) == 2:
        _backward(cid, roots, True, backward_timeout, create_graph=True)
        parts = [_square_grads(cid)] + [rpc.rpc_sync(f"worker{w}", _square_grads, args=(cid,))
                                        for w in range(1, world)]
        pen = _square_sum_parts(parts)
        if pen is not None:
            roots = roots + [pen]
            _backward(cid, [pen], False, backward_timeout)
    else:
        _backward(cid, roots, prog["retain"], backward_timeout)
        if prog["retain"]:
            keep = prog.get("keep_between")
            if keep:    # the tensors get_gradients gives now, on every worker
                for w in range(world):
                    rpc.rpc_sync(f"worker{w}", rt_round2.keep_now, args=(cid,))
            _backward(cid, roots, False, backward_timeout)
            if keep:    # ... are the context's, added into in place (torch's rule)
                for w in range(world):
                    rpc.rpc_sync(f"worker{w}", rt_round2.kept_check, args=(cid,))
    return roots


def _gather_grads(cid: int, world: int) -> tuple:
    """({(worker, leaf name): gradient}, [entries that are no leaf]) of context ``cid``."""
    rpc = dist_modules()[0]
    grads, unknown = {}, []
    for w in range(world):
        found, unk = rpc.rpc_sync(f"worker{w}", _collect_grads, args=(cid,))
        grads.update({(w, n): g for n, g in found.items()})
        unknown += [f"worker{w}: {u}" for u in unk]
    return grads, unknown


def run_distributed(prog: dict, backward_timeout: float) -> dict:
    """The program on the cluster (call on worker0, inside init_rpc; the passes, the
    plain threads, the kept gradients: random_threads.run_passes)."""
    return rt_threads.run_passes(prog, backward_timeout)


def _square_sum_parts(parts: list):
    parts = [p for p in parts if p is not None]
    return sum(parts[1:], parts[0]) if parts else None


def compare(want: dict, got: dict) -> list:
    """(kind, detail) for every disagreement between oracle and distributed run: the
    roots and gradients of each pass, the counting nodes' runs, and (where the run
    reports them) every leaf's ``.grad``."""
    issues = _compare_pass(want, got, "")
    if "second" in want or "second" in got:
        if "second" not in got or "second" not in want:
            issues.append(("second pass", f"{'no' if 'second' not in got else 'an unexpected'} second pass"))
        else:
            issues += _compare_pass(want["second"], got["second"], "second pass: ")
    for u in got.get("unknown", []):
        issues.append(("grad for a non-leaf", u))
    if want["counts"] != got["counts"]:
        diff = {t: (got["counts"].get(t, 0), want["counts"].get(t, 0))
                for t in set(want["counts"]) | set(got["counts"])
                if got["counts"].get(t, 0) != want["counts"].get(t, 0)}
        issues.append(("node run count", "ran (distributed, local): " + ", ".join(
            f"{t}: {a} vs {b}" for t, (a, b) in sorted(diff.items()))))
    if "dotgrad" in got:
        issues += rt_threads.compare_dotgrad(want, got)
    issues += [("torch's rule", u) for u in got.get("round2", [])]
    return issues


def _compare_pass(want: dict, got: dict, where: str) -> list:
    """compare()'s part for one pass: its roots and leaf gradients."""
    issues = []
    if len(want["roots"]) != len(got["roots"]):
        issues.append(("forward value", f"{where}{len(got['roots'])} roots, local autograd has "
                                        f"{len(want['roots'])}"))
    for i, (a, b) in enumerate(zip(want["roots"], got["roots"])):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            issues.append(("forward value", f"{where}root {i}: {b.tolist()} != {a.tolist()}"))
    for key in sorted(set(got["grads"]) - set(want["grads"])):   # a leaf local autograd lacks
        w, name = key                                             # (a Parameter received here)
        d = got["grads"][key]
        d = d.to_dense() if d.is_sparse else d
        issues.append(("unexpected grad", f"{where}leaf {name.split('.', 1)[1]} on worker{w}: got "
                                          f"{d.tolist()}, local autograd has no such leaf"))
    for key, g in sorted(want["grads"].items()):
        w, name = key
        label = f"{where}leaf {name.split('.', 1)[1]} on worker{w}"
        d = got["grads"].get(key)
        # a sparse gradient (embedding) is compared by value: local autograd sums every
        # use in one engine call, the context sums what each engine call gives
        g, d = (t.to_dense() if t is not None and t.is_sparse else t for t in (g, d))
        if g is None:
            if d is not None:
                issues.append(("unexpected grad", f"{label}: got {d.tolist()}, local autograd has none"))
        elif d is None:
            issues.append(("missing grad", f"{label}: no gradient, expected {tuple(g.shape)} {g.tolist()}"))
        elif d.shape != g.shape:
            issues.append(("grad shape", f"{label}: shape {tuple(d.shape)} != {tuple(g.shape)}"))
        elif d.dtype != g.dtype:
            issues.append(("grad dtype", f"{label}: dtype {d.dtype} != {g.dtype}"))
        elif not torch.allclose(d, g, rtol=RTOL, atol=ATOL):
            err = (d - g).abs().max().item()
            ratio = ""
            if torch.allclose(d, 2 * g, rtol=RTOL, atol=ATOL):
                ratio = " (= 2x expected)"
            elif torch.allclose(2 * d, g, rtol=RTOL, atol=ATOL):
                ratio = " (= half of expected)"
            issues.append(("grad value",
                           f"{label}: max abs err {err:.3g}{ratio}: {d.tolist()} != {g.tolist()}"))
    return issues


def _error_text(e: BaseException) -> str:
    """The first informative line of an error (a remote one: the original exception)."""
    text = getattr(e, "remote_message", None) or str(e)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = next((ln for ln in lines if not ln.startswith("On WorkerInfo")), lines[0] if lines else "")
    return f"{type(e).__name__}: {first}"


def group_of(text: str) -> str:
    """An error's group: numbers, shapes and worker names blanked out."""
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    text = re.sub(r"\[[-0-9., e]*\]|\([-0-9., ]*\)", "(..)", text)
    text = re.sub(r"\d+", "N", text)
    return text[:160]


def reference(prog: dict) -> dict:
    """:func:`run_local` of ``prog`` in a process that never imported distgrad
    (tests/clean_ref.py): a patch distgrad applies to torch cannot change it."""
    import clean_ref
    return clean_ref.reference(run_local, prog)


def check_program(prog: dict, backward_timeout: float = BACKWARD_TIMEOUT, want=None,
                  in_process: bool = False) -> dict:
    """Run ``prog`` on the cluster (on worker0 of a live cluster) and compare with the
    clean reference ``want`` (:func:`reference`; computed now when None; an exception:
    the reference failed). ``in_process``: also record, as ``rec["in_process"]``, the
    verdict of a reference computed here, where distgrad is imported (the old
    harness: the oracle's own tests show what it misses)."""
    rec = {"seed": prog["seed"], "world": prog["world"], "size": size(prog), "ok": False}
    try:
        want = reference(prog) if want is None else want
        if isinstance(want, BaseException):
            raise want
        mine = run_local(prog) if in_process else None
    except Exception as e:  # the generator made an invalid program: our bug, not the engine's
        rec.update(group="GENERATOR BUG: " + group_of(_error_text(e)), detail=traceback.format_exc())
        return rec
    try:
        got = run_distributed(prog, backward_timeout)
    except Hang as e:
        rec.update(group="hang: dist_autograd.backward never returned", detail=str(e), hang=True)
        return rec
    except Exception as e:
        text = _error_text(e)
        rec.update(group="error: " + group_of(text), detail=text + "\n" + "".join(
            traceback.format_exception(type(e), e, e.__traceback__))[-3000:])
        return rec
    if mine is not None:
        old = sorted({k for k, _ in compare(mine, got)})
        rec["in_process"] = "mismatch: " + ", ".join(old) if old else "exact"
    issues = compare(want, got)
    if issues:
        kinds = sorted({k for k, _ in issues})
        rec.update(group="mismatch: " + ", ".join(kinds), detail="\n".join(f"{k}: {d}" for k, d in issues))
    else:
        rec["ok"] = True
    return rec


# ---------------------------------------------------------------------------------------
# shrinking
# ---------------------------------------------------------------------------------------
def _defs(ins) -> list:
    """Registers an instruction defines (a stash defines the pseudo-register 'stash:NAME')."""
    op = ins[0]
    if op in ("leaf", "op", "async", "remote", "unstash", "module", "pleaf", "builtin"):
        return [ins[1]]
    if op in ("multi", "call", "wait", "to_here", "ckpt", "chain"):
        return list(ins[1])
    if op == "stash":
        return ["stash:" + ins[1]]
    return []


def _uses(ins) -> list:
    """Registers an instruction reads (a call: its block's params)."""
    op = ins[0]
    if op == "op":
        return list(ins[3])
    if op in ("multi", "module"):
        return [ins[3]]
    if op == "builtin":
        return list(ins[4])
    if op in ("call", "async", "remote", "ckpt"):
        return list(_sub_block(ins)["params"])
    if op in ("hook", "nodehook", "keep", "plain_hook", "post_acc"):
        return [ins[1]]
    if op == "chain":
        return [ins[2], ins[3]]
    if op in rt_round3.OPS:
        return rt_round3.uses(ins)
    if op == "inplace":
        return [ins[1], *ins[3]]
    if op in ("wait", "to_here", "stash"):
        return [ins[2]]
    if op == "unstash":
        return ["stash:" + ins[2]]
    return []


def _copy(prog):
    """A deep copy (candidates are edited in place)."""
    import copy
    return copy.deepcopy(prog)


def _all_blocks(block):
    """``block`` and every block nested in it, in program order."""
    yield block
    for ins in block["body"]:
        sub = _sub_block(ins)
        if sub is not None:
            yield from _all_blocks(sub)


def _cascade(prog: dict, removed: set):
    """Remove every instruction that uses a removed register (and what it defines),
    blocks whose returns went; None when a root went (no longer a program)."""
    changed = True
    while changed:
        changed = False
        for block in _all_blocks(prog["main"]):
            keep = []
            for ins in block["body"]:
                sub = _sub_block(ins)
                gone = any(u in removed for u in _uses(ins)) or (
                    sub is not None and any(r in removed for r in sub["returns"]))
                if gone:
                    removed.update(_defs(ins))
                    changed = True
                else:
                    keep.append(ins)
            block["body"] = keep
    if any(r in removed for r in prog["roots"]):
        return None
    return prog


def _rename(prog: dict, old: int, new: int) -> dict:
    """Every use of register ``old`` reads ``new`` instead (ids are global, and a
    block's params are its caller's argument ids, so one pass over all blocks does)."""
    def sub(x):
        return new if x == old else x
    for block in _all_blocks(prog["main"]):
        block["params"] = [sub(x) for x in block["params"]]
        block["returns"] = [sub(x) for x in block["returns"]]
        body = []
        for ins in block["body"]:
            if ins[0] == "op":
                ins = ins[:3] + ([sub(x) for x in ins[3]],) + ins[4:]
            elif ins[0] == "multi" or ins[0] in ("wait", "to_here", "stash"):
                ins = ins[:3] + (sub(ins[3]),) + ins[4:] if ins[0] == "multi" else ins[:2] + (sub(ins[2]),)
            elif ins[0] == "module":
                ins = ins[:3] + (sub(ins[3]),) + ins[4:]
            elif ins[0] in ("hook", "nodehook", "keep", "plain_hook"):
                ins = (ins[0], sub(ins[1])) + ins[2:]
            elif ins[0] == "inplace":
                ins = (ins[0], sub(ins[1]), ins[2], [sub(z) for z in ins[3]], ins[4])
            elif ins[0] == "builtin":
                ins = ins[:4] + ([sub(x) for x in ins[4]],)
            elif ins[0] in rt_round3.OPS:
                ins = rt_round3.rename(ins, sub)
            body.append(ins)
        block["body"] = body
    prog["roots"] = prog["main"]["returns"]
    return prog


def _candidates(prog: dict):
    """Smaller or simpler variants of ``prog``, biggest cuts first (none where a body
    waits for a signal that is gone: it would wait forever)."""
    return (c for c in _variants(prog) if rt_threads.paired(c))


def _variants(prog: dict):
    yield from rt_threads.strip(prog)
    if prog["retain"]:
        p = _copy(prog)
        p["retain"] = False
        yield p
    for i in range(len(prog["roots"])):
        if len(prog["roots"]) > 1:
            p = _copy(prog)
            p["roots"] = p["main"]["returns"] = [r for j, r in enumerate(p["roots"]) if j != i]
            yield _cascade(p, set()) or p
    rt = LocalRuntime()
    with torch.no_grad():
        run_block(prog["main"], [], rt)
    shapes = rt.shapes
    n_blocks = sum(1 for _ in _all_blocks(prog["main"]))

    def at(p, bi):
        return list(_all_blocks(p["main"]))[bi]

    for bi in range(n_blocks):
        block = at(prog, bi)
        for ii, ins in enumerate(block["body"]):
            if ins[0] in ("signal", "wait_for") or (_sub_block(ins) is not None
                                                    and rt_threads.waits(_sub_block(ins))):
                continue
            # the instruction removed, with everything that depends on it
            if not any(d in prog["roots"] for d in _defs(ins)):
                p = _copy(prog)
                del at(p, bi)["body"][ii]
                q = _cascade(p, set(_defs(ins)))
                if q is not None:
                    yield q
            # a plain copy dropped: its uses (and roots) read the input instead
            if ins[0] == "op" and ins[2] == "scale" and ins[4]["c"] == 1.0:
                p = _copy(prog)
                del at(p, bi)["body"][ii]
                yield _rename(p, ins[1], ins[3][0])
            # an op bypassed: its output becomes a plain copy of one input of the same shape
            if ins[0] == "op" and ins[2] != "scale":
                for x in dict.fromkeys(ins[3]):
                    if shapes.get(x) == shapes.get(ins[1]):
                        p = _copy(prog)
                        at(p, bi)["body"][ii] = ("op", ins[1], "scale", [x], {"c": 1.0})
                        yield p
            # calls made plain: rpc_sync instead of rpc_async / remote
            if ins[0] == "call" and ins[2] != "sync":
                p = _copy(prog)
                at(p, bi)["body"][ii] = ("call", ins[1], "sync", ins[3])
                yield p
            if ins[0] in ("async", "remote"):
                consumers = [(jj, i2) for jj, i2 in enumerate(block["body"]) if ins[1] in _uses(i2)]
                others = sum(ins[1] in _uses(i2) for b2 in _all_blocks(prog["main"]) for i2 in b2["body"])
                if len(consumers) == 1 == others and consumers[0][1][0] in ("wait", "to_here"):
                    jj, i2 = consumers[0]
                    p = _copy(prog)
                    body = at(p, bi)["body"]
                    body[ii] = ("call", i2[1], "sync", _sub_block(ins))
                    del body[jj]
                    yield p
            # one return of a call dropped (with the output that received it)
            if ins[0] == "call" and len(ins[1]) > 1:
                for k in range(len(ins[1])):
                    p = _copy(prog)
                    blk = at(p, bi)
                    sub = blk["body"][ii][3]
                    sub["returns"] = [r for j, r in enumerate(sub["returns"]) if j != k]
                    blk["body"][ii] = ("call", [o for j, o in enumerate(ins[1]) if j != k], ins[2], sub)
                    q = _cascade(p, {ins[1][k]})
                    if q is not None:
                        yield q
            # a call's block params the body no longer uses
            sub = _sub_block(ins)
            if sub is not None:
                used = {u for i2 in sub["body"] for u in _uses(i2)} | set(sub["returns"])
                if any(x not in used for x in sub["params"]):
                    p = _copy(prog)
                    s2 = _sub_block(at(p, bi)["body"][ii])
                    s2["params"] = [x for x in s2["params"] if x in used]
                    yield p


def shrink(prog: dict, group: str, budget_s: float = 60.0, max_tries: int = 300,
           backward_timeout: float = 10.0) -> tuple:
    """Greedy: keep any smaller variant that fails in the same group; returns the
    smallest program found and its record."""
    best, best_rec = prog, None
    deadline = time.monotonic() + budget_s
    tries = 0
    seen: set = set()   # candidates already run (each pass regenerates them all)
    progress = True
    while progress and time.monotonic() < deadline and tries < max_tries:
        progress = False
        for cand in _candidates(best):
            if time.monotonic() > deadline or tries >= max_tries:
                break
            key = json.dumps(cand, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            tries += 1
            rec = check_program(cand, backward_timeout)
            if not rec["ok"] and rec["group"] == group:
                best, best_rec, progress = cand, rec, True
                break
    return best, best_rec


# ---------------------------------------------------------------------------------------
# the cluster side and the CLI
# ---------------------------------------------------------------------------------------
def program_for(seed: int, world: int, cfg: dict) -> dict:
    """The program a run with ``cfg`` checks for ``seed``: generated with the run's
    feature weights (:func:`weights_for`), marked for a second-order run."""
    prog = generate(seed, world, weights_for(cfg))
    if cfg.get("order", 1) == 2:
        prog["order"] = 2
    return prog


def poison_for(prog: dict, seed: int) -> tuple:
    """``--anomaly``: :func:`poisoned` with the seed's own random stream (run in the
    clean reference process: local anomaly mode decides where the poison is reached)."""
    return poisoned(prog, random.Random(seed))


def prepare(world: int, seeds: list, cfg: dict) -> dict:
    """{seed: {"prog", "want" | "poison"}}: each seed's program and its reference,
    computed in the clean reference process (tests/clean_ref.py) before the cluster
    starts (a failed reference: the exception, raised where it is used)."""
    import clean_ref
    plan = {}
    for seed in seeds:
        prog = program_for(seed, world, cfg)
        key, fn, args = (("poison", poison_for, (prog, seed)) if cfg.get("anomaly")
                         else ("want", run_local, (prog,)))
        try:
            value = clean_ref.reference(fn, *args)
        except clean_ref.CleanReferenceError as e:
            value = e
        plan[seed] = {"prog": prog, key: value}
    return plan


def _check_one(prog: dict, cfg: dict, shrunk_per_group: collections.Counter, want=None) -> dict:
    """Check ``prog`` against its clean reference ``want`` (None: computed now),
    shrinking a failure."""
    rec = check_program(prog, cfg.get("backward_timeout", BACKWARD_TIMEOUT), want,
                        in_process=cfg.get("in_process", False))
    rec["features"] = sorted(features(prog))
    if not rec["ok"]:
        rec["dump"] = dump(prog)
        if (not rec.get("hang") and not rec["group"].startswith("GENERATOR")
                and shrunk_per_group[rec["group"]] < cfg.get("shrink", 0)):
            shrunk_per_group[rec["group"]] += 1
            small, small_rec = shrink(prog, rec["group"], cfg.get("shrink_budget_s", 60.0))
            if small_rec is not None:
                rec["shrunk"] = dump(small)
                rec["shrunk_size"] = size(small)
                rec["shrunk_detail"] = small_rec["detail"]
    return rec


def _check_poisoned(prog: dict, seed: int, world: int, cfg: dict, poison=None) -> dict:
    """``--anomaly``: poison one op of ``prog`` (``poison``: :func:`poison_for`'s answer
    from the clean process; None: asked now) and check what detect_anomaly reports."""
    if poison is None:
        import clean_ref
        poison = clean_ref.reference(poison_for, prog, seed)
    if isinstance(poison, BaseException):
        raise poison
    bad, worker = poison
    if bad is None:  # no op of this program is reached by its backward
        return {"seed": seed, "world": world, "size": size(prog), "ok": True, "skipped": True}
    rec = check_anomaly(bad, worker, cfg.get("backward_timeout", BACKWARD_TIMEOUT))
    rec["features"] = sorted(features(prog))
    if not rec["ok"]:
        rec["dump"] = dump(bad)
    return rec


def cluster_main(rank: int, world: int, seeds: list, cfg: dict):
    """run_workers target: worker0 runs and checks every seed's program; the others serve.

    ``cfg["plan"]``: :func:`prepare`'s programs and clean references, packed (a seed
    not in it is prepared on worker0). ``cfg["break_hooks"]``: a factor; every rank
    first applies clean_ref.break_register_hook (the oracle's own tests).
    Records go to ``cfg["out"]`` (JSON lines, one per program, flushed) when given, so a
    parent learns how far a cluster got even if it dies; they are also returned.
    Stops early after a hang (the cluster may be wedged): the rest run in a new one.
    """
    import clean_ref
    if cfg.get("break_hooks") is not None:
        clean_ref.break_register_hook(cfg["break_hooks"])
    if weights_for(cfg).get("compile"):
        # torch.compile's first use imports dynamo and inductor, which is not safe on
        # two threads at once (a circular-import error); this worker's programs may
        # compile on several (the reference no longer warms it up here)
        for name in COMPILE_FNS:
            _compiled(name)
    stacks = os.environ.get("DISTGRAD_RP_STACKS")
    if stacks:  # a directory: on a hang every worker writes its threads' stacks there
        import faulthandler
        import signal
        f = open(os.path.join(stacks, f"worker{rank}-{os.getpid()}.txt"), "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    if rank != 0:
        return None
    import distgrad.rpc as rpc
    pids = [rpc.rpc_sync(f"worker{w}", os.getpid) for w in range(world)] if stacks else []
    plan = clean_ref.unpack(cfg["plan"]) if cfg.get("plan") else {}
    records = []
    shrunk_per_group: collections.Counter = collections.Counter()
    for seed in seeds:
        entry = plan.get(seed) or {"prog": program_for(seed, world, cfg)}
        prog = entry["prog"]
        rec = (_check_poisoned(prog, seed, world, cfg, entry.get("poison")) if cfg.get("anomaly")
               else _check_one(prog, cfg, shrunk_per_group, entry.get("want")))
        records.append(rec)
        if cfg.get("out"):
            with open(cfg["out"], "a") as f:
                f.write(json.dumps(rec) + "\n")
        if not rec["ok"] and cfg.get("verbose"):
            print(f"  FAIL seed {seed} world {world}: {rec['group']}", flush=True)
        if rec.get("hang") and pids:
            import signal
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
        if rec.get("hang") and cfg.get("out"):
            # a pass may still be in flight and a graceful shutdown could wait on it:
            # leave now; the parent sees the record and goes on in a fresh cluster
            os._exit(3)
        if rec.get("hang"):
            break
    stats = collections.Counter()
    if not any(r.get("hang") for r in records):
        for w in range(world):
            stats.update(rpc.rpc_sync(f"worker{w}", _engine_stats))
    return {"records": records, "engine_stats": dict(stats)}


def run_seeds(world: int, seeds: list, cfg: dict, timeout: float, log=print) -> dict:
    """Run ``seeds`` on ``world``-worker clusters (a new one after a hang or a crash),
    each against its reference from the clean process (:func:`prepare`, here)."""
    import clean_ref
    from mp_utils import run_workers
    records: list = []
    stats: collections.Counter = collections.Counter()
    todo = list(seeds)
    cfg = dict(cfg, plan=clean_ref.pack(prepare(world, todo, cfg)))
    while todo:
        fd, out = tempfile.mkstemp(prefix="random-programs-", suffix=".jsonl")
        os.close(fd)
        try:
            res = run_workers(cluster_main, world_size=world, timeout=timeout,
                              args=(todo, dict(cfg, out=out)), options={"rpc_timeout": 30})
            stats.update(res[0]["engine_stats"])
            crash = None
        except Exception as e:  # a crash or timeout: keep what was recorded
            crash = f"cluster of {world} workers failed: {str(e)[-1500:]}"
        with open(out) as f:
            got = [json.loads(line) for line in f if line.strip()]
        os.unlink(out)
        records += got
        done = {r["seed"] for r in got}
        todo = [s for s in todo if s not in done]
        if crash and got and got[-1].get("hang"):
            crash = None        # worker0 left on purpose after a hang (see cluster_main)
        if crash and todo:
            seed = todo.pop(0)  # the program running when the cluster went down
            log(f"  seed {seed}: {crash.splitlines()[0]}")
            prog = program_for(seed, world, cfg)
            records.append({"seed": seed, "world": world, "ok": False, "size": size(prog),
                            "group": "cluster crashed or timed out", "detail": crash,
                            "dump": dump(prog), "features": sorted(features(prog))})
        elif crash:
            # every program was recorded, then the cluster failed (the engine-stats calls,
            # rpc.shutdown, another rank, the timeout): no program to blame, still a failure
            err = RuntimeError(f"{crash}\n(after all {len(seeds)} programs were recorded)")
            err.records = records   # type: ignore[attr-defined]  (the CLI still reports them)
            raise err
        elif todo:
            log(f"  restarting a {world}-worker cluster after a hang ({len(todo)} programs left)")
    return {"records": records, "engine_stats": dict(stats)}


def report(records: list, per_group: int = 3, out=sys.stdout) -> None:
    """Passed/failed counts, then each failure group with its smallest seeds."""
    failed = [r for r in records if not r["ok"]]
    skipped = sum(bool(r.get("skipped")) for r in records)
    print(f"\n{len(records) - len(failed) - skipped} passed, {len(failed)} failed (of {len(records)} "
          f"programs" + (f"; {skipped} skipped: no op reached by the backward to poison)" if skipped
                         else ")"), file=out)
    groups: dict = collections.defaultdict(list)
    for r in failed:
        groups[r["group"]].append(r)
    for g, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        rs.sort(key=lambda r: (r.get("shrunk_size", r["size"]), r["size"]))
        seeds = ", ".join(f"{r['seed']}/w{r['world']}" for r in rs[:10])
        print(f"\n=== {len(rs)} x {g}\n    seeds (seed/world, smallest first): {seeds}", file=out)
        for r in rs[:per_group]:
            print(f"\n--- seed {r['seed']} world {r['world']} ({r['size']} instructions)", file=out)
            print(r["dump"], file=out)
            print("  => " + r["detail"].strip().replace("\n", "\n     ")[:2500], file=out)
            if "shrunk" in r:
                print(f"  shrunk to {r['shrunk_size']} instructions:", file=out)
                print(r["shrunk"], file=out)
                print("  => " + r["shrunk_detail"].strip().replace("\n", "\n     ")[:1500], file=out)
    print(file=out)


def feature_table(records: list, names=None, out=sys.stdout) -> None:
    """Per feature: how many programs used it, and how many of those were exact."""
    names = FEATURES if names is None else names
    used = collections.Counter(f for r in records for f in r.get("features", []))
    exact = collections.Counter(f for r in records if r["ok"] for f in r.get("features", []))
    width = max(map(len, names))
    print(f"\n{'feature':<{width}}  programs  exact", file=out)
    for f in names:
        print(f"{f:<{width}}  {used[f]:>8}  {exact[f]:>5}{'' if used[f] == exact[f] else '  <-'}", file=out)


def main(argv=None) -> int:
    """The CLI; exit status 1 when any program failed."""
    ap = argparse.ArgumentParser(description="Random distributed autograd programs vs local autograd.")
    ap.add_argument("--programs", type=int, default=100, help="how many programs in all")
    ap.add_argument("--workers", default="2,3,4", help="world sizes, round robin over programs")
    ap.add_argument("--seed", type=int, default=None,
                    help="base seed (program i has seed base+i); random when omitted")
    ap.add_argument("--shrink", type=int, default=2, help="failures to shrink per group and world size")
    ap.add_argument("--shrink-budget", type=float, default=45.0, help="seconds per shrink")
    ap.add_argument("--backward-timeout", type=float, default=BACKWARD_TIMEOUT)
    ap.add_argument("--show", type=int, default=2, help="failures printed in full per group")
    ap.add_argument("--dump", action="store_true", help="print the programs and exit (no cluster)")
    ap.add_argument("--json", default=None, help="also write every record here (JSON lines)")
    ap.add_argument("--anomaly", action="store_true",
                    help="inject a NaN-producing node after a random op of each program and check "
                         "that detect_anomaly() names its worker and node")
    ap.add_argument("--order", type=int, choices=(1, 2), default=1,
                    help="2: second derivatives (backward with create_graph=True, then a backward "
                         "over the sum of squared gradients)")
    ap.add_argument("--features", default=None,
                    help="only these features, in every program: comma-separated names of "
                         f"{', '.join(FEATURE_WEIGHTS)} or groups {', '.join(FEATURE_GROUPS)}, each "
                         "NAME or NAME=probability; 'default' starts from the defaults "
                         f"({', '.join(f'{k}={v}' for k, v in FEATURE_WEIGHTS.items())})")
    args = ap.parse_args(argv)
    try:
        weights = parse_features(args.features)
    except ValueError as e:
        ap.error(str(e))
    worlds = [int(w) for w in args.workers.split(",")]
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    cfg = {"shrink": args.shrink, "shrink_budget_s": args.shrink_budget,
           "backward_timeout": args.backward_timeout, "verbose": True, "order": args.order,
           "anomaly": args.anomaly, "features": weights}
    weights = weights_for(cfg)
    FEATURE_WEIGHTS.update(weights)   # this process's own generate() calls (dumps of crashes)
    print(f"base seed {base}: {args.programs} programs on {worlds} workers, features "
          f"{', '.join(f'{k}={v:g}' for k, v in weights.items())} (rerun with --seed {base}"
          f"{' --features ' + args.features if args.features else ''})", flush=True)
    plan: dict = collections.defaultdict(list)
    for i in range(args.programs):
        plan[worlds[i % len(worlds)]].append(base + i)
    if args.dump:
        for w, seeds in plan.items():
            for s in seeds:
                print(dump(generate(s, w, weights)), "\n")
        return 0
    records: list = []
    t_start = time.monotonic()
    if round3(weights):   # issue 43: each program against torch's distributed autograd
        for w, seeds in sorted(plan.items()):
            t0 = time.monotonic()
            got = rt_round3.run_seeds(w, seeds, weights, shrink_n=args.shrink,
                                      shrink_budget=args.shrink_budget * 4,
                                      backward_timeout=max(args.backward_timeout, rt_round3.BACKWARD_TIMEOUT))
            print(f"world {w}: {len(seeds)} programs, {sum(not r['ok'] for r in got)} differ from torch, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            records += got
        if args.json:
            with open(args.json, "w") as f:
                for r in records:
                    f.write(json.dumps({k: v for k, v in r.items() if k not in ("torch", "distgrad")}) + "\n")
        feature_table(records, FEATURES + rt_round3.FEATURES)
        report(records, args.show)
        return 1 if any(not r["ok"] for r in records) else 0
    for w, seeds in sorted(plan.items()):
        t0 = time.monotonic()
        # torch.compile costs seconds per new shape and process (more under --anomaly)
        per_program = 6 + 24 * weights.get("compile", 0.0)
        budget = 60 + len(seeds) * per_program + args.shrink * 4 * args.shrink_budget
        try:
            res = run_seeds(w, seeds, cfg, timeout=budget)
        except RuntimeError as e:   # every program recorded, then the cluster failed
            if not hasattr(e, "records"):
                raise
            print(f"world {w}: {str(e).splitlines()[0][:300]}", flush=True)
            res = {"records": e.records + [{"seed": -1, "world": w, "ok": False, "size": 0,
                                            "group": "cluster failed after its last program",
                                            "detail": str(e)[-3000:], "dump": ""}],
                   "engine_stats": {}}
        bad = sum(not r["ok"] for r in res["records"])
        print(f"world {w}: {len(seeds)} programs, {bad} failed, {time.monotonic() - t0:.0f} s; "
              f"engine stats {res['engine_stats']}", flush=True)
        records += res["records"]
    if args.json:
        with open(args.json, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    elapsed = time.monotonic() - t_start
    print(f"{len(records)} programs in {elapsed:.0f} s ({elapsed / max(1, len(records)):.2f} s per "
          f"program, shrinking included)")
    feature_table(records)
    report(records, args.show)
    return 1 if any(not r["ok"] for r in records) else 0


if __name__ == "__main__":
    # import ourselves by module name, so the functions workers unpickle (random_programs.X)
    # are the same objects as the ones this process runs (not __main__'s copies)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import random_programs
    sys.exit(random_programs.main())
