"""The random programs' threads (issue 26; part of tests/random_programs.py).

Four features, each drawn per program like those of issue 18 (FEATURE_WEIGHTS)::

    prog["plain"] = [{"worker", "leaves": [name, ...], "w"}, ...]
        while the distributed passes run, a thread on ``worker`` loops a plain
        ``backward()`` over those leaves (shared with the program); afterwards each
        leaf's ``.grad`` must hold exactly what that many plain calls accumulate in
        local autograd (the reference gives one call's gradient), every other leaf's
        ``.grad`` stays None: the distributed passes never touch ``.grad``
    ("plain_hook", leaf)
        a hook on ``leaf`` that, when the pass reaches it, has its worker's plain
        thread (whose leaves include it) make one more call and waits for it: a plain
        backward() certainly accumulates into the leaf while the pass is about to
        (local autograd: no hook)
    prog["twice"] = True
        the forward runs twice (one after the other, each in its own context, over
        the same parameters), then both backward passes run at once on two threads;
        each context must hold what local autograd gives for its pass
    ("keep", reg, {"op"})
        a hook on ``reg`` keeps the gradient it is given; after the passes every kept
        gradient is changed in place (x3, zeroed or +1) before the contexts are read:
        they must hold the values the passes accumulated
    ("signal", key, worker) / ("wait_for", key)
        two rpc_asyncs in flight at once that wait on each other: each body signals
        the other's key (an RPC when the other runs elsewhere), then waits for its own
        (a missing signal within RENDEZVOUS_TIMEOUT is an error, not a hang); local
        autograd runs such bodies on threads

This module holds the runtime pieces (both interpreters), the generator's pieces, the
distributed run (:func:`run_passes`) and the ``.grad`` oracle (:func:`compare_dotgrad`).
"""
from __future__ import annotations

import threading

import torch

RENDEZVOUS_TIMEOUT = 20.0   # s a body waits for its partner's signal
PLAIN_PAUSE = 0.001         # s between two plain backward() calls (unless a hook asks)
PLAIN_WAIT = 10.0           # s a ("plain_hook", reg) hook waits for its plain call
PHASE_TIMEOUT = 300.0       # s the passes' threads wait for each other (forwards may compile)
THREAD_FEATURES = ("plain_thread", "two_passes", "keep_grad", "rendezvous")
KEEP_OPS = ("mul", "zero", "add")


# -- runtime pieces ------------------------------------------------------------------
def keeper(kept: list, op: str):
    """The hook of ("keep", reg, {"op"}): keeps each gradient it is given (and returns
    None: the gradient goes on unchanged)."""
    def hook(g):
        if g is not None:
            kept.append((g, op))
    return hook


def plain_hook(state):
    """The hook of ("plain_hook", reg) in a distributed run: one plain backward() on
    this worker's plain thread (when one runs), waited for; the gradient goes on."""
    def hook(g):
        plain = state.plain
        if plain is not None and threading.current_thread() is not plain.thread:
            plain.call_now()   # (the plain thread's own calls pass through)
    return hook


def mutate_kept(kept: list) -> int:
    """Change every kept gradient in place (after the passes); how many could be (an
    expanded gradient, several elements on one memory location, cannot)."""
    n = 0
    with torch.no_grad():
        for g, op in kept:
            try:
                if op == "mul":
                    g.mul_(3.0)
                elif op == "zero":
                    g.zero_()
                elif g.is_sparse:   # (a sparse tensor adds no scalar: its values do)
                    g._values().add_(1.0)
                else:
                    g.add_(1.0)
                n += 1
            except RuntimeError as e:
                if "single memory location" not in str(e):
                    raise
    kept.clear()
    return n


def wait_for(event: threading.Event, key: str) -> None:
    """("wait_for", key): block until the partner body signals ``key``."""
    if not event.wait(RENDEZVOUS_TIMEOUT):
        raise RuntimeError(f"rendezvous {key}: the partner call never signalled within "
                           f"{RENDEZVOUS_TIMEOUT:g} s (both calls must run at once)")


def waits(block: dict) -> bool:
    """Whether ``block``'s body waits for a partner (it must run on its own thread)."""
    return any(ins[0] in ("wait_for", "signal") for ins in block["body"])


