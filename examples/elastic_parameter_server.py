#!/usr/bin/env python
"""Elastic parameter server: trainers join, crash and are replaced mid-run.

    python examples/elastic_parameter_server.py [--steps 200] [--join-at 50] [--kill-at 100]
                                                 [--plot elastic.png]

Local processes (torch.multiprocessing spawn, 127.0.0.1) in one dynamic group
(``init_rpc`` without ``world_size``); a store of its own (this launcher
process) outlives every member:

* ``ps`` (rank 0) holds an MLP and drives the steps. Each step it asks every
  trainer present to compute its gradients, checks each against torch's local
  autograd on the same weights and batch, then applies them with a
  ``DistributedOptimizer`` (one ``step(context_id)`` per trainer's context).
* ``trainer1`` and ``trainer2`` start with it; ``trainer3`` joins at step
  ``--join-at``; ``trainer2`` SIGKILLs itself in the middle of step
  ``--kill-at`` (after pulling the weights, before its backward), the group
  takes it out, and a new process joins as ``trainer2`` (same name and rank, a
  new incarnation) and trains on to the end.
* Each trainer, per step, inside a distributed autograd context: pulls the
  weights (``rpc_sync``: recorded, so the gradients flow back to the server),
  runs the forward pass on its own batch, ``dist_autograd.backward``, then
  hands its context id to the server, which steps with it. Each trainer also
  holds an RRef it created on the server at its start (released when it leaves;
  dropped by the group when it crashes).

At the end every process checks that no distributed autograd context and no
RRef is left on it, and the launcher prints the exactness count, the join and
leave times and the membership events; ``--plot`` draws the membership over
time beside the loss curve.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.optim import DistributedOptimizer

# every worker needs the same DISTGRAD_SECRET (README, "Trust model"); the ones spawned here inherit this
os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))

IN, HIDDEN = 8, 16
_server = None  # the server's state, in the ps process


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch(step: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each trainer's batch for a step (the server rebuilds it for the check)."""
    g = torch.Generator().manual_seed(step * 1000 + int(name.removeprefix("trainer")))
    x = torch.randn(32, IN, generator=g)
    teacher = torch.linspace(-1, 1, IN).unsqueeze(1)
    return x, torch.tanh(x @ teacher)


def loss_of(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return ((torch.tanh(x @ w1.t() + b1) @ w2.t() + b2 - y) ** 2).mean()


# -- on the server ------------------------------------------------------------
class Server:
    def __init__(self, lr: float) -> None:
        self.model = make_model()
        self.params = list(self.model.parameters())
        self.opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(p) for p in self.params], lr=lr)
        self.lock = threading.Condition()
        self.submitted: dict[str, tuple[int, float]] = {}  # name -> (context id, loss)
        self.release = threading.Event()
        self.held: list = []  # RRefs trainers created here (owned here)


def get_params() -> list[torch.Tensor]:
    # views: an nn.Parameter itself would arrive as a new leaf, with no gradient back
    return [p.view_as(p) for p in _server.params]


def submit(name: str, context_id: int, loss: float) -> None:
    """A trainer's context is ready (its backward done): wait until the server stepped."""
    with _server.lock:
        _server.submitted[name] = (context_id, loss)
        _server.lock.notify_all()
    _server.release.wait(120)


def make_token(name: str) -> str:
    return f"token of {name}"


def _trainers() -> list[str]:
    return sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()
                  if w.name.startswith("trainer"))


def _wait_for(pred, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"ps: timed out waiting for {what}")
        time.sleep(0.005)


