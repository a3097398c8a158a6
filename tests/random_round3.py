"""The random programs' third round: what torch ties to one graph task (issue 43; part of
tests/random_programs.py), each program compared with torch's own distributed autograd.

The reference of this round is not local autograd: every program runs twice, on a
cluster of torch's ``torch.distributed.rpc`` + ``torch.distributed.autograd`` (spawned
workers that never import distgrad: checked after every program on every rank) and on
a cluster of distgrad's, and what a user can observe must be the same (:func:`compare`):
the roots, every context's gradients after each pass (dtype included), the outcome of
each pass (an error's presence, its type: distgrad's must be an instance of torch's, and
what it says), the counting nodes' runs, the ops a mode around ``backward`` saw, and
every event the hooks below note (their calls, arguments and findings), per worker and
pass (a multiset: the order of hooks that two arrivals start is timing). After a failed
pass nothing but the error is compared (what the other workers did by then is timing),
and later passes are not run.

Observations torch's own runs do not repeat are left out, measured by running programs
twice on torch: which gradient a multi-grad hook of mode "any" gets first (it notes that
it got one), and the ops of TIMING_OPS a dispatch mode sees (a gradient cloned or stolen
at accumulation, a received message rebuilt under the pass's state). torch's run is
repeated once if it crashes (a worker of it segfaulted once in some 300 programs).

Features (drawn per program like the others: FEATURE_WEIGHTS, group ``round3``)::

    ("mgh", [reg, ...], mode, tag)       torch.autograd.graph.register_multi_grad_hook over
                                         2-3 tensors (mostly one sent over RPC, one used
                                         locally), mode "all" | "any"; each call noted with
                                         its gradients (None where absent)
    ("qcb", reg, tag)                    a hook that queues a final callback with
                                         Variable._execution_engine.queue_callback; the
                                         callback notes which of the worker's leaves have a
                                         gradient in the context then
    prog["mode"] = "dispatch" | "function"   a TorchDispatchMode / TorchFunctionMode entered
                                         around dist_autograd.backward on worker0, noting
                                         every op (aten overload / torch function) it sees
    ("ctxhook", reg, kind, tag)          a hook calling dist_autograd._current_context()
                                         ("current": none, the pass's or another) or opening
                                         ``with dist_autograd.context()`` ("open": opened, or
                                         the error)
    ("sleep", reg, secs, tag)            a hook sleeping ``secs`` (2 or 5 s) on worker0, in a
                                         pass with a shared region (a value used locally
                                         and sent)
    checkpoint(use_reentrant=False) whose output is used locally and sent over RPC
    ("op", out, name, [x], {"poison": True}) + prog["anomaly"] = "caller" | "all"
                                         a NaN-making node on a value used locally and sent
                                         (a shared region); torch.autograd's anomaly mode
                                         (check_nan) on worker0 / on every worker during the
                                         passes
    ("grad_dtype", leaf, "float32" | None)   leaf.grad_dtype set (torch 2.13's InputMetadata
                                         grad_dtype); with None mostly ("op", out, "lowgrad",
                                         [leaf], {}) too, a node whose backward returns a
                                         float32 gradient
    prog["again"] = True                 one more backward without retain_graph after the
                                         last pass (torch: "Trying to backward through the
                                         graph a second time" where a node saved tensors)
    ("leafthread", leaf, worker, n)      while this instruction runs, a thread loops ops on
                                         the leaf (grad mode) and another sends it ``n``
                                         times to ``worker``, each in a context of its own

torch's FAST-mode distributed engine waits for every send function of a context, so a
program whose backward leaves one without a gradient (an RPC result that never reaches
the roots) hangs under torch (its own test_backward_unused_send_function); distgrad
deliberately does not (docs/compatibility.md). This round's generator therefore returns
every value that depends on a message and is not used otherwise, fetches every RRef,
roots what is left, and keeps only programs whose every crossing is reached by local
autograd's backward (:func:`torch_safe`; else the next attempt of the same seed).

CLI (through tests/random_programs.py)::

    python tests/random_programs.py --features round3 --programs 5 --workers 2
    python tests/random_programs.py --features round3=0.4 --programs 1 --workers 3 --seed S
"""
from __future__ import annotations

import collections
import json
import math
import multiprocessing as mp
import os
import queue
import random
import threading
import time
import traceback

import torch

ROUND3_FEATURES = ("multi_grad", "queue_callback", "backward_mode", "ctx_hook", "slow_hook",
                   "ckpt_shared", "anomaly_nan", "grad_dtype", "again", "leaf_thread")
STEP_WEIGHTS = {"multi_grad": 0.6, "queue_callback": 0.5, "ctx_hook": 0.5, "ckpt_shared": 0.4,
                "grad_dtype": 0.4, "leaf_thread": 0.3, "anomaly_nan": 0.4,
                "backward_mode": 0.0, "slow_hook": 0.0, "again": 0.0}
# program-level features of other rounds this round's run does not know (it has no
# plain threads, no second forward, no .grad watcher, no get_gradients kept between passes)
NOT_HERE = ("plain_thread", "two_passes", "watch", "keep_between")
OPS = ("mgh", "qcb", "ctxhook", "sleep", "grad_dtype", "leafthread")
SLEEPS = (2.0, 5.0)            # s a slow hook takes (distgrad's heartbeat gives up at 4 s)
LEAF_SENDS = (10, 30)          # sends of a leaf while another thread uses it
LEAF_THREAD_TIMEOUT = 60.0     # s the sends may take
SETTLE = 0.5                   # s given to a failed pass's stragglers on other workers
ATTEMPTS = 40                  # programs tried per seed until one is torch-safe
BACKWARD_TIMEOUT = 40.0        # s one pass may take (a slow hook sleeps 5 s)
RPC_TIMEOUT = 30               # s (torch's default is 60)
SECRET = "5f0c3e8e1b9a4d7c2e6f8a0b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9e1f3a5b7c9d"   # (tests only)
START_TIMEOUT = 240.0          # s a cluster may take to start (2 loaded cores)
ERROR_KEYS = ("Trying to backward through the graph a second time", "returned nan values",
              "PoisonBackward", "Could not find autograd context", "Already have an autograd context",
              "Final callbacks can only be installed during backward pass", "grad_dtype")