class LocalFuture:
    """The local interpreter's rpc_async of a body that waits on another one: a thread
    (grad mode as the caller's)."""

    def __init__(self, fn) -> None:
        self.box: dict = {}
        grad = torch.is_grad_enabled()

        def run():
            try:
                with torch.set_grad_enabled(grad):
                    self.box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                self.box["error"] = e
        self.thread = threading.Thread(target=run, daemon=True, name="random-programs-local-async")
        self.thread.start()

    def wait(self):
        self.thread.join(3 * RENDEZVOUS_TIMEOUT)
        if self.thread.is_alive():
            raise RuntimeError("a local rpc_async body never finished")
        if "error" in self.box:
            raise self.box["error"]
        return self.box["value"]


def plain_loss(spec: dict, leaves: list) -> torch.Tensor:
    """The plain thread's loss over ``leaves``: sum of tanh(leaf) . fixed weights."""
    from random_programs import _named_randn
    total = None
    for i, t in enumerate(leaves):
        term = (t.tanh() * _named_randn(f"{spec['w']}.{i}", tuple(t.shape))).sum()
        total = term if total is None else total + term
    return total


def _spec_leaves(spec: dict, leaves: dict) -> list:
    return [(n, leaves[n]) for n in spec["leaves"] if n in leaves]


def plain_reference(prog: dict, rt) -> dict:
    """{(worker, leaf name): .grad after one plain backward()} for prog["plain"] (local
    interpreter, after the forwards; the leaves' .grad are reset after)."""
    out = {}
    for spec in prog.get("plain", []):
        named = _spec_leaves(spec, rt.state(spec["worker"]).leaves)
        if not named:
            continue
        plain_loss(spec, [t for _, t in named]).backward()
        for n, t in named:
            out[(spec["worker"], n)] = t.grad
            t.grad = None
    return out


class PlainThread:
    """A plain backward() loop over some of this worker's leaves, from start to stop
    (at least one call); :meth:`call_now` has it make one more call at once."""

    def __init__(self, spec: dict, leaves: dict) -> None:
        self.leaves = [t for _, t in _spec_leaves(spec, leaves)]
        self.spec, self.count, self.error = spec, 0, None
        self.stopping, self.wake = threading.Event(), threading.Event()
        self.requests: list = []      # events of call_now()s the next call answers
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="random-programs-plain")
        self.thread.start()

    def _loop(self) -> None:
        try:
            while self.leaves:
                with self.lock:
                    answered, self.requests = self.requests, []
                    self.wake.clear()
                plain_loss(self.spec, self.leaves).backward()
                self.count += 1
                for done in answered:
                    done.set()
                if self.stopping.is_set() and not self.requests:
                    return
                self.wake.wait(PLAIN_PAUSE)
        except BaseException as e:  # noqa: BLE001 - reported by stop() and call_now()
            self.error = f"{type(e).__name__}: {e}"
            with self.lock:
                for done in self.requests:
                    done.set()

    def call_now(self) -> None:
        """Have the loop make one plain backward() call that starts after this one
        began, and wait for it (a hook of a pass calls it)."""
        done = threading.Event()
        with self.lock:
            self.requests.append(done)
            self.wake.set()
        if not done.wait(PLAIN_WAIT):
            raise RuntimeError(f"a plain backward() on another thread did not finish within "
                               f"{PLAIN_WAIT:g} s while a hook of the pass waited for it")
        if self.error:
            raise RuntimeError(f"plain backward() on another thread failed: {self.error}")

    def stop(self) -> int:
        """Stop the loop; the number of plain backward() calls it made."""
        self.stopping.set()
        self.thread.join(30)
        if self.thread.is_alive():
            raise RuntimeError("the plain backward() thread did not stop within 30 s")
        if self.error:
            raise RuntimeError(f"plain backward() on another thread failed: {self.error}")
        return self.count


def accumulated(g: torch.Tensor, n: int):
    """What ``n`` plain backward() calls leave in ``.grad``: the first assigns ``g``,
    each later one adds it (as AccumulateGrad does)."""
    if n == 0:
        return None
    acc = g.clone()
    for _ in range(n - 1):
        acc += g
    return acc


