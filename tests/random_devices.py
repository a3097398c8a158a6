"""Random programs with devices (issue 44): leaves and stages on two accelerator devices
and the CPU, moved between them inside a worker and carried over RPC through device
maps both ways, several tensors (devices and the CPU mixed) in one call, replies on
devices; each program's gradients compared with local autograd of the same computation
on the CPU (:func:`run_local`, in a process that never imported distgrad:
tests/clean_ref.py), with the test accelerator's stream-order checker on.

A program (:func:`generate`) is a dict::

    {"seed": s, "leaves": [(name, shape, dev)], "steps": [...], "roots": [names], "passes": n}

with ``dev`` one of ``"cpu"``, ``0``, ``1`` (an index of the accelerator under test)
and steps::

    ("op", out, name, [ins], dev)        out = name(*ins moved to dev), on dev
    ("call", outs, worker, [ins], body[, dev])  outs = the values ``body`` (a list of
                                         ("op", ...) steps over "a0".."aN") makes on
                                         ``worker`` from ``ins``; they come back through
                                         the reverse map (``dev``: sent and received
                                         inside a stream of its own on that device)
    ("stream", out, name, [ins], dev)    like "op", on a stream of its own (waited for)

Every worker maps its device ``i`` to the peer's device ``1 - i``, so a tensor on
device 0 arrives on device 1 and a reply on device 1 comes back on device 0. The root is
the sum of the roots' sums, moved to the CPU.

Example::

    >>> prog = generate(7)
    >>> want = run_local(prog)          # {leaf name: gradient} on the CPU
"""
from __future__ import annotations

import contextlib
import random

import torch

UNARY = ("sin", "tanh", "exp_half", "mul3", "add1", "square")
BINARY = ("add", "mul", "sub")


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "sin":
        return x.sin()
    if name == "tanh":
        return x.tanh()
    if name == "exp_half":
        return (x * 0.5).exp()
    if name == "mul3":
        return x * 3.0
    if name == "add1":
        return x + 1.0
    return x * x


def _binary(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "add":
        return x + y
    if name == "mul":
        return x * y
    return x - y


def _where(dev, device_type: str | None) -> torch.device:
    """A program's device (``"cpu"``, 0, 1) as a torch device (all CPU when
    ``device_type`` is None: the local reference)."""
    if dev == "cpu" or device_type is None:
        return torch.device("cpu")
    return torch.device(device_type, dev)


def apply_step(step: tuple, env: dict, device_type: str | None) -> None:
    kind, out, name, ins, dev = step
    where = _where(dev, device_type)
    xs = [env[i].to(where) for i in ins]
    if kind == "stream" and where.type != "cpu":
        mod = torch.get_device_module(where.type)
        cur = mod.current_stream(where)
        s = mod.Stream(where)
        s.wait_stream(cur)
        with mod.stream(s):
            y = _unary(name, xs[0]) if len(xs) == 1 else _binary(name, *xs)
        cur.wait_stream(s)
        for x in xs:   # (made elsewhere, used on s: kept until s is done with them)
            x.record_stream(s)
        y.record_stream(cur)   # (made on s, used on the current stream from now on)
    else:
        y = _unary(name, xs[0]) if len(xs) == 1 else _binary(name, *xs)
    env[out] = y


def run_body(body: list, args: tuple, device_type: str | None) -> tuple:
    """A call's body on its callee (or inline, for the reference): its values' last
    ``n`` outputs, as the body names them (``"r0"``, ``"r1"``, ...)."""
    env = {f"a{i}": a for i, a in enumerate(args)}
    for step in body:
        apply_step(step, env, device_type)
    return tuple(env[k] for k in sorted(k for k in env if k.startswith("r")))


def generate(seed: int, world: int = 2) -> dict:
    """A random program for ``world`` workers (worker0 drives it)."""
    rng = random.Random(seed)
    shape = rng.choice([(3,), (2, 3)])
    devs = ["cpu", 0, 1]
    leaves = [(f"x{i}", shape, rng.choice(devs)) for i in range(rng.randint(2, 4))]
    names = [n for n, _, _ in leaves]
    steps: list = []
    n = 0

    def fresh() -> str:
        nonlocal n
        n += 1
        return f"v{n}"

    for _ in range(rng.randint(3, 7)):
        r = rng.random()
        if r < 0.45:
            out = fresh()
            if rng.random() < 0.5:
                steps.append((rng.choice(["op", "stream"]), out, rng.choice(UNARY), [rng.choice(names)],
                              rng.choice(devs)))
            else:
                steps.append(("op", out, rng.choice(BINARY), rng.sample(names, 2) if len(names) > 1
                              else [names[0], names[0]], rng.choice(devs)))
            names.append(out)
        else:
            worker = rng.randint(1, world - 1)
            ins = rng.sample(names, min(len(names), rng.randint(1, 3)))
            body, bn = [], 0
            args = [f"a{i}" for i in range(len(ins))]
            for _ in range(rng.randint(1, 3)):
                bn += 1
                out = f"b{bn}"
                if rng.random() < 0.6 or len(args) < 2:
                    body.append((rng.choice(["op", "stream"]), out, rng.choice(UNARY), [rng.choice(args)],
                                 rng.choice(devs)))
                else:
                    body.append(("op", out, rng.choice(BINARY), rng.sample(args, 2), rng.choice(devs)))
                args.append(out)
            made = [a for a in args if a.startswith("b")]
            results = rng.sample(made, min(len(made), rng.randint(1, 2)))
            for i, src in enumerate(results):   # results on a chosen device (or where made)
                body.append(("op", f"r{i}", "add1" if rng.random() < 0.5 else "mul3", [src],
                             rng.choice(devs)))
            outs = [fresh() for _ in results]
            # sometimes sent from inside a stream of its own on a device (the send
            # function's stream is then that one: gradients coming back are ordered to it)
            on = rng.choice([None, None, 0, 1])
            steps.append(("call", outs, f"worker{worker}", ins, body) + ((on,) if on is not None else ()))
            names.extend(outs)
    made = [s for s in names if s.startswith("v")] or names
    roots = rng.sample(made, min(len(made), rng.randint(1, 2)))
    passes = rng.randint(1, 2)
    # the gradients read on fresh streams of both devices (not the one backward ran on):
    # get_gradients must order them after the accumulations (drawn last: the programs
    # above stay the same for every seed)
    return {"seed": seed, "leaves": leaves, "steps": steps, "roots": roots, "passes": passes,
            "read_on_streams": rng.random() < 0.5}


def leaf_values(prog: dict, device_type: str | None) -> dict:
    """The program's leaves (the same values every run), on their devices."""
    gen = torch.Generator().manual_seed(prog["seed"])
    out = {}
    for name, shape, dev in prog["leaves"]:
        v = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5)
        out[name] = v.to(_where(dev, device_type)).requires_grad_()
    return out