# ---------------------------------------------------------------------------------------
# runtime pieces (both interpreters; the hooks only in a distributed run)
# ---------------------------------------------------------------------------------------
class LowGrad(torch.autograd.Function):
    """Identity whose backward returns the gradient as float32 (the engine casts it to
    the input's dtype, unless the input is a leaf whose grad_dtype is None)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.float32)


class _State:
    """This worker's notes: (pass, tag, kind, record) events of program ``prog``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prog = 0
        self.pass_k = 0
        self.events: list = []


R3 = _State()


def _rv(t) -> list:
    """A tensor's values, rounded to 7 significant digits (events are compared exactly)."""
    if t is None:
        return None
    t = t.detach()
    t = t.to_dense() if t.is_sparse else t
    return [v if math.isnan(v) or math.isinf(v) else float(f"{v:.7g}")
            for v in t.to(torch.float64).flatten().tolist()]


def _grad_rec(g):
    if g is None:
        return None
    return {"dtype": str(g.dtype).replace("torch.", ""), "shape": list(g.shape), "v": _rv(g)}


def note(tag: str, kind: str, rec, prog: int) -> None:
    """An event of program ``prog`` (dropped when another program runs now: a straggler
    of a failed pass)."""
    with R3.lock:
        if prog == R3.prog:
            R3.events.append([R3.pass_k, tag, kind, rec])


def _err_rec(e: BaseException) -> dict:
    text = getattr(e, "remote_message", None) or str(e)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
            "keys": sorted(k for k in ERROR_KEYS if k in text), "text": first[:300]}


def _current_cid(dist_autograd):
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:
        return None


def run_ins(ins, env: dict, state, distributed: bool) -> None:
    """One instruction of this round (the local interpreter only sets grad_dtype)."""
    op = ins[0]
    if op == "grad_dtype":
        t = env[ins[1]]
        if t.requires_grad and t.grad_fn is None:
            t.grad_dtype = None if ins[2] is None else getattr(torch, ins[2])
        return
    if not distributed:
        return
    import random_programs as rp
    rpc, dist_autograd = rp.dist_modules()
    pid = R3.prog
    if op == "mgh":
        _, regs, mode, tag = ins
        ts = [env[r] for r in regs]
        if not all(t.requires_grad for t in ts):
            return
        if mode == "all":
            def fn(grads, tag=tag):
                note(tag, "all", [_grad_rec(g) for g in grads], pid)
        else:
            def fn(grad, tag=tag):     # (which gradient comes first is timing)
                note(tag, "any", None if grad is None else "a gradient", pid)
        torch.autograd.graph.register_multi_grad_hook(ts, fn, mode=mode)
        for i, t in enumerate(ts):      # (each tensor's gradient seen: the hook had a chance)
            t.register_hook(lambda g, i=i, tag=tag: note(tag, "seen", i, pid))
    elif op == "qcb":
        _, reg, tag = ins
        t = env[reg]
        if not t.requires_grad:
            return
        cid = _current_cid(dist_autograd)

        def callback(tag=tag, cid=cid):
            try:
                grads = dist_autograd.get_gradients(cid)
                with state.lock:
                    leaves = list(state.leaves.items())
                found = sorted(n.split(".", 1)[1] for n, v in leaves if v in grads)
            except Exception as e:  # noqa: BLE001 - noted, compared
                found = _err_rec(e)
            note(tag, "callback", found, pid)

        def hook(g, tag=tag):
            note(tag, "hook", None, pid)
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        t.register_hook(hook)
    elif op == "ctxhook":
        _, reg, kind, tag = ins
        t = env[reg]
        if not t.requires_grad:
            return
        cid = _current_cid(dist_autograd)

        def hook(g, tag=tag, kind=kind, cid=cid):
            if kind == "current":
                now = _current_cid(dist_autograd)
                rec = "none" if now is None else "the pass's" if now == cid else "another"
            else:
                try:
                    with dist_autograd.context():
                        pass
                    rec = "opened"
                except Exception as e:  # noqa: BLE001 - noted, compared
                    rec = {k: v for k, v in _err_rec(e).items() if k in ("type", "keys")}
            note(tag, kind, rec, pid)
        t.register_hook(hook)
    elif op == "sleep":
        _, reg, secs, tag = ins
        t = env[reg]
        if not t.requires_grad:
            return

        def hook(g, tag=tag, secs=secs):
            time.sleep(secs)
            note(tag, "slept", secs, pid)
        t.register_hook(hook)
    elif op == "leafthread":
        _, reg, worker, n = ins
        leaf_thread(env[reg], worker, n, rpc, dist_autograd)
    else:
        raise ValueError(f"unknown instruction {ins!r}")


def ident(t):
    """RPC target: the tensor back."""
    return t


def leaf_thread(t, worker: int, n: int, rpc, dist_autograd) -> None:
    """("leafthread", ...): ops on ``t`` on one thread while another sends it ``n`` times
    (each send in a context of its own); returns when the sends are done."""
    stop = threading.Event()
    errors: list = []

    def op_loop():
        try:
            while not stop.is_set():
                y = t * 2
                del y
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    def send_loop():
        try:
            for _ in range(n):
                with dist_autograd.context():
                    rpc.rpc_sync(f"worker{worker}", ident, args=(t,))
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
    ops = threading.Thread(target=op_loop, daemon=True, name="random-round3-leaf-ops")
    sends = threading.Thread(target=send_loop, daemon=True, name="random-round3-leaf-sends")
    ops.start()
    sends.start()
    sends.join(LEAF_THREAD_TIMEOUT)
    stop.set()
    ops.join(10)
    if sends.is_alive():
        raise RuntimeError(f"{n} sends of a leaf used by another thread did not finish within "
                           f"{LEAF_THREAD_TIMEOUT:g} s")
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------
# the generator
# ---------------------------------------------------------------------------------------
def fits(gen, b) -> dict:
    """Which of this round's step features fit block ``b`` now (Generator.feature_kinds)."""
    rg = bool(gen.own_rg(b) or b.leaves)
    done = getattr(gen, "r3_done", set())
    out = dict.fromkeys(ROUND3_FEATURES, False)
    out.update({"multi_grad": rg, "queue_callback": rg, "ctx_hook": rg, "ckpt_shared": b.depth < 3,
                "grad_dtype": True, "leaf_thread": b.depth < 3 and "leaf_thread" not in done,
                "anomaly_nan": b.depth < 3 and "anomaly_nan" not in done})
    return out