def compare_dotgrad(want: dict, got: dict) -> list:
    """(kind, detail) for every leaf whose ``.grad`` is not what the plain calls
    accumulated (None where no plain call touched it)."""
    issues = []
    plain, counts = want.get("plain", {}), got.get("plain_counts", {})
    for (w, name), g in sorted(got["dotgrad"].items()):
        ref = plain.get((w, name))
        n = counts.get(w, 0) if ref is not None else 0
        expect = accumulated(ref, n) if ref is not None else None
        label = f"leaf {name.split('.', 1)[1]} on worker{w}"
        if expect is None:
            if g is not None:
                issues.append((".grad written", f"{label}: .grad is {g.tolist()}, expected None (no plain "
                                                 f"backward() touched it)"))
        elif g is None:
            issues.append((".grad lost", f"{label}: .grad is None after {n} plain backward() calls"))
        elif g.shape != expect.shape or not torch.equal(g, expect):
            issues.append((".grad value", f"{label}: after {n} plain backward() calls .grad is "
                                          f"{g.tolist()}, local autograd accumulates {expect.tolist()}"))
    return issues


# -- the generator's pieces ------------------------------------------------------------
def g_keep(gen, b) -> None:
    """A hook that keeps the gradient of an intermediate or a leaf, changed later."""
    r = gen.rnd
    x = r.choice(gen.own_rg(b) + b.leaves)
    gen.emit(b, ("keep", x, {"op": r.choice(KEEP_OPS)}))
    if x in gen.leaf_names:
        gen.kept_leaves.add(gen.leaf_names[x])


def g_plain_hook(gen, b) -> None:
    """A hook on a leaf of this block that has this worker's plain thread (over that
    leaf) run a call while the pass waits in it: right before the pass accumulates
    the leaf's gradient, a plain backward() accumulates into the same leaf."""
    x = gen.rnd.choice(b.leaves)
    gen.emit(b, ("plain_hook", x))
    gen.plain_hooks.setdefault(b.worker, set()).add(gen.leaf_names[x])


def g_rendezvous(gen, b) -> None:
    """Two rpc_asyncs whose bodies wait on each other (both waited later)."""
    r = gen.rnd
    ka, kb = gen.name("rv"), gen.name("rv")
    wa, wb = r.randrange(gen.world), r.randrange(gen.world)
    gen.g_call(b, target=wa, mode="async", inject=[("signal", kb, wb), ("wait_for", ka)])
    gen.g_call(b, target=wb, mode="async", inject=[("signal", ka, wa), ("wait_for", kb)])


def inject(r, body: list, pair: list) -> None:
    """Insert ``pair``'s two instructions into ``body`` in order, at random places."""
    i = r.randint(0, len(body))
    body.insert(i, pair[0])
    body.insert(r.randint(i + 1, len(body)), pair[1])


def program_extras(gen) -> dict:
    """The program-level thread features drawn for ``gen`` ({} when none)."""
    r, out = gen.rnd, {}
    if "two_passes" in gen.on:
        out["twice"] = True
    if "plain_thread" in gen.on:
        cands = {w: sorted({n for n in names if n not in gen.kept_leaves})
                 for w, names in gen.grad_leaves.items()}
        workers = [w for w, names in cands.items() if names]
        # every worker with a plain_hook (over the leaves behind it), maybe one more
        chosen = [w for w in workers if w in gen.plain_hooks]
        others = [w for w in workers if w not in chosen]
        if others and (not chosen or r.random() < 0.5):
            chosen.append(r.choice(others))
        specs = []
        for w in chosen:
            behind = sorted(gen.plain_hooks.get(w, set()) & set(cands[w]))
            names = behind or r.sample(cands[w], min(len(cands[w]), r.randint(1, 4)))
            specs.append({"worker": w, "leaves": names, "w": gen.name("plainw")})
        if specs:
            out["plain"] = specs
    return out


