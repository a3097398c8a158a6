"""The random programs' second round of combinations (issue 34; part of tests/random_programs.py).

Each drawn per program like the others (FEATURE_WEIGHTS); each checked by torch's
distributed autograd's own rule, stated where it is checked::

    ("chain", [out, ...], futA, futB, kind)
        two rpc_asyncs to one worker whose bodies meet (each signals the other, then
        waits), so their replies leave back to back, often read in one read; then
        ``futA.then(lambda f: f.value() + futB.wait())`` (kind "then") or the same in
        ``futA.add_done_callback`` (kind "callback"): a reply's callback that waits
        for another reply. torch completes every reply as a task of its own, so the
        chain completes; its values are both calls' returns
    ("post_acc", leaf)
        ``leaf.register_post_accumulate_grad_hook`` counting its calls: torch's
        distributed engine never runs AccumulateGrad, so only the plain backward()
        calls of that worker's plain thread (prog["plain"]) may call it
    prog["watch"] = True
        while the passes (and the plain threads) run, a thread on every worker watches
        every leaf's ``.grad``: under torch it is None until a plain backward() first
        accumulates, then one tensor added into in place. Another tensor, or None
        after a value, is something torch never shows
    prog["keep_between"] = True  (with prog["retain"]: two passes in one context)
        after the first pass, every worker keeps the tensors ``get_gradients`` gave;
        after the second, each must be the very tensor the context holds, added into
        in place (torch's ``accumulateGrad``: ``variable_grad += new_grad``), unless a
        sparse one met a dense one (then torch makes a new tensor)
    ("op", out, "embed", [leaf], {"idx"})  (feature "sparse")
        ``embedding(idx, leaf, sparse=True)``: sparse gradients, local and received

The checks report through :func:`issues_here` (gathered by ``random_threads.run_passes``).
"""
from __future__ import annotations

import threading
import time

import torch

CHAIN_TIMEOUT = 30.0     # s a chained future may take (a callback that never completes: a hang)
WATCH_PAUSE = 0.0002     # s between two looks of the watcher
ROUND2_FEATURES = ("chain", "post_acc", "watch", "keep_between")
EMBED_ROWS = (3, 5)      # rows of an embedding leaf


# -- runtime pieces ---------------------------------------------------------------------
def chain_dist(fa, fb, kind: str) -> tuple:
    """("chain", ...) in a distributed run: a callback of ``fa`` waits for ``fb``."""
    import random_programs as rp
    box: dict = {}
    done = threading.Event()

    def both(f):
        return tuple(f.value()) + tuple(fb.wait())

    if kind == "then":
        chained = fa.then(both)

        def finish(f):
            try:
                box["value"] = f.value()
            except BaseException as e:  # noqa: BLE001 - raised below
                box["error"] = e
            done.set()
        chained.add_done_callback(finish)
    else:
        def callback(f):
            try:
                box["value"] = both(f)
            except BaseException as e:  # noqa: BLE001 - raised below
                box["error"] = e
            done.set()
        fa.add_done_callback(callback)
    if not done.wait(CHAIN_TIMEOUT):
        raise rp.Hang(f"a reply's callback that waits for another reply ({kind}) did not complete "
                      f"within {CHAIN_TIMEOUT:g} s (hang)")
    if "error" in box:
        raise box["error"]
    return tuple(box["value"])


def chain_local(rt, fa, fb) -> tuple:
    """("chain", ...) in the local interpreter: both calls' returns."""
    return tuple(rt.wait(fa)) + tuple(rt.wait(fb))


def register_post_acc(state, name: str, t: torch.Tensor) -> None:
    """("post_acc", leaf) in a distributed run: a counting hook, once per leaf."""
    with state.lock:
        if name in state.post_acc:
            return
        state.post_acc[name] = 0

    def hook(_t):
        with state.lock:
            state.post_acc[name] += 1
    t.register_post_accumulate_grad_hook(hook)


class Watcher:
    """A thread that looks at every leaf's ``.grad`` of this worker until stopped and
    notes what torch would never show (see the module's docstring). ``none_only``:
    nothing may ever give a ``.grad`` (no plain backward() runs)."""

    def __init__(self, state, none_only: bool = False) -> None:
        self.state, self.none_only = state, none_only
        self.first: dict = {}
        self.problems: list = []
        self.looks = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="random-programs-watch")
        self.thread.start()

    def _loop(self) -> None:
        first, problems = self.first, self.problems
        while not self.stopping.is_set():
            with self.state.lock:
                leaves = [(n, t) for n, t in self.state.leaves.items() if t.requires_grad]
            for name, t in leaves:
                g = t.grad
                seen = first.get(name)
                if seen is None:
                    if g is not None:
                        first[name] = g
                        if self.none_only:
                            problems.append(f".grad of {name} was set during a distributed backward")
                elif g is not seen and len(problems) < 20:
                    problems.append(f".grad of {name} was " + ("None" if g is None else "another tensor")
                                    + " after a plain backward() gave it one")
                del g
            self.looks += 1
            time.sleep(WATCH_PAUSE)

    def stop(self) -> list:
        """Stop; what it saw that torch would not show (also a .grad replaced since)."""
        self.stopping.set()
        self.thread.join(30)
        with self.state.lock:
            leaves = dict(self.state.leaves)
        for name, g in self.first.items():
            t = leaves.get(name)
            if t is not None and t.grad is not g:
                self.problems.append(f".grad of {name} is not the tensor it was once set")
        if not self.looks:
            self.problems.append("the .grad watcher never looked")
        return self.problems