def _rg_regs(gen, b) -> list:
    return [r for r in gen.tensors(b) if gen.rg(r)]


def _other(gen, w: int) -> int:
    return gen.rnd.choice([v for v in range(gen.world) if v != w] or [w])


def g_multi_grad(gen, b) -> None:
    r = gen.rnd
    cands = _rg_regs(gen, b)
    while len(cands) < 2:
        cands.append(gen.g_leaf(b, kind="leaf"))
    sent = [x for x in cands if x in b.sent]
    first = r.choice(sent) if sent and r.random() < 0.7 else r.choice(cands)
    rest = [x for x in cands if x != first]
    regs = [first] + r.sample(rest, min(len(rest), r.randint(1, 2)))
    r.shuffle(regs)
    gen.emit(b, ("mgh", regs, r.choice(["all", "any"]), gen.name("mgh")))
    gen.r3_done.add("multi_grad")


def g_queue_callback(gen, b) -> None:
    gen.emit(b, ("qcb", gen.rnd.choice(_rg_regs(gen, b)), gen.name("qcb")))
    gen.r3_done.add("queue_callback")


def g_ctx_hook(gen, b) -> None:
    r = gen.rnd
    gen.emit(b, ("ctxhook", r.choice(_rg_regs(gen, b)), r.choice(["current", "open"]), gen.name("ctx")))
    gen.r3_done.add("ctx_hook")


def shared_region(gen, b, x: int) -> None:
    """``x`` used locally and sent to another worker (where it is used)."""
    import random_params as rpp
    rpp.use(gen, b, x)
    gen.g_call(b, target=_other(gen, b.worker), mode=gen.rnd.choice(["sync", "sync", "async_now"]),
               extra_args=[x])


def g_ckpt_shared(gen, b) -> None:
    n = len(b.body)
    gen.g_ckpt(b, reentrant=False)
    ins = b.body[n] if len(b.body) > n else None
    outs = [o for o in (ins[1] if ins is not None and ins[0] == "ckpt" else []) if gen.rg(o)]
    if not outs:
        return
    shared_region(gen, b, gen.rnd.choice(outs))
    gen.r3_done.add("ckpt_shared")


def g_anomaly_nan(gen, b) -> None:
    r = gen.rnd
    cands = _rg_regs(gen, b) or [gen.g_leaf(b, kind="leaf")]
    x = r.choice(cands[-4:])
    name = r.choice(["sin", "square", "scale", "tanh"])
    attrs = {"c": r.choice([-1.5, 0.5, 3.0])} if name == "scale" else {}
    y = gen.op(b, name, [x], dict(attrs, poison=True), gen.shape(x))
    shared_region(gen, b, y)
    gen.r3_done.add("anomaly_nan")


def g_grad_dtype(gen, b) -> None:
    r = gen.rnd
    leaves = [x for x in b.leaves if gen.rg(x)]
    x = r.choice(leaves) if leaves and r.random() < 0.6 else gen.g_leaf(b, kind=r.choice(["leaf", "param"]))
    dtype = r.choice(["float32", None])
    gen.emit(b, ("grad_dtype", x, dtype))
    if dtype is None or r.random() < 0.3:
        gen.op(b, "lowgrad", [x], {}, gen.shape(x))
    gen.r3_done.add("grad_dtype")


def g_leaf_thread(gen, b) -> None:
    r = gen.rnd
    leaves = [x for x in b.leaves if gen.rg(x)]
    x = r.choice(leaves) if leaves and r.random() < 0.7 else gen.g_leaf(b, kind=r.choice(["leaf", "param"]))
    gen.emit(b, ("leafthread", x, _other(gen, b.worker), r.randint(*LEAF_SENDS)))
    gen.r3_done.add("leaf_thread")


def g_slow_hook(gen, b) -> None:
    """On worker0: a value used locally and sent, and a slow hook on one of them (or on
    another value of the pass)."""
    r = gen.rnd
    x = r.choice(_rg_regs(gen, b) or [gen.g_leaf(b, kind="leaf")])
    shared_region(gen, b, x)
    target = r.choice([x] + [y for y in gen.own_rg(b)[-3:] if y != x])
    gen.emit(b, ("sleep", target, r.choice(SLEEPS), gen.name("slow")))
    gen.r3_done.add("slow_hook")


def _flow_uses(ins) -> list:
    """The registers whose gradient flows on through ``ins`` (not a hook, a stash, a
    detach, an in-place target)."""
    import random_programs as rp
    op = ins[0]
    if op == "op":
        return [] if ins[2] == "detach" else list(ins[3])
    if op == "inplace":
        return list(ins[3])
    if op in ("multi", "module", "builtin", "call", "async", "remote", "ckpt"):
        return rp._uses(ins)
    return []


def dangling(gen, b) -> list:
    """Registers of ``b`` that require grad, depend on a message (a param, a call's
    results, an unstash) and reach neither a use that carries their gradient on nor the
    block's returns: under torch, a send function behind them would wait forever."""
    import random_programs as rp
    tainted = {p for p in b.params if gen.meta[p][0] == "t"}
    used: set = set()
    for ins in b.body:
        op = ins[0]
        if op in ("call", "wait", "to_here", "chain", "unstash", "builtin"):
            tainted.update(rp._defs(ins))
        elif op in ("op", "multi", "module", "ckpt", "inplace") and tainted & set(rp._uses(ins)):
            tainted.update(d for d in rp._defs(ins) if isinstance(d, int))
            if op == "inplace":
                tainted.add(ins[1])
        used.update(_flow_uses(ins))
    return [r for r in b.env if r in tainted and gen.meta[r][0] == "t" and gen.rg(r) and r not in used]


def _unfetched(gen, b) -> list:
    import random_programs as rp
    used = {u for ins in b.body for u in rp._uses(ins)}
    return [r for r in b.env if gen.meta[r][0] == "rref" and r not in used]


def program_extras(gen) -> dict:
    out = {}
    r = gen.rnd
    if "backward_mode" in gen.on:
        out["mode"] = r.choice(["dispatch", "function"])
    if "again" in gen.on:
        out["again"] = True
    if "anomaly_nan" in gen.r3_done:
        out["anomaly"] = r.choice(["caller", "all"])
    return out