def static_features(prog: dict, instructions) -> set:
    """features() for the thread features (``instructions``: (worker, instruction)
    for every instruction)."""
    f = set()
    if prog.get("plain"):
        f.add("plain backward() on another thread")
        hooked = {w for w, ins in instructions if ins[0] == "plain_hook"}
        if hooked & {s["worker"] for s in prog["plain"]}:
            f.add("plain backward() while a hook of the pass waits")
    if prog.get("twice"):
        f.add("two distributed passes at once")
    ops = {ins[0] for _, ins in instructions}
    if "keep" in ops:
        f.add("gradient kept by a hook, changed later")
    if "wait_for" in ops:
        f.add("calls waiting on each other")
    return f


FEATURES = ["plain backward() on another thread", "plain backward() while a hook of the pass waits",
            "two distributed passes at once",
            "gradient kept by a hook, changed later", "calls waiting on each other"]


def dump_line(ins) -> str:
    """dump()'s line for a keep / signal / wait_for instruction."""
    if ins[0] == "keep":
        return f"r{ins[1]}.register_hook(keep g; after the passes g.{ins[2]['op']}_ in place)"
    if ins[0] == "signal":
        return f"signal {ins[1]} on worker{ins[2]}"
    if ins[0] == "plain_hook":
        return f"r{ins[1]}.register_hook(one plain backward() on this worker's plain thread, waited)"
    return f"wait for {ins[1]}"


def strip(prog: dict) -> list:
    """Shrink candidates: ``prog`` without its plain thread, its second pass, its
    rendezvous (each alone)."""
    import copy
    out = []
    for key in ("plain", "twice"):
        if prog.get(key):
            p = copy.deepcopy(prog)
            del p[key]
            out.append(p)
    from random_programs import _all_blocks
    if any(i[0] in ("signal", "wait_for") for b in _all_blocks(prog["main"]) for i in b["body"]):
        p = copy.deepcopy(prog)
        for b in _all_blocks(p["main"]):
            b["body"] = [i for i in b["body"] if i[0] not in ("signal", "wait_for")]
        out.append(p)
    return out


def paired(prog: dict) -> bool:
    """Whether every key a body waits for is still signalled by some body (a shrink
    candidate that lost one half of a rendezvous would wait forever)."""
    from random_programs import _all_blocks
    sent, waited = set(), set()
    for b in _all_blocks(prog["main"]):
        for ins in b["body"]:
            if ins[0] == "signal":
                sent.add(ins[1])
            elif ins[0] == "wait_for":
                waited.add(ins[1])
    return waited <= sent


# -- worker-side helpers (RPC targets) -------------------------------------------------
def _state():
    from random_programs import STATE
    return STATE


def signal(key: str) -> None:
    """RPC target: set ``key``'s event on this worker."""
    _state().event(key).set()


def clear_events() -> None:
    """RPC target: forget the rendezvous of a previous forward."""
    with _state().lock:
        _state().events.clear()


def plain_start(spec: dict) -> None:
    """RPC target: start the plain backward() loop ``spec`` on this worker."""
    _state().plain = PlainThread(spec, _state().leaves)


def plain_stop() -> int:
    """RPC target: stop it; the number of calls it made."""
    st = _state()
    plain, st.plain = st.plain, None
    return plain.stop() if plain is not None else 0


def mutate_kept_here() -> int:
    """RPC target: change the gradients this worker's hooks kept."""
    return mutate_kept(_state().kept)


def dot_grads() -> dict:
    """RPC target: {leaf name: its .grad (a copy) or None} for this worker's leaves."""
    return {n: None if t.grad is None else t.grad.detach().clone()
            for n, t in _state().leaves.items() if t.requires_grad}


