"""Random hybrid DDP programs: DistributedDataParallel around models whose layers lie
on both sides of RPCs, run by several trainers at once, against local autograd.

The random-program generator (:mod:`random_programs`) has one initiator; DDP needs
several trainers that run the same model on their own data, each in its own
distributed autograd context, with DDP's all-reduce between them. A program here is
plain data::

    {"seed", "world", "trainers": [1, 2, ...], "find_unused", "unused_layer", "join",
     "steps": {trainer: n}, "stages": [stage, ...], "loss": kind}
    stage = ("local", layers)                 # on the trainer, inside DDP
          | ("ckpt", reentrant, layers)       # the same under torch.utils.checkpoint
          | ("remote", worker, mode, layers, nested)   # an RPC to a server (mode:
                                              # sync | async | remote); ``nested``: the
                                              # server calls another one (or None)
          | ("unused_rpc", worker, layers)    # an RPC whose result is never used
    layer = ("linear",) | ("act", name) | ("hook", kind, c) | ("residual", layers)
          | ("branches",)                     # two outputs (chunk), added back

Every trainer runs its steps (uneven under ``join``, inside ``ddp.join()``) and, per
step, compares what its context holds against local autograd on the same model and
data, computed beforehand for every trainer in a process that never imported distgrad
(:func:`local_reference`, tests/clean_ref.py): for DDP's parameters, DDP's average
over the trainers (a trainer that joined adds zeros; DDP divides by the group's
size); for the servers' parameters, this trainer's own gradient
(fetched from the server with the context id); the parameters' ``.grad`` must stay
None (gradients go to the context only).

CLI::

    python tests/random_ddp.py --programs 300 [--seed S]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import sys
import threading
import time
import zlib

import torch
from torch import nn

D = 4                 # every layer maps D -> D (the batch is (3, D))
DTYPE = torch.float64
MODS: dict = {}       # (dist, seed, key) -> module, on the worker that owns it
_MODS_LOCK = threading.Lock()
FEATURES = ("DDP param before an RPC", "DDP param after an RPC", "rpc_sync", "rpc_async",
            "remote().to_here()", "nested call", "unused RPC result", "find_unused_parameters",
            "unused DDP layer", "join (uneven inputs)", "tensor hook (trainer)",
            "tensor hook (server)", "checkpoint (reentrant)", "checkpoint (non-reentrant)",
            "residual", "two branches", "3 trainers")


# -- generating ----------------------------------------------------------------------------
def _layers(rnd: random.Random, depth: int = 0) -> list:
    out = [("linear",)]
    for _ in range(rnd.randint(0, 3)):
        kind = rnd.choices(["linear", "act", "hook", "residual", "branches"],
                           [3, 3, 2, 1 if depth == 0 else 0, 1])[0]
        if kind == "linear":
            out.append(("linear",))
        elif kind == "act":
            out.append(("act", rnd.choice(["tanh", "sigmoid", "sin"])))
        elif kind == "hook":
            out.append(("hook", rnd.choice(["scale", "mask"]), rnd.choice([0.5, -2.0, 3.0])))
        elif kind == "residual":
            out.append(("residual", _layers(rnd, depth + 1)))
        else:
            out.append(("branches",))
    return out


def generate(seed: int) -> dict:
    rnd = random.Random(seed)
    world = rnd.choice([3, 3, 4])
    trainers = [1, 2, 3] if world == 4 and rnd.random() < 0.3 else [1, 2]
    servers = [w for w in range(world) if w not in trainers]
    join = rnd.random() < 0.3
    find_unused = rnd.random() < 0.4
    stages: list = [("local", _layers(rnd))]
    for _ in range(rnd.randint(1, 3)):
        w = rnd.choice(servers)
        others = [s for s in servers if s != w] or [t for t in trainers]
        nested = rnd.choice(others) if rnd.random() < 0.25 else None
        stages.append(("remote", w, rnd.choice(["sync", "async", "remote"]), _layers(rnd), nested))
        if rnd.random() < 0.2:
            stages.append(("unused_rpc", rnd.choice(servers), _layers(rnd)))
        kind = rnd.choices(["local", "ckpt", "none"], [4, 2, 1])[0]
        if kind == "local":
            stages.append(("local", _layers(rnd)))
        elif kind == "ckpt":
            stages.append(("ckpt", rnd.random() < 0.5, _layers(rnd)))
    if stages[-1][0] not in ("local", "ckpt"):
        stages.append(("local", _layers(rnd)))
    steps = {t: rnd.randint(1, 3) for t in trainers}
    if not join:
        n = max(steps.values())
        steps = {t: n for t in trainers}
    return {"seed": seed, "world": world, "trainers": trainers, "find_unused": find_unused,
            "unused_layer": find_unused and rnd.random() < 0.7, "join": join, "steps": steps,
            "stages": stages, "loss": rnd.choice(["square", "sum", "first"])}


def features(prog: dict) -> set:
    f = set()
    kinds = [s[0] for s in prog["stages"]]
    first_remote = kinds.index("remote")
    if any(k in ("local", "ckpt") for k in kinds[:first_remote]):
        f.add("DDP param before an RPC")
    if any(k in ("local", "ckpt") for k in kinds[first_remote:]):
        f.add("DDP param after an RPC")
    for s in prog["stages"]:
        if s[0] == "remote":
            f.add({"sync": "rpc_sync", "async": "rpc_async", "remote": "remote().to_here()"}[s[2]])
            if s[4] is not None:
                f.add("nested call")
        if s[0] == "unused_rpc":
            f.add("unused RPC result")
        if s[0] == "ckpt":
            f.add("checkpoint (reentrant)" if s[1] else "checkpoint (non-reentrant)")
        layers = s[-1] if s[0] != "remote" else s[3]
        for lay in _flat(layers):
            if lay[0] == "hook":
                f.add("tensor hook (server)" if s[0] in ("remote", "unused_rpc") else "tensor hook (trainer)")
            if lay[0] == "residual":
                f.add("residual")
            if lay[0] == "branches":
                f.add("two branches")
    if prog["find_unused"]:
        f.add("find_unused_parameters")
    if prog["unused_layer"]:
        f.add("unused DDP layer")
    if prog["join"] and len(set(prog["steps"].values())) > 1:
        f.add("join (uneven inputs)")
    if len(prog["trainers"]) == 3:
        f.add("3 trainers")
    return f


def _flat(layers):
    for lay in layers:
        yield lay
        if lay[0] == "residual":
            yield from _flat(lay[1])


# -- running (one interpreter for the oracle and the distributed run) ----------------------
def _seeded_linear(key) -> nn.Linear:
    torch.manual_seed(zlib.crc32(repr(key).encode()))
    return nn.Linear(D, D).to(DTYPE)


class Stack(nn.Module):
    """The layers of one stage as a module (its linears are its parameters)."""

    def __init__(self, layers: list, key) -> None:
        super().__init__()
        self.layers = layers
        self.lins = nn.ModuleList()
        self._build(layers, key)

    def _build(self, layers, key):
        for lay in layers:
            if lay[0] == "linear":
                self.lins.append(_seeded_linear((key, len(self.lins))))
            elif lay[0] == "residual":
                self._build(lay[1], key)

    def forward(self, x):
        it = iter(self.lins)
        return _apply(self.layers, x, it)


def _apply(layers, x, lins):
    for lay in layers:
        if lay[0] == "linear":
            x = next(lins)(x)
        elif lay[0] == "act":
            x = getattr(torch, lay[1])(x)
        elif lay[0] == "hook":
            if x.requires_grad:
                c = lay[2]
                if lay[1] == "scale":
                    x.register_hook(lambda g, c=c: g * c)
                else:
                    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=x.dtype)
                    x.register_hook(lambda g, m=mask: g * m)
            x = x * 1.0
        elif lay[0] == "residual":
            x = x + _apply(lay[1], x, lins)
        elif lay[0] == "branches":
            a, b = x.chunk(2, dim=1)
            x = torch.cat([a.sin(), b * 2], dim=1)
    return x


def _server_module(dist, seed, idx, layers):
    key = (dist, seed, idx)
    with _MODS_LOCK:  # two trainers' first calls may arrive at once
        if key not in MODS:
            MODS[key] = Stack(layers, ("server", seed, idx))
        return MODS[key]


def serve(dist, seed, idx, layers, nested, x):
    """RPC target (a server stage): its layers, then optionally a call to another worker."""
    y = _server_module(dist, seed, idx, layers)(x)
    if nested is not None:
        y = y + _call(dist, nested, "sync", serve, seed, (idx, "n"), [("linear",), ("act", "tanh")], None, y)
    return y


def _call(dist, worker, mode, fn, *args):
    if not dist:
        return fn(False, *args)
    import distgrad.rpc as rpc
    to, args = f"worker{worker}", (True, *args)
    if mode == "sync":
        return rpc.rpc_sync(to, fn, args=args)
    if mode == "async":
        return rpc.rpc_async(to, fn, args=args).wait()
    return rpc.remote(to, fn, args=args).to_here()


class Hybrid(nn.Module):
    """The trainer's model: its local stages are submodules (DDP's parameters); remote
    stages are calls (the servers' parameters are the servers')."""

    def __init__(self, prog: dict, dist: bool) -> None:
        super().__init__()
        self.prog, self.dist = prog, dist
        self.local = nn.ModuleDict()
        for i, s in enumerate(prog["stages"]):
            if s[0] in ("local", "ckpt"):
                self.local[str(i)] = Stack(s[-1], ("trainer", prog["seed"], i))
        self.unused = _seeded_linear(("unused", prog["seed"])) if prog["unused_layer"] else None

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for i, s in enumerate(self.prog["stages"]):
            if s[0] == "local":
                x = self.local[str(i)](x)
            elif s[0] == "ckpt":
                x = checkpoint(self.local[str(i)], x, use_reentrant=s[1])
            elif s[0] == "remote":
                _, w, mode, layers, nested = s
                x = _call(self.dist, w, mode, serve, self.prog["seed"], i, layers, nested, x)
            else:  # an RPC whose result goes nowhere
                _call(self.dist, s[1], "sync", serve, self.prog["seed"], i, s[2], None, x)
        return x


def _loss(kind, out):
    if kind == "square":
        return (out * out).sum()
    if kind == "first":
        return out[:, 0].sum() + out.sum() * 0.5
    return out.sum()


def _batch(seed, trainer, step):
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, trainer, step)).encode()))
    return torch.randn(3, D, dtype=DTYPE, generator=g)


def server_grads(seed, keys, cid):
    """This worker's server parameters' gradients in context ``cid``."""
    import distgrad.autograd as dist_autograd
    g = dist_autograd.get_gradients(cid)
    out = {}
    for idx in keys:
        m = MODS.get((True, seed, idx))
        if m is not None:
            for j, p in enumerate(m.parameters()):
                out[(idx, j)] = g.get(p)
                assert p.grad is None
    return out


def _server_grads_local(seed, model_prog):
    out = collections.defaultdict(dict)
    for (dist, s, idx), m in MODS.items():
        if not dist and s == seed:
            for j, p in enumerate(m.parameters()):
                out[idx][(idx, j)] = p.grad
    return out


def _server_keys(prog):
    """(worker, stage index key) of every server module the program uses."""
    keys = []
    for i, s in enumerate(prog["stages"]):
        if s[0] == "remote":
            keys.append((s[1], i))
            if s[4] is not None:
                keys.append((s[4], (i, "n")))
        elif s[0] == "unused_rpc":
            keys.append((s[1], i))
    return keys


def _close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-11)


def local_reference(prog: dict) -> dict:
    """Local autograd on every trainer's model and data, run in the clean reference
    process (tests/clean_ref.py: it never imported distgrad, so no patch of torch's
    DDP, hooks or checkpointing reaches it): {trainer: {"init": the model's initial
    state, "steps": [({DDP parameter: grad}, {(server stage, j): grad}) per step]}}."""
    out = {}
    for rank in prog["trainers"]:
        torch.manual_seed(prog["seed"] * 7 + rank)
        local = Hybrid(prog, False)
        steps = []
        for step in range(prog["steps"][rank]):
            local.zero_grad(set_to_none=True)
            for (d, s, _i), m in MODS.items():
                if not d and s == prog["seed"]:
                    m.zero_grad(set_to_none=True)
            _loss(prog["loss"], local(_batch(prog["seed"], rank, step))).backward()
            want = {n: p.grad for n, p in local.named_parameters()}
            per_stage = _server_grads_local(prog["seed"], prog).values()
            steps.append((want, {k: v for per in per_stage for k, v in per.items()}))
        out[rank] = {"init": {k: v.clone() for k, v in local.state_dict().items()}, "steps": steps}
    for key in [k for k in MODS if k[1] == prog["seed"] and not k[0]]:
        del MODS[key]
    return out


def local_references(progs: list) -> dict:
    """{seed: :func:`local_reference`} (one call to the clean process per cluster)."""
    return {p["seed"]: local_reference(p) for p in progs}


class _Watched:
    """A model's parameters as random_round2.Watcher looks at a worker's leaves."""

    def __init__(self, model: nn.Module) -> None:
        self.lock = threading.Lock()
        self.leaves = dict(model.named_parameters())


def run_program(prog: dict, rank: int, ref: dict) -> list:
    """On trainer ``rank``: every step of ``prog`` against the clean reference ``ref``
    (:func:`local_reference`); returns the differences found."""
    import random_round2
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc

    seed, trainers = prog["seed"], prog["trainers"]
    torch.manual_seed(seed * 7 + rank)  # DDP broadcasts the first trainer's parameters
    model = Hybrid(prog, True)
    ddp = DDP(model, find_unused_parameters=prog["find_unused"])
    # torch's distributed autograd never gives DDP's parameters a .grad, nor runs their
    # post-accumulate-grad hooks (issue 34): a thread watches .grad during the steps
    post_acc = [0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _t: post_acc.__setitem__(0, post_acc[0] + 1))
    watcher = random_round2.Watcher(_Watched(model), none_only=True)
    diffs = []
    init = model.state_dict()
    if init.keys() != ref[rank]["init"].keys() or not all(
            torch.equal(v, ref[rank]["init"][k]) for k, v in init.items()):
        diffs.append("the model's parameters after DDP's constructor differ from the reference's")
    ctx = ddp.join() if prog["join"] else contextlib.nullcontext()
    rows = []
    served_compared = 0
    with ctx:
        for step in range(prog["steps"][rank]):
            x = _batch(seed, rank, step)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [_loss(prog["loss"], ddp(x))])
                g = dist_autograd.get_gradients(cid)
                got = {n: g.get(p) for n, p in model.named_parameters()}
                if any(p.grad is not None for p in model.parameters()):
                    diffs.append(f"step {step}: .grad written")
                by_worker = collections.defaultdict(list)
                for w, key in _server_keys(prog):
                    by_worker[w].append(key)
                served = {}
                for w, keys in by_worker.items():
                    if w == rank:
                        served.update(server_grads(seed, keys, cid))
                    else:
                        served.update(rpc.rpc_sync(f"worker{w}", server_grads, args=(seed, keys, cid)))
            want_served = ref[rank]["steps"][step][1]
            for k, v in served.items():
                w = want_served.get(k)
                served_compared += w is not None
                if not _close(v, w):
                    diffs.append(f"step {step}: server parameter {k}: got "
                                 f"{None if v is None else v.flatten()[:4].tolist()}, want "
                                 f"{None if w is None else w.flatten()[:4].tolist()}")
            rows.append((step, got))
    diffs += [f"watching .grad: {w}" for w in watcher.stop()]
    if post_acc[0]:
        diffs.append(f"post-accumulate-grad hooks ran {post_acc[0]} times (torch: never)")
    # DDP's average: every trainer's local gradients, per step (None past its last step)
    compared = 0
    for step, got in rows:
        for name, g in got.items():
            parts = [ref[t]["steps"][step][0][name] if step < len(ref[t]["steps"]) else "joined"
                     for t in trainers]
            used = [p for p in parts if not isinstance(p, str) and p is not None]
            want_g = sum(used) / len(trainers) if used else None
            compared += want_g is not None
            if not _close(g, want_g):
                diffs.append(f"step {step}: DDP parameter {name}: got "
                             f"{None if g is None else g.tolist()}, want "
                             f"{None if want_g is None else want_g.tolist()} (parts {parts})")
    if not compared or not served_compared:
        diffs.append(f"nothing compared ({compared} DDP, {served_compared} server gradients)")
    return diffs


def cluster_main(rank: int, world: int, seeds: list, pg_port: int, refs: bytes):
    """run_workers target: the trainers run every program against ``refs`` (packed
    :func:`local_references`), the servers serve."""
    import clean_ref
    import torch.distributed as dist
    refs = clean_ref.unpack(refs)

    progs = [p for p in (generate(s) for s in seeds) if p["world"] == world]
    trainer_sets = {tuple(p["trainers"]) for p in progs}
    assert len(trainer_sets) <= 1, "one cluster runs programs with one set of trainers"
    trainers = list(trainer_sets.pop()) if trainer_sets else []
    if rank not in trainers:
        return None
    dist.init_process_group("gloo", rank=trainers.index(rank), world_size=len(trainers),
                            init_method=f"tcp://127.0.0.1:{pg_port}")
    try:
        out = {}
        for p in progs:
            try:
                out[p["seed"]] = run_program(p, rank, refs[p["seed"]])
            except Exception as e:
                # the other trainers may be inside a collective: the cluster cannot go on
                raise RuntimeError(f"seed {p['seed']} on trainer worker{rank}: {type(e).__name__}: "
                                   f"{e}") from e
        return out
    finally:
        dist.destroy_process_group()


def run(seeds: list, timeout: float = 600.0, log=print) -> list:
    """Run ``seeds`` (grouped by cluster shape); returns records (seed, ok, diffs, features)."""
    import clean_ref
    from mp_utils import free_port, run_workers
    groups = collections.defaultdict(list)
    for s in seeds:
        p = generate(s)
        groups[(p["world"], tuple(p["trainers"]))].append(s)
    records = []
    for (world, _trainers), group in sorted(groups.items()):
        t0 = time.monotonic()
        refs = clean_ref.reference(local_references, [generate(s) for s in group])
        res = run_workers(cluster_main, world_size=world, timeout=timeout,
                          args=(group, free_port(), clean_ref.pack(refs)), options={"rpc_timeout": 60})
        for s in group:
            diffs = []
            for r in res:
                if r is not None:
                    diffs += r.get(s, [])
            records.append({"seed": s, "ok": not diffs, "diffs": diffs,
                            "features": sorted(features(generate(s)))})
        log(f"  world {world}, trainers {list(_trainers)}: {len(group)} programs, "
            f"{sum(not r['ok'] for r in records[-len(group):])} failed, {time.monotonic() - t0:.0f} s")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Random hybrid DDP programs vs local autograd.")
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None, help="base seed; random when omitted")
    args = ap.parse_args(argv)
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"base seed {base}: {args.programs} DDP programs (rerun with --seed {base})", flush=True)
    records = run(list(range(base, base + args.programs)), timeout=120 + 3 * args.programs)
    covered = collections.Counter(f for r in records for f in r["features"])
    exact = collections.Counter(f for r in records if r["ok"] for f in r["features"])
    print("\nfeature | programs | exact")
    for f in FEATURES:
        print(f"{f} | {covered[f]} | {exact[f]}")
    bad = [r for r in records if not r["ok"]]
    print(f"\n{len(records) - len(bad)} exact, {len(bad)} failed (of {len(records)})")
    for r in bad[:5]:
        print(f"--- seed {r['seed']}: {generate(r['seed'])}\n  " + "\n  ".join(r["diffs"][:6]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import random_ddp
    sys.exit(random_ddp.main())