def make_generator(seed: int, world: int, weights: dict, attempt: int):
    """This round's Generator (a subclass made here: random_programs imports this module)."""
    import random_programs as rp

    class R3Generator(rp.Generator):
        """The Generator with this round's features, and no value that depends on a
        message left without a use (torch's FAST mode would wait for its gradient)."""

        def __init__(self) -> None:
            super().__init__(seed, world, weights)
            if attempt:
                self.rnd = random.Random(f"round3.{seed}.{attempt}")
            self.on -= set(NOT_HERE)
            self.r3_done: set = set()

        def gen_block(self, worker, params, depth, seq, caller, steps):
            b = super().gen_block(worker, params, depth, seq, caller, steps)
            for rref in _unfetched(self, b):     # an RRef never fetched: its args' sends wait
                self.g_to_here(b, rref)
            return b

        def pick_returns(self, child):
            rets = super().pick_returns(child)
            return rets + [x for x in dangling(self, child) if x not in rets]

        def program(self) -> dict:
            r = self.rnd
            steps = r.choice([2, 3, 4, 6, 8])
            main = rp._BlockGen(0, [], 0, True, None)
            for _ in range(r.randint(1, 3)):
                self.g_leaf(main, kind=r.choice(["leaf", "param"]))
            forced = r.randrange(steps)
            for i in range(steps):
                if i == forced:
                    self.g_call(main, target=r.randrange(1, self.world))
                else:
                    self.step(main)
            # every drawn feature at least once (in the main block when no step drew it)
            for f in ROUND3_FEATURES:
                if f in self.on and f not in self.r3_done and f not in ("backward_mode", "again"):
                    if f == "slow_hook" or fits(self, main).get(f):
                        getattr(self, "g_" + f)(main)
            for fut in list(main.pending):
                self.g_wait(main, fut)
            for rref in _unfetched(self, main):
                self.g_to_here(main, rref)
            roots = self.gen_roots(main)
            left = dangling(self, main)
            if left:   # the rest of what came over a message: into the last root
                acc = roots[-1]
                for x in left:
                    term = self.op(main, "dot", [x], {"w": self.name("weight")}, ())
                    acc = self.op(main, "add", [acc, term], {}, ())
                roots[-1] = acc
            retain = r.random() < 0.3 and not self.compiled
            return {"seed": self.seed, "world": self.world, "retain": retain, "roots": roots,
                    "main": {"worker": 0, "params": [], "body": main.body, "returns": roots},
                    **program_extras(self)}

    return R3Generator()


def generate(seed: int, world: int, weights: dict) -> dict:
    """The program of ``seed``: the first attempt that is torch-safe (:func:`torch_safe`)."""
    last = None
    for attempt in range(ATTEMPTS):
        prog = make_generator(seed, world, weights, attempt).program()
        if attempt:
            prog["attempt"] = attempt
        if torch_safe(prog):
            return prog
        last = prog
    last["unsafe"] = True
    return last