# -- the distributed run -----------------------------------------------------------------
def run_passes(prog: dict, backward_timeout: float) -> dict:
    """The program on the cluster (on worker0, inside init_rpc): its forward (twice,
    one after the other, with prog["twice"]), then its backward passes at once, each
    on its own thread in its own context, while prog["plain"]'s threads run plain
    backward() calls; then the kept gradients change; then every context's gradients,
    the counting nodes' runs and every leaf's ``.grad`` are read."""
    import random_programs as rp
    import random_round2 as rt_round2

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    world, n = prog["world"], 2 if prog.get("twice") else 1
    workers = [f"worker{w}" for w in range(world)]
    for to in workers:
        rpc.rpc_sync(to, rp._reset)
    phases = [threading.Barrier(n + 1) for _ in range(4)]
    forward_lock = threading.Lock()
    out: list = [None] * n
    errors: list = []

    def one(k: int) -> None:
        try:
            with dist_autograd.context() as cid:
                with forward_lock:          # the forwards one after the other
                    for to in workers:
                        rpc.rpc_sync(to, clear_events)
                    roots = list(rp.run_block(prog["main"], [], rp.DistRuntime()))
                    rp._drain(world)
                phases[0].wait(PHASE_TIMEOUT)   # every forward done
                phases[1].wait(PHASE_TIMEOUT)   # the plain threads run
                roots = rp._backward_all(cid, roots, prog, backward_timeout)
                phases[2].wait(PHASE_TIMEOUT)   # every backward done
                phases[3].wait(PHASE_TIMEOUT)   # the kept gradients changed
                grads, unknown = rp._gather_grads(cid, world)
            out[k] = {"roots": [t.detach() for t in roots], "grads": grads, "unknown": unknown}
        except BaseException as e:  # noqa: BLE001 - raised by the caller
            errors.append(e)
            for p in phases:
                p.abort()

    threads = [threading.Thread(target=one, args=(k,), daemon=True, name=f"random-programs-pass{k}")
               for k in range(n)]
    for t in threads:
        t.start()
    started: list = []
    watched: list = []
    counts: dict = {}
    try:
        phases[0].wait(PHASE_TIMEOUT)
        if prog.get("watch"):   # every .grad watched while the passes and plain threads run
            for to in workers:
                rpc.rpc_sync(to, rt_round2.watch_start)
                watched.append(to)
        for spec in prog.get("plain", []):
            rpc.rpc_sync(f"worker{spec['worker']}", plain_start, args=(spec,))
            started.append(spec["worker"])
        phases[1].wait(PHASE_TIMEOUT)
        phases[2].wait(PHASE_TIMEOUT)
        while started:
            w = started.pop()
            counts[w] = rpc.rpc_sync(f"worker{w}", plain_stop)
        while watched:
            rpc.rpc_sync(watched.pop(), rt_round2.watch_stop)
        for to in workers:
            rpc.rpc_sync(to, mutate_kept_here)
        phases[3].wait(PHASE_TIMEOUT)
    except threading.BrokenBarrierError:
        pass            # a pass failed: its error is raised below
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
        for p in phases:
            p.abort()
    finally:
        for w in started:
            try:
                rpc.rpc_sync(f"worker{w}", plain_stop)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        for to in watched:
            try:
                rpc.rpc_sync(to, rt_round2.watch_stop)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        for t in threads:
            t.join(PHASE_TIMEOUT if not errors else 5.0)
    hangs = [e for e in errors if isinstance(e, rp.Hang)]
    if hangs or errors:
        raise (hangs or errors)[0]
    res = dict(out[0])
    if n == 2:
        res["second"] = {"roots": out[1]["roots"], "grads": out[1]["grads"]}
        res["unknown"] = res["unknown"] + [f"second pass: {u}" for u in out[1]["unknown"]]
    total: dict = {}
    for to in workers:
        for tag, c in rpc.rpc_sync(to, rp._take_counts).items():
            total[tag] = total.get(tag, 0) + c
    res["counts"] = total
    res["dotgrad"] = {(w, name): g for w, to in enumerate(workers)
                      for name, g in rpc.rpc_sync(to, dot_grads).items()}
    res["plain_counts"] = counts
    round2: list = []
    for w, to in enumerate(workers):
        found, post_acc = rpc.rpc_sync(to, rt_round2.issues_here)
        round2 += [f"worker{w}: {u}" for u in found]
        for name, calls in sorted(post_acc.items()):
            want = rt_round2.expected_post_acc(prog, w, name, counts)
            if calls != want:
                round2.append(f"worker{w}: the post-accumulate-grad hook of {name} ran {calls} times, "
                              f"torch {want} (only plain backward() runs it, {counts.get(w, 0)} calls)")
    res["round2"] = round2
    return res