def run_server(args, progress) -> dict:
    global _server
    _server = Server(args.lr)
    checked = mismatched = 0
    steps = []
    for step in range(1, args.steps + 1):
        if step == 1:
            _wait_for(lambda: _trainers() == ["trainer1", "trainer2"], 120, "the first trainers")
        if step == args.join_at:
            _wait_for(lambda: "trainer3" in _trainers(), 120, "trainer3 to join")
        if step == args.kill_at + 1:
            _wait_for(lambda: len(_trainers()) == 3, 120, "the replacement trainer2")
        progress.value = step
        snapshot = [p.detach().clone() for p in _server.params]
        names = _trainers()
        with _server.lock:
            _server.submitted.clear()
        _server.release.clear()
        futs = {n: rpc.rpc_async(n, train_step, args=(step, n, step == args.kill_at and n == "trainer2"))
                for n in names}
        # every trainer present either submits its context or is lost
        lost = set()
        with _server.lock:
            while True:
                for n, f in futs.items():
                    if f.done() and n not in _server.submitted:
                        lost.add(n)
                if set(_server.submitted) | lost >= set(futs):
                    break
                _server.lock.wait(0.05)
            submitted = dict(_server.submitted)
        present, losses = sorted(submitted), []
        for n in present:
            cid, loss = submitted[n]
            grads = dist_autograd.get_gradients(cid)
            ref = [p.clone().requires_grad_() for p in snapshot]
            loss_of(ref, *batch(step, n)).backward()
            ok = all(torch.equal(grads[p], r.grad) for p, r in zip(_server.params, ref))
            checked += 1
            mismatched += not ok
            losses.append(loss)
        for n in present:
            _server.opt.step(submitted[n][0])
        _server.release.set()
        for n, f in futs.items():
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - the crashed trainer's call
                if n != "trainer2" or step != args.kill_at:
                    raise
                assert isinstance(e, rpc.WorkerLostError), repr(e)
        steps.append({"step": step, "time": time.time(), "trainers": present,
                      "loss": sum(losses) / max(1, len(losses))})
    progress.value = args.steps + 1
    for n in _trainers():
        rpc.rpc_sync(n, stop)
    _wait_for(lambda: not _trainers(), 60, "the trainers to leave")
    _wait_for(lambda: dist_autograd._get_debug_info()["num_autograd_contexts"] == 0, 30, "contexts released")
    info = rpc._rref_context_get_debug_info()
    return {"checked": checked, "mismatched": mismatched, "steps": steps, "events": rpc.membership_events(),
            "contexts_left": dist_autograd._get_debug_info()["num_autograd_contexts"],
            "owner_rrefs_left": int(info["num_owner_rrefs"]), "forks_left": int(info["num_forks"])}


# -- on a trainer ----------------------------------------------------------------
_stop = threading.Event()
_kill_time = None  # a shared double: when the crashing trainer killed itself


def stop() -> None:
    _stop.set()


def train_step(step: int, name: str, crash: bool) -> None:
    with dist_autograd.context() as cid:
        params = rpc.rpc_sync("ps", get_params)
        if crash:
            _kill_time.value = time.time()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_of(params, *batch(step, name))
        dist_autograd.backward(cid, [loss])
        rpc.rpc_sync("ps", submit, args=(name, cid, loss.item()))


# -- processes ---------------------------------------------------------------------
def _member(role: str, rank: int, port: int, args, progress, results, kill_time) -> None:
    global _kill_time
    _kill_time = kill_time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DISTGRAD_STORE_HOSTED="1")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    t0 = time.time()
    rpc.init_rpc(role, rank=rank, rpc_backend_options=opts)
    joined = time.time() - t0
    if role == "ps":
        out = run_server(args, progress)
    else:
        token = rpc.remote("ps", make_token, args=(role,))
        assert token.to_here() == f"token of {role}"
        _stop.wait(600)
        del token
        deadline = time.monotonic() + 30
        while dist_autograd._get_debug_info()["num_autograd_contexts"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = {"contexts_left": dist_autograd._get_debug_info()["num_autograd_contexts"]}
    t1 = time.time()
    rpc.shutdown()
    out.update(role=role, pid=os.getpid(), join_s=joined, leave_s=time.time() - t1)
    results.put(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    port = free_port()
    # the group's store, hosted here: it outlives every member (DISTGRAD_STORE_HOSTED=1)
    store = rpc.membership.serve_store("127.0.0.1", port)
    ctx = mp.get_context("spawn")
    progress, results, kill_time = ctx.Value("i", 0), ctx.Queue(), ctx.Value("d", 0.0)
    env_secret = os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))
    assert env_secret

    def start(role, rank):
        # distgrad takes the secret out of os.environ once it read it (no child inherits
        # it by accident): a member started here gets it on purpose
        os.environ["DISTGRAD_SECRET"] = env_secret
        p = ctx.Process(target=_member, args=(role, rank, port, args, progress, results, kill_time),
                        daemon=True)
        p.start()
        return p

    procs = {"ps": start("ps", 0)}
    _wait_store(store, 60)
    procs["trainer1"], procs["trainer2"] = start("trainer1", 1), start("trainer2", 2)
    deadline = time.monotonic() + args.timeout
    replaced = joined3 = False
    killed_at = None
    while progress.value <= args.steps:
        if time.monotonic() > deadline:
            break
        if not joined3 and progress.value >= args.join_at - 1:
            procs["trainer3"], joined3 = start("trainer3", 3), True
        if not replaced and not procs["trainer2"].is_alive():
            killed_at = kill_time.value
            procs["trainer2-old"] = procs.pop("trainer2")
            procs["trainer2"], replaced = start("trainer2", 2), True
        if any(not p.is_alive() and p.exitcode not in (0, None) for k, p in procs.items()
               if k != "trainer2-old"):
            break
        time.sleep(0.01)
    outs = []
    end = time.monotonic() + 120
    while len(outs) < len(procs) - 1 and time.monotonic() < end:
        try:
            outs.append(results.get(timeout=1))
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for k, p in procs.items() if k != "trainer2-old"):
                break
    for p in procs.values():
        p.join(10)
        if p.is_alive():
            p.kill()
    server = next((o for o in outs if o["role"] == "ps"), None)
    if server is None:
        raise RuntimeError(f"the server did not finish: exit codes "
                           f"{ {k: p.exitcode for k, p in procs.items()} }")
    lost = [e for e in server["events"] if e[1] == "lost"]
    server["crash_noticed_s"] = (lost[0][0] - killed_at) if lost and killed_at else None
    server["members"] = [{k: o.get(k) for k in ("role", "pid", "join_s", "leave_s", "contexts_left")}
                         for o in outs]
    server["exitcodes"] = {k: p.exitcode for k, p in procs.items()}
    return server