class _Crossing(torch.autograd.Function):
    """A tensor crossing a message in :func:`torch_safe`: counts its backward runs."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        ctx.set_materialize_grads(False)
        box["sent"] += 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box["got"] += 1
        return g, None


def torch_safe(prog: dict) -> bool:
    """Whether local autograd's first backward of ``prog`` reaches every tensor that
    requires grad and crosses a message (torch's FAST mode waits for each one's send
    function: an unreached one hangs the pass)."""
    import random_params as rpp
    import random_programs as rp
    import random_threads as rpt
    box = {"sent": 0, "got": 0}

    def wrap(values):
        return tuple(_Crossing.apply(v, box) if isinstance(v, torch.Tensor) and v.requires_grad else v
                     for v in rpp.cross(values))

    class Safety(rp.LocalRuntime):
        def call(self, mode, block, values, me=None):
            out = rp.run_block(block, wrap(values), self)
            return out if mode == "remote_here" and me == block["worker"] else wrap(out)

        def call_async(self, block, values):
            def body():
                return wrap(rp.run_block(block, wrap(values), self))
            return rpt.LocalFuture(body) if rpt.waits(block) else body()

        def remote(self, block, values):
            return rp.LocalRRef(rp.run_block(block, wrap(values), self), block["worker"])

        def to_here(self, rref, me=None):
            return rref.values if me == rref.owner else wrap(rref.values)

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roots = list(rp.run_block(prog["main"], [], Safety()))
        roots = [t for t in roots if t.requires_grad]
        if roots:
            torch.autograd.backward(roots)
    return box["got"] == box["sent"]


# -- walking, dumping, shrinking ----------------------------------------------------------
def static_features(prog: dict, instructions, shared) -> set:
    """features() for this round (``shared``: the registers used locally and sent)."""
    f = set()
    for w, ins in instructions:
        op = ins[0]
        if op == "mgh":
            f.add(f"multi-grad hook (mode {ins[2]})")
        elif op == "qcb":
            f.add("final callback queued by a hook")
        elif op == "ctxhook":
            f.add("hook calls _current_context()" if ins[2] == "current" else "hook opens a context")
        elif op == "sleep" and w == 0 and shared:
            f.add("slow hook in a pass with a shared region")
        elif op == "grad_dtype":
            f.add("grad_dtype float32" if ins[2] == "float32" else "grad_dtype None (float32 gradient kept)")
        elif op == "leafthread":
            f.add("leaf used by a thread while sent")
        elif op == "op" and ins[4].get("poison") and prog.get("anomaly") and ins[1] in shared:
            f.add(f"anomaly mode ({prog['anomaly']}), NaN in a shared region")
        elif op == "ckpt" and not ins[2] and set(ins[1]) & shared:
            f.add("checkpoint output used locally and sent")
    if prog.get("mode"):
        f.add(f"{prog['mode']} mode around backward")
    if prog.get("again"):
        f.add("backward again without retain_graph")
    return f


FEATURES = ["multi-grad hook (mode all)", "multi-grad hook (mode any)", "final callback queued by a hook",
            "dispatch mode around backward", "function mode around backward",
            "hook calls _current_context()", "hook opens a context",
            "slow hook in a pass with a shared region", "checkpoint output used locally and sent",
            "anomaly mode (caller), NaN in a shared region", "anomaly mode (all), NaN in a shared region",
            "grad_dtype float32", "grad_dtype None (float32 gradient kept)",
            "backward again without retain_graph", "leaf used by a thread while sent"]


def shared_registers(prog: dict) -> set:
    """Registers used by a local op of their block and sent to another worker by it."""
    import random_programs as rp
    out = set()
    for block in rp._all_blocks(prog["main"]):
        local = {u for ins in block["body"] if ins[0] in ("op", "multi", "module", "ckpt")
                 for u in rp._uses(ins)}
        for ins in block["body"]:
            sub = rp._sub_block(ins)
            if sub is not None and ins[0] != "ckpt" and sub["worker"] != block["worker"]:
                out |= set(sub["params"]) & local
    return out


def uses(ins) -> list:
    if ins[0] == "mgh":
        return list(ins[1])
    if ins[0] in ("qcb", "ctxhook", "sleep", "grad_dtype", "leafthread"):
        return [ins[1]]
    return []


def rename(ins, sub):
    if ins[0] == "mgh":
        return (ins[0], [sub(x) for x in ins[1]]) + tuple(ins[2:])
    if ins[0] in ("qcb", "ctxhook", "sleep", "grad_dtype", "leafthread"):
        return (ins[0], sub(ins[1])) + tuple(ins[2:])
    return ins


def dump_line(ins) -> str:
    op = ins[0]
    if op == "mgh":
        return f"register_multi_grad_hook(({', '.join(f'r{x}' for x in ins[1])}), note, mode={ins[2]!r})"
    if op == "qcb":
        return (f"r{ins[1]}.register_hook(queue_callback(note which leaves of this worker have a "
                f"gradient in the context))")
    if op == "ctxhook":
        what = ("dist_autograd._current_context()" if ins[2] == "current"
                else "with dist_autograd.context(): pass")
        return f"r{ins[1]}.register_hook({what})"
    if op == "sleep":
        return f"r{ins[1]}.register_hook(time.sleep({ins[2]}))"
    if op == "grad_dtype":
        return f"r{ins[1]}.grad_dtype = {'torch.' + ins[2] if ins[2] else None}"
    if op == "leafthread":
        return (f"while a thread loops r{ins[1]} * 2: {ins[3]} x (with context(): rpc_sync(worker{ins[2]}, "
                f"ident, (r{ins[1]},)))")
    raise ValueError(f"unknown instruction {ins!r}")


def header(prog: dict) -> str:
    parts = []
    if prog.get("mode"):
        parts.append(f"; a {prog['mode']} mode around backward")
    if prog.get("anomaly"):
        parts.append(f"; anomaly mode on {'worker0' if prog['anomaly'] == 'caller' else 'every worker'}")
    if prog.get("again"):
        parts.append("; then backward again without retain_graph")
    return "".join(parts)


def strip(prog: dict) -> list:
    """Shrink candidates: ``prog`` without its mode, its extra pass, its anomaly mode."""
    import copy
    out = []
    for key in ("mode", "again", "anomaly"):
        if prog.get(key):
            p = copy.deepcopy(prog)
            del p[key]
            out.append(p)
    if prog.get("anomaly") == "all":
        p = copy.deepcopy(prog)
        p["anomaly"] = "caller"
        out.append(p)
    return out


# ---------------------------------------------------------------------------------------
# the distributed run (torch's or distgrad's), on worker0
# ---------------------------------------------------------------------------------------
def exercised(prog: dict, obs: dict) -> set:
    """The features of FEATURES that a run (torch's) showed at work, not only wrote: a
    hook that ran, a mode that saw ops, anomaly mode that found the NaN, a pass that
    ran again, a float32 gradient in a context, ..."""
    import random_programs as rp
    static = rp.features(prog) & set(FEATURES)
    if obs.get("hang") or obs.get("crash"):
        return set()
    passes = obs["passes"]
    ok = [p for p in passes if p["error"] is None]
    compared = {k for k, p in enumerate(passes) if p["error"] is None}   # (see compare)
    events = {(ev[1].split(".", 1)[-1], ev[2]) for evs in obs["events"].values() for ev in evs
              if ev[0] in compared}
    kinds = {k for _, k in events}
    seen = {tag for (tag, kind) in events if kind == "seen"}
    f = set()
    if "any" in kinds:
        f.add("multi-grad hook (mode any)")
    if "multi-grad hook (mode all)" in static and any(
            ins[0] == "mgh" and ins[2] == "all" and ins[3].split(".", 1)[-1] in seen
            for _, ins, _, _ in rp.walk(prog["main"])):
        f.add("multi-grad hook (mode all)")
    if "callback" in kinds:
        f.add("final callback queued by a hook")
    for mode in ("dispatch", "function"):
        if prog.get("mode") == mode and any(p.get("ops") for p in ok):
            f.add(f"{mode} mode around backward")
    if "current" in kinds:
        f.add("hook calls _current_context()")
    if "open" in kinds:
        f.add("hook opens a context")
    if "slept" in kinds and "slow hook in a pass with a shared region" in static:
        f.add("slow hook in a pass with a shared region")
    for x in static:
        if x.startswith("anomaly") and any("returned nan values" in ((p["error"] or {}).get("keys") or [])
                                           for p in passes):
            f.add(x)
    if ok and any(g["dtype"] == "float32" for p in ok for g in p["grads"].values()):
        f |= static & {"grad_dtype float32", "grad_dtype None (float32 gradient kept)"}
    if "backward again without retain_graph" in static and len(passes) == len(pass_plan(prog)):
        f.add("backward again without retain_graph")
    if passes and passes[0]["error"] is None:
        f |= static & {"checkpoint output used locally and sent", "leaf used by a thread while sent"}
    return f


def reset_here(prog: int) -> None:
    import random_programs as rp
    rp._reset()
    with R3.lock:
        R3.events, R3.pass_k, R3.prog = [], 0, prog


def set_pass(k: int) -> None:
    with R3.lock:
        R3.pass_k = k


def set_anomaly(on: bool) -> None:
    torch.autograd.set_detect_anomaly(on, check_nan=True)


def take_events() -> list:
    with R3.lock:
        out, R3.events = R3.events, []
    return out


def loaded_distgrad() -> list:
    import clean_ref
    return clean_ref.distgrad_modules()


def _recorder(mode: str):
    """A mode noting the name of every op it sees (the set)."""
    from torch.overrides import TorchFunctionMode, resolve_name
    from torch.utils._python_dispatch import TorchDispatchMode
    seen: set = set()
    lock = threading.Lock()
    if mode == "dispatch":
        class Rec(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                with lock:
                    seen.add(str(func))
                return func(*args, **(kwargs or {}))
    else:
        class Rec(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
                with lock:
                    seen.add(name)
                return func(*args, **(kwargs or {}))
    return Rec(), seen


def one_pass(dist_autograd, cid: int, roots: list, retain: bool, mode, timeout: float) -> tuple:
    """(error record or None, sorted op names the mode saw or None) of one backward, run
    on a helper thread (a hang is reported, not waited out)."""
    box: dict = {}

    def run():
        rec, seen = _recorder(mode) if mode else (None, None)
        try:
            if rec is not None:
                with rec:
                    dist_autograd.backward(cid, roots, retain_graph=retain)
            else:
                dist_autograd.backward(cid, roots, retain_graph=retain)
        except BaseException as e:  # noqa: BLE001 - recorded
            box["err"] = _err_rec(e)
        box["ops"] = sorted(seen) if seen is not None else None
    t = threading.Thread(target=run, daemon=True, name="random-round3-backward")
    t.start()
    t.join(timeout)
    if t.is_alive():
        return {"hang": True, "type": "Hang", "text": f"backward did not return within {timeout:g} s"}, None
    return box.get("err"), box.get("ops")


def _enc(t) -> dict:
    t = t.detach()
    t = t.to_dense() if t.is_sparse else t
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "v": t.to(torch.float64).flatten().tolist()}


def pass_plan(prog: dict) -> list:
    """retain_graph of each pass: one (two when retained), and one more with "again"."""
    plan = [True, False] if prog["retain"] else [False]
    return plan + [False] * bool(prog.get("again"))


def observe(prog: dict, timeout: float = BACKWARD_TIMEOUT) -> dict:
    """Run ``prog`` on this cluster (worker0, either impl): what a user observes."""
    import random_programs as rp
    rpc, dist_autograd = rp.dist_modules()
    world = prog["world"]
    workers = [f"worker{w}" for w in range(world)]
    R3.prog += 1
    for to in workers:
        rpc.rpc_sync(to, reset_here, args=(R3.prog,))
    obs: dict = {"passes": []}
    anomaly = prog.get("anomaly")
    targets = workers if anomaly == "all" else workers[:1] if anomaly else []
    with dist_autograd.context() as cid:
        roots = list(rp.run_block(prog["main"], [], rp.DistRuntime()))
        rp._drain(world)
        obs["roots"] = [_enc(t) for t in roots]
        for k, retain in enumerate(pass_plan(prog)):
            for to in workers:
                rpc.rpc_sync(to, set_pass, args=(k,))
            for to in targets:
                rpc.rpc_sync(to, set_anomaly, args=(True,))
            try:
                err, ops = one_pass(dist_autograd, cid, roots, retain, prog.get("mode"), timeout)
            finally:
                if not (err or {}).get("hang"):
                    for to in targets:
                        rpc.rpc_sync(to, set_anomaly, args=(False,))
            rec: dict = {"retain": retain, "error": err}
            if ops is not None:
                rec["ops"] = ops
            if err is None:
                grads, unknown = rp._gather_grads(cid, world)
                rec["grads"] = {f"{w}:{n}": _enc(g) for (w, n), g in sorted(grads.items())}
                rec["unknown"] = sorted(unknown)
            obs["passes"].append(rec)
            if err is not None:
                time.sleep(SETTLE)   # the other workers' share may still run a while
                break       # what a failed pass left is timing; later passes are not run
    if any((p["error"] or {}).get("hang") for p in obs["passes"]):
        obs["hang"] = True
        return obs
    obs["events"] = {str(w): rpc.rpc_sync(to, take_events) for w, to in enumerate(workers)}
    counts: dict = {}
    for to in workers:
        for tag, c in rpc.rpc_sync(to, rp._take_counts).items():
            counts[tag] = counts.get(tag, 0) + c
    obs["counts"] = counts
    if rp.IMPL == "torch":
        obs["distgrad_loaded"] = sorted({m for to in workers for m in rpc.rpc_sync(to, loaded_distgrad)})
    return obs


# ---------------------------------------------------------------------------------------
# clusters: one of torch's and one of distgrad's, each serving programs from the parent
# ---------------------------------------------------------------------------------------
def _worker(rank: int, world: int, impl: str, port: int, inq, outq) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DISTGRAD_SECRET", SECRET)
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    import random_programs as rp
    rp.IMPL = impl
    rpc = rp.dist_modules()[0]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT,
                                           num_worker_threads=16)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        outq.put(("ready", None))
        while True:
            item = inq.get()
            if item is None:
                break
            key, prog, timeout = item
            try:
                obs = observe(prog, timeout)
            except Exception as e:  # noqa: BLE001 - the parent reports it
                obs = {"crash": f"{type(e).__name__}: {e}"[:1000] + "\n" + traceback.format_exc()[-3000:]}
            outq.put((key, json.dumps(obs)))
            if obs.get("hang"):
                time.sleep(0.5)
                os._exit(3)     # a pass is still in flight: the parent starts a new cluster
    rpc.shutdown()


class Cluster:
    """``world`` spawned workers of ``impl`` ("torch" or "distgrad") serving programs."""

    def __init__(self, impl: str, world: int, log=print) -> None:
        self.impl, self.world, self.log = impl, world, log
        self.procs: list = []
        self.n = 0

    def _start(self) -> None:
        from mp_utils import free_port
        ctx = mp.get_context("spawn")
        self.inq, self.outq = ctx.Queue(), ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, self.impl, port, self.inq, self.outq),
                                  daemon=True, name=f"round3-{self.impl}-{r}") for r in range(self.world)]
        # (torch's C++ warnings of every failed pass, e.g. anomaly mode's, are noise here)
        old = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            for p in self.procs:
                p.start()
        finally:
            if old is None:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = old
        got = self._get(START_TIMEOUT)
        if got is None or got[0] != "ready":
            self.kill()
            raise RuntimeError(f"a {self.world}-worker {self.impl} cluster did not start: {got}")

    def _get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.outq.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    try:
                        return self.outq.get(timeout=2.0)
                    except queue.Empty:
                        return ("died", [p.exitcode for p in self.procs])
        return ("timeout", timeout)

    def run(self, prog: dict, backward_timeout: float = BACKWARD_TIMEOUT) -> dict:
        """``prog``'s observations on this cluster (started on demand; a new one after a
        hang or a crash): a dict, with "hang" or "crash" when it went wrong."""
        if not self.procs:
            self._start()
        self.n += 1
        key = self.n
        self.inq.put((key, prog, backward_timeout))
        budget = 120.0 + 4 * backward_timeout
        got = self._get(budget)
        if got[0] == key:
            obs = json.loads(got[1])
            if obs.get("hang"):
                self.kill()
            return obs
        self.kill()
        if got[0] == "timeout":
            return {"hang": True, "crash": f"no answer within {budget:g} s (the {self.impl} cluster froze)"}
        return {"crash": f"the {self.impl} cluster died: {got}"}

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        self.procs = []

    def close(self) -> None:
        if not self.procs:
            return
        self.inq.put(None)     # a graceful shutdown, briefly (torch's can wait 30 s after
        deadline = time.monotonic() + 10.0   # a failed pass): then the workers are killed
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()


# ---------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------
# ops a TorchDispatchMode around torch's own distributed backward sees in some runs of a
# program and not in others (measured: the same program, twice on torch): a gradient
# copied or stolen at accumulation (clone: new_empty_strided + copy_), a detach, a
# received message's tensors rebuilt (empty + set_) on a thread under the pass's state
TIMING_OPS = {"aten.copy_.default", "aten.new_empty_strided.default", "aten.detach.default",
              "aten.empty.memory_format", "aten.set_.source_Storage"}
TOL = {"float64": (1e-9, 1e-10), "float32": (1e-5, 1e-6), "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2)}


def _close(a: dict, b: dict) -> bool:
    if a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
        return False
    rtol, atol = TOL.get(a["dtype"], (1e-9, 1e-10))
    x = torch.tensor(a["v"], dtype=torch.float64)
    y = torch.tensor(b["v"], dtype=torch.float64)
    return bool(torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True))


def _err_same(a, b) -> bool:
    """Both none, or distgrad's an instance of torch's type (a subclass: distgrad's
    BackwardError is a RuntimeError, docs/compatibility.md) saying the same things."""
    if a is None or b is None:
        return a is b
    return a["type"] in b["mro"] and a["keys"] == b["keys"]


def _err_text(e) -> str:
    return "none" if e is None else f"{e['type']} ({', '.join(e['keys']) or e.get('text', '')[:120]})"


def compare(want: dict, got: dict) -> list:
    """(kind, detail) for everything torch's run (``want``) and distgrad's (``got``) do
    not show alike."""
    issues = []
    if got.get("hang"):
        return [("hang", got.get("crash") or "a pass did not return")]
    if got.get("crash"):
        return [("error", got["crash"])]
    wr, gr = want["roots"], got["roots"]
    if len(wr) != len(gr) or not all(_close(a, b) for a, b in zip(wr, gr)):
        issues.append(("forward value", f"roots {[r['v'] for r in gr]} != torch's {[r['v'] for r in wr]}"))
    failed = False
    for k, (a, b) in enumerate(zip(want["passes"], got["passes"])):
        where = f"pass {k + 1} (retain_graph={a['retain']})"
        if not _err_same(a["error"], b["error"]):
            kind = "error presence" if (a["error"] is None) != (b["error"] is None) else "error type"
            issues.append((kind, f"{where}: distgrad {_err_text(b['error'])}, torch {_err_text(a['error'])}"
                                 + (f"\n    distgrad's error: {b['error'].get('text')}" if b["error"] else "")
                                 + (f"\n    torch's error: {a['error'].get('text')}" if a["error"] else "")))
        if a["error"] is not None or b["error"] is not None:
            failed = True
            break
        wo, go = (set(x.get("ops") or []) - TIMING_OPS for x in (a, b))
        if wo != go:
            issues.append(("mode ops", f"{where}: the mode around backward saw, beyond torch's: "
                                       f"{sorted(go - wo)}; not: {sorted(wo - go)}"))
        issues += _compare_grads(a, b, where)
    if not failed and len(want["passes"]) != len(got["passes"]):
        issues.append(("passes", f"distgrad ran {len(got['passes'])} passes, torch {len(want['passes'])}"))
    ok_passes = {k for k, (a, b) in enumerate(zip(want["passes"], got["passes"]))
                 if a["error"] is None and b["error"] is None}
    for w in sorted(set(want["events"]) | set(got["events"]), key=int):
        ev_w = _events(want["events"].get(w, []), ok_passes)
        ev_g = _events(got["events"].get(w, []), ok_passes)
        if ev_w != ev_g:
            extra = sorted((ev_g - ev_w).elements())
            missing = sorted((ev_w - ev_g).elements())
            issues.append(("hook events", f"worker{w}: beyond torch's: {extra}; not: {missing}"))
    if not failed and want["counts"] != got["counts"]:
        issues.append(("node run count", f"distgrad {got['counts']}, torch {want['counts']}"))
    return issues


def _events(evs: list, passes: set) -> collections.Counter:
    return collections.Counter(json.dumps([k, tag.split(".", 1)[-1], kind, rec], sort_keys=True)
                               for k, tag, kind, rec in evs if k in passes)


def _compare_grads(a: dict, b: dict, where: str) -> list:
    issues = []
    wg, gg = a["grads"], b["grads"]
    for key in sorted(set(wg) | set(gg)):
        w, name = key.split(":", 1)
        label = f"{where}: leaf {name.split('.', 1)[-1]} on worker{w}"
        x, y = wg.get(key), gg.get(key)
        if x is None:
            issues.append(("unexpected grad", f"{label}: {y['dtype']} {y['v']}, torch's context has none"))
        elif y is None:
            issues.append(("missing grad", f"{label}: none, torch has {x['dtype']} {x['v']}"))
        elif x["dtype"] != y["dtype"]:
            issues.append(("grad dtype", f"{label}: {y['dtype']}, torch {x['dtype']}"))
        elif not _close(x, y):
            issues.append(("grad value", f"{label}: {y['v']} != torch's {x['v']}"))
    if a["unknown"] != b["unknown"]:
        issues.append(("grad for a non-leaf", f"{where}: distgrad {b['unknown']}, torch {a['unknown']}"))
    return issues


# ---------------------------------------------------------------------------------------
# checking, shrinking, running seeds
# ---------------------------------------------------------------------------------------
class Pair:
    """A torch cluster and a distgrad cluster of one world size."""

    def __init__(self, world: int, log=print) -> None:
        self.world = world
        self.torch = Cluster("torch", world, log)
        self.distgrad = Cluster("distgrad", world, log)

    def close(self) -> None:
        self.torch.close()
        self.distgrad.close()


def check(prog: dict, pair: Pair, backward_timeout: float = BACKWARD_TIMEOUT, want=None) -> dict:
    """Run ``prog`` on both clusters and compare: a record as random_programs' (``want``:
    torch's observations when already known)."""
    import random_programs as rp
    rec = {"seed": prog["seed"], "world": prog["world"], "size": rp.size(prog), "ok": False}
    if prog.get("unsafe"):
        rec.update(group="GENERATOR: no torch-safe program", detail="no attempt reached every send")
        return rec
    if want is None:
        want = pair.torch.run(prog, backward_timeout)
        if want.get("hang") or want.get("crash"):   # torch's own run failed (it segfaulted
            rec["torch_retried"] = str(want.get("crash") or "hang")[:300]   # once in ~300)
            want = pair.torch.run(prog, backward_timeout)
    rec["torch"] = want
    rec["exercised"] = sorted(exercised(prog, want))
    if want.get("hang") or want.get("crash"):
        rec.update(group="REFERENCE: torch's run " + ("hung" if want.get("hang") else "failed"),
                   detail=str(want.get("crash") or want))
        return rec
    if want.get("distgrad_loaded"):
        rec.update(group="REFERENCE: torch's workers imported distgrad", detail=str(want["distgrad_loaded"]))
        return rec
    got = pair.distgrad.run(prog, backward_timeout)
    rec["distgrad"] = got
    issues = compare(want, got)
    if issues:
        kinds = sorted({k for k, _ in issues})
        rec.update(group="differs from torch: " + ", ".join(kinds),
                   detail="\n".join(f"{k}: {d}" for k, d in issues))
    else:
        rec["ok"] = True
    return rec