def forward(prog: dict, call, leaves: dict, device_type: str | None) -> torch.Tensor:
    """The program's forward from ``leaves`` (:func:`leaf_values`): ``call(worker, body,
    args)`` runs a call's body; returns the root, on the CPU."""
    env = dict(leaves)
    for step in prog["steps"]:
        if step[0] == "call":
            _, outs, worker, ins, body, *on = step
            args = tuple(env[i] for i in ins)
            where = _where(on[0], device_type) if on else torch.device("cpu")
            if where.type != "cpu":
                mod = torch.get_device_module(where.type)
                cur = mod.current_stream(where)
                s = mod.Stream(where)
                s.wait_stream(cur)
                with mod.stream(s):
                    got = call(worker, body, args)
                cur.wait_stream(s)
                for g in got:
                    if g.device == where:
                        g.record_stream(cur)
            else:
                got = call(worker, body, args)
            for o, g in zip(outs, got):
                env[o] = g
        else:
            apply_step(step, env, device_type)
    return sum(env[r].to("cpu").sum() for r in prog["roots"])


def run_local(prog: dict) -> dict:
    """Local autograd of the program on the CPU: each leaf's gradient summed over the
    passes (None where it gets none), as float64 CPU tensors."""
    grads: dict = {}
    leaves = leaf_values(prog, None)
    for _ in range(prog["passes"]):
        root = forward(prog, lambda w, body, args: run_body(body, args, None), leaves, None)
        gs = torch.autograd.grad(root, list(leaves.values()), allow_unused=True)
        for name, g in zip(leaves, gs):
            if g is not None:
                grads[name] = g if name not in grads else grads[name] + g
    return grads


# -- distgrad's run (in spawned workers that loaded the accelerator under test) ----------

_DEVICE = [None]   # the accelerator under test's type, on each worker


def remote_body(body: list, args: tuple) -> tuple:
    """A call's body on the callee, on its devices."""
    return run_body(body, args, _DEVICE[0])


def run_programs(rank: int, world: int, port: int, progs: list) -> bytes:
    """Worker ``rank`` of a cluster with device maps both ways (device i -> the peer's
    1 - i); worker0 runs each program (its passes in one context) and returns, packed,
    per program: {leaf: (gradient on the CPU, its device, the leaf's device)} or the
    error; every worker returns the stream-order checker's violations."""
    import clean_ref

    from distgrad.testing import accel
    _DEVICE[0] = accel.device_under_test()
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    for peer in range(world):
        if peer != rank:
            opts.set_device_map(f"worker{peer}", {0: 1, 1: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out = []
    if rank == 0:
        def call(worker, body, args):
            return rpc.rpc_sync(worker, remote_body, args=(body, args))
        for prog in progs:
            try:
                leaves = leaf_values(prog, _DEVICE[0])
                with dist_autograd.context() as cid:
                    for _ in range(prog["passes"]):   # (each pass a forward of its own)
                        dist_autograd.backward(cid, [forward(prog, call, leaves, _DEVICE[0])])
                    with contextlib.ExitStack() as streams:
                        if prog.get("read_on_streams"):
                            mod = torch.get_device_module(_DEVICE[0])
                            for i in range(2):
                                streams.enter_context(mod.stream(mod.Stream(torch.device(_DEVICE[0], i))))
                        g = dist_autograd.get_gradients(cid)
                        out.append({n: (g[t].cpu(), str(g[t].device), str(t.device))
                                    for n, t in leaves.items() if t in g})
            except Exception as e:  # noqa: BLE001 - compared: there must be none
                out.append(f"{type(e).__name__}: {e}")
    rpc.shutdown()
    if _DEVICE[0] != "cuda":
        accel.check()
        violations = accel.violations()
    else:
        violations = []
    return clean_ref.pack((out, violations))