def _wait_store(store, limit: float) -> None:
    """Until the server is in the group's table (the trainers then find it)."""
    deadline = time.monotonic() + limit
    group = rpc.membership.Group(store)
    while not any(e[0] == "ps" and e[1] for e in group.members().values()):
        if time.monotonic() > deadline:
            raise RuntimeError("the server never joined")
        time.sleep(0.01)


def plot(result: dict, path: str) -> None:
    """Membership over time beside the loss curve (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    steps = result["steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({n for s in steps for n in s["trainers"]})
    for i, n in enumerate(names):
        xs = [s["step"] for s in steps if n in s["trainers"]]
        ax1.scatter(xs, [i] * len(xs), s=4)
    for e in result["events"]:
        if e[2] in names:
            dy = {"joined": 0.12, "left": 0.12, "lost": -0.22}[e[1]]
            ax1.annotate(f"{e[1]} (#{e[4]})", (_step_at(steps, e[0]), names.index(e[2]) + dy), fontsize=7)
    ax1.set_yticks(range(len(names)), names)
    ax1.set_ylim(-0.6, len(names) - 0.4)
    ax1.set_xlabel("step")
    ax1.set_title("trainers present in each step")
    ax2.plot([s["step"] for s in steps], [s["loss"] for s in steps])
    ax2.set_xlabel("step")
    ax2.set_ylabel("mean loss of the trainers present")
    ax2.set_yscale("log")
    ax2.set_title("loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _step_at(steps: list, t: float) -> int:
    return next((s["step"] for s in steps if s["time"] >= t), steps[-1]["step"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--join-at", type=int, default=50)
    ap.add_argument("--kill-at", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--plot", default=None, help="write the membership/loss picture here (PNG)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    result = run(args)
    print(f"steps {len(result['steps'])}, gradients checked {result['checked']}, "
          f"mismatched {result['mismatched']}")
    print(f"crash noticed and member taken out after {result['crash_noticed_s']:.3f} s"
          if result["crash_noticed_s"] is not None else "no crash seen")
    for m in sorted(result["members"], key=lambda m: m["role"]):
        print(f"  {m['role']:9s} pid {m['pid']}: joined in {m['join_s']:.3f} s, left in {m['leave_s']:.3f} s")
    for _, what, name, rank, inc in result["events"]:
        print(f"  event {what:6s} {name} (rank {rank}, incarnation {inc})")
    print(f"left on the server: {result['contexts_left']} contexts, {result['owner_rrefs_left']} "
          f"owner RRefs, {result['forks_left']} forks")
    if args.plot:
        plot(result, args.plot)
        print(f"picture: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, default=str)
    ok = (result["mismatched"] == 0 and len(result["steps"]) == args.steps
          and result["contexts_left"] == 0 and result["owner_rrefs_left"] == 0
          and all(not m["contexts_left"] for m in result["members"]))
    print("ELASTIC OK" if ok else "ELASTIC FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