def prune(prog: dict) -> dict:
    """``prog`` without ops whose results nothing uses and without the outputs of
    rpc_sync-like calls that nothing uses (and the values their blocks return for
    them): a variant that dropped the last use of a call's result is torch-safe again
    once the callee no longer sends it."""
    import copy

    import random_programs as rp
    p = copy.deepcopy(prog)
    changed = True
    while changed:
        changed = False
        blocks = list(rp._all_blocks(p["main"]))
        used = set(p["roots"]) | {u for b in blocks for ins in b["body"] for u in rp._uses(ins)}
        used |= {r for b in blocks for r in b["returns"]}
        for b in blocks:
            dead = [ins for ins in b["body"] if ins[0] in ("op", "multi", "module")
                    and not any(d in used for d in rp._defs(ins))]
            if dead:        # ops whose results nothing uses (a bypassed use left them)
                b["body"] = [ins for ins in b["body"] if not any(ins is d for d in dead)]
                changed = True
        for b in blocks:
            for i, ins in enumerate(b["body"]):
                if ins[0] != "call" or all(o in used for o in ins[1]):
                    continue
                keep = [k for k, o in enumerate(ins[1]) if o in used]
                sub = ins[3]
                sub["returns"] = [sub["returns"][k] for k in keep]
                b["body"][i] = ("call", [ins[1][k] for k in keep], ins[2], sub)
                changed = True
        for b in blocks[1:]:     # arguments a block no longer uses are not sent
            inner = {u for ins in b["body"] for u in rp._uses(ins)} | set(b["returns"])
            if any(x not in inner for x in b["params"]):
                b["params"] = [x for x in b["params"] if x in inner]
                changed = True
    return p