def keep_gradients(state, cid: int) -> None:
    """After the first of two passes: keep the tensors ``get_gradients`` gives."""
    import distgrad.autograd as dist_autograd
    try:
        grads = dist_autograd.get_gradients(cid)
    except RuntimeError as e:
        if "Could not find autograd context" not in str(e):
            raise
        grads = {}
    names = {id(t): n for n, t in state.leaves.items()}
    with state.lock:
        state.kept_between[cid] = {names[id(t)]: g for t, g in grads.items() if id(t) in names}


def check_kept(state, cid: int) -> None:
    """After the second pass: each kept tensor is the one the context holds (torch adds
    into it in place), unless a sparse one met a dense one."""
    import distgrad.autograd as dist_autograd
    with state.lock:
        kept = state.kept_between.pop(cid, {})
    if not kept:
        return
    grads = dist_autograd.get_gradients(cid)
    now = {n: grads.get(t) for n, t in state.leaves.items() if t in grads}
    for name, g in sorted(kept.items()):
        cur = now.get(name)
        if cur is None:
            state.round2.append(f"kept gradient: {name} has no gradient after the second pass")
        elif g.is_sparse and not cur.is_sparse:
            continue  # torch: sparse + dense is a new (dense) tensor
        elif cur is not g:
            state.round2.append(f"kept gradient: the tensor get_gradients gave for {name} after the "
                                f"first pass is not the context's after the second (torch adds into "
                                f"it in place)")


# -- worker-side RPC targets ------------------------------------------------------------
def _state():
    from random_programs import STATE
    return STATE


def watch_start() -> None:
    _state().watcher = Watcher(_state())


def watch_stop() -> None:
    st = _state()
    w, st.watcher = st.watcher, None
    if w is not None:
        st.round2.extend(w.stop())


def keep_now(cid: int) -> None:
    keep_gradients(_state(), cid)


def kept_check(cid: int) -> None:
    check_kept(_state(), cid)


def issues_here() -> tuple:
    """(problems noted on this worker, {leaf: post-accumulate-grad hook calls})."""
    st = _state()
    with st.lock:
        out, st.round2 = list(st.round2), []
        return out, dict(st.post_acc)


def expected_post_acc(prog: dict, worker: int, name: str, plain_counts: dict) -> int:
    """The calls torch would make of ("post_acc", leaf) hooks: one per plain backward()
    of this worker's plain thread when the leaf is one of its leaves, else none."""
    for spec in prog.get("plain", []):
        if spec["worker"] == worker and name in spec["leaves"]:
            return plain_counts.get(worker, 0)
    return 0


# -- the generator's pieces -------------------------------------------------------------
def g_chain(gen, b) -> None:
    """Two rpc_asyncs to one worker whose bodies meet, then a callback of the first that
    waits for the second."""
    r = gen.rnd
    w = r.randrange(gen.world)
    ka, kb = gen.name("rv"), gen.name("rv")
    gen.g_call(b, target=w, mode="async", inject=[("signal", kb, w), ("wait_for", ka)])
    fa = b.pending[-1]
    gen.g_call(b, target=w, mode="async", inject=[("signal", ka, w), ("wait_for", kb)])
    fb = b.pending[-1]
    b.pending.remove(fa)
    b.pending.remove(fb)
    outs = gen.outs_for(gen.meta[fa][1] + gen.meta[fb][1])
    gen.emit(b, ("chain", outs, fa, fb, r.choice(["then", "callback"])), *outs)


def g_post_acc(gen, b) -> None:
    """A counting post-accumulate-grad hook on a leaf of this block."""
    gen.emit(b, ("post_acc", gen.rnd.choice(b.leaves)))


def g_sparse(gen, b) -> None:
    """embedding(idx, leaf, sparse=True) over a 2-D leaf (a new one when none fits)."""
    r = gen.rnd
    two = [x for x in b.leaves if len(gen.shape(x)) == 2 and gen.shape(x)[0] >= EMBED_ROWS[0]]
    if two and r.random() < 0.6:
        x = r.choice(two)
    else:
        x = gen.g_leaf(b, (r.randint(*EMBED_ROWS), r.randint(1, 4)), kind=r.choice(["leaf", "param"]))
    n, m = gen.shape(x)
    idx = [r.randrange(n) for _ in range(r.randint(1, 4))]
    gen.op(b, "embed", [x], {"idx": idx}, (len(idx), m))


def program_extras(gen) -> dict:
    """The program-level features of this round drawn for ``gen``."""
    out = {}
    if "watch" in gen.on:
        out["watch"] = True
    if "keep_between" in gen.on:
        out["keep_between"] = True
    return out


def static_features(prog: dict, instructions) -> set:
    """features() for this round (``instructions``: (worker, instruction) pairs)."""
    f = set()
    ops = {ins[0] for _, ins in instructions}
    if "chain" in ops:
        f.add("reply callback waits for another reply")
    if "post_acc" in ops:
        f.add("post-accumulate-grad hook")
    if prog.get("watch"):
        f.add(".grad watched during the passes")
    if prog.get("keep_between") and prog.get("retain"):
        f.add("gradients kept between two passes")
    if any(ins[0] == "op" and ins[2] == "embed" for _, ins in instructions):
        f.add("sparse gradient (embedding)")
    return f


FEATURES = ["reply callback waits for another reply", "post-accumulate-grad hook",
            ".grad watched during the passes", "gradients kept between two passes",
            "sparse gradient (embedding)"]


def dump_line(ins) -> str:
    """dump()'s line for a chain or post_acc instruction."""
    if ins[0] == "chain":
        _, outs, fa, fb, kind = ins
        how = "then(lambda f: f.value() + r{}.wait())" if kind == "then" else \
            "add_done_callback(lambda f: f.value() + r{}.wait())"
        return f"{', '.join(f'r{o}' for o in outs) or '_'} = r{fa}.{how.format(fb)}"
    return f"r{ins[1]}.register_post_accumulate_grad_hook(count calls)"