def candidates(prog: dict):
    """random_programs' shrink candidates and this round's, each made torch-safe by
    :func:`prune` where it can be; torch-safe ones only."""
    import random_programs as rp
    for cand in list(strip(prog)) + list(rp._candidates(prog)):
        try:
            pruned = prune(cand)
            for c in ([pruned] if pruned != cand else []) + [cand]:
                if torch_safe(c):
                    yield c
                    break
        except Exception:  # noqa: BLE001 - an invalid variant: not a candidate
            continue


def shrink(prog: dict, group: str, pair: Pair, budget_s: float = 300.0, max_tries: int = 200) -> tuple:
    """Greedy: keep any smaller torch-safe variant that differs in the same group."""
    best, best_rec = prog, None
    deadline = time.monotonic() + budget_s
    tries = 0
    seen: set = set()
    progress = True
    while progress and time.monotonic() < deadline and tries < max_tries:
        progress = False
        for cand in candidates(best):
            if time.monotonic() > deadline or tries >= max_tries:
                break
            key = json.dumps(cand, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            tries += 1
            rec = check(cand, pair, backward_timeout=25.0)
            if not rec["ok"] and rec["group"] == group:
                best, best_rec, progress = cand, rec, True
                break
    return best, best_rec


def run_seeds(world: int, seeds: list, weights: dict, shrink_n: int = 0, shrink_budget: float = 300.0,
              log=print, backward_timeout: float = BACKWARD_TIMEOUT) -> list:
    """Every seed's program on a torch and a distgrad cluster of ``world`` workers."""
    import random_programs as rp
    pair = Pair(world, log)
    records = []
    shrunk: collections.Counter = collections.Counter()
    try:
        for seed in seeds:
            prog = generate(seed, world, weights)
            t0 = time.monotonic()
            rec = check(prog, pair, backward_timeout)
            rec["seconds"] = round(time.monotonic() - t0, 1)
            rec["features"] = sorted(rp.features(prog))
            if not rec["ok"]:
                rec["dump"] = rp.dump(prog)
                log(f"  FAIL seed {seed} world {world}: {rec['group']}")
                mine = not rec["group"].startswith(("GENERATOR", "REFERENCE"))
                if mine and shrunk[rec["group"]] < shrink_n:
                    shrunk[rec["group"]] += 1
                    small, small_rec = shrink(prog, rec["group"], pair, shrink_budget)
                    if small_rec is not None:
                        rec["shrunk"] = rp.dump(small)
                        rec["shrunk_size"] = rp.size(small)
                        rec["shrunk_detail"] = small_rec["detail"]
                        rec["shrunk_program"] = small
            records.append(rec)
    finally:
        pair.close()
    return records

