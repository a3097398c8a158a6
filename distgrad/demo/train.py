"""``distgrad demo``: model-parallel training of a digits classifier on a local cluster.

Process layout (``--workers N``, N >= 3), all on 127.0.0.1:

* rank 0 ``driver``: holds the data, runs the training loop, computes the
  cross-entropy loss locally, calls ``dist_autograd.backward`` and
  ``DistributedOptimizer.step``;
* rank 1 ``ps`` (parameter server): a learned per-pixel input scale and bias;
* ranks 2.. ``stage1``..``stage{N-2}``: the MLP's layers, split into N-2 stages.

Each step the driver sends the batch to ``ps``, the result to ``stage1``,
that result to ``stage2``, and so on; the logits come back to the driver.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import time
from typing import Any

DEFAULT_OUT = "./distgrad-demo-out"
GRAPH_BASE = "autograd_graph"        # .png and .svg pictures, .dot source, .json description
CURVES_FILE = "training_curves.png"
DEMO_PACKAGES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}
_SERVE_TIMEOUT_S = 7 * 24 * 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--workers", type=int, default=4,
                        help="number of processes, >= 3: driver, parameter server and "
                             "WORKERS-2 model stages (default: 4)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=64,
                        help="batch size (default: 64)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default: 0.01)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"output folder for pictures and summary.json (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--eval-every", dest="eval_every", type=int, default=10,
                        help="evaluate test accuracy every this many steps (default: 10)")
    return parser


def worker_names(world_size: int) -> list[str]:
    return ["driver", "ps"] + [f"stage{i}" for i in range(1, world_size - 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_packages() -> list[str]:
    """The pip names of the demo's packages (the ``demo`` extra) that cannot be imported."""
    missing = []
    for module, package in DEMO_PACKAGES.items():
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    return missing


def run(args: argparse.Namespace) -> int:
    """Start the cluster, train, report; returns the exit code."""
    if args.workers < 3:
        print("distgrad demo: --workers must be >= 3 (driver, parameter server, >= 1 stage)",
              file=sys.stderr)
        return 2
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0 or args.eval_every < 1:
        print("distgrad demo: --steps, --batch-size, --eval-every must be >= 1 and --lr > 0",
              file=sys.stderr)
        return 2
    missing = missing_packages()
    if missing:
        print(f"distgrad demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
              f"not installed. Install the demo's extra:\n"
              f"    pip install 'distgrad[demo]'      (from a source checkout: pip install '.[demo]')\n"
              f"or just: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the workers inherit it: only processes of this cluster can talk to each other
    os.environ.setdefault("DISTGRAD_SECRET", secrets.token_hex(32))
    import torch.multiprocessing as mp

    from ..errors import DistgradError
    from ..safe_files import out_dir
    try:   # files are written beside their names and renamed, never through a link
        out = out_dir(os.path.abspath(args.out), "distgrad demo --out")
    except (DistgradError, OSError) as e:
        print(f"distgrad demo: {e}", file=sys.stderr)
        return 2
    cfg = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "out": out,
           "seed": args.seed, "eval_every": args.eval_every,
           "init_method": f"tcp://127.0.0.1:{_free_port()}"}
    names = worker_names(args.workers)
    print(f"distgrad demo: starting {args.workers} processes on 127.0.0.1 ({', '.join(names)})",
          flush=True)
    procs = mp.spawn(_worker_main, args=(args.workers, cfg), nprocs=args.workers, join=False)
    os.environ.pop("DISTGRAD_SECRET", None)  # the workers have it; nothing else started here may
    try:
        while not procs.join():
            pass
    except KeyboardInterrupt:
        print("distgrad demo: interrupted; stopping the workers", file=sys.stderr)
        _stop(procs.processes)
        return 130
    except Exception as e:  # noqa: BLE001 - a worker failed; its traceback is in the message
        _stop(procs.processes)
        print(f"distgrad demo: failed: {e}", file=sys.stderr)
        return 1
    return 0


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _worker_main(rank: int, world_size: int, cfg: dict) -> None:
    import torch
    torch.set_num_threads(1)
    from distgrad import rpc
    name = worker_names(world_size)[rank]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=cfg["init_method"], rpc_timeout=120)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank != 0:
        # Serve until the driver is done: torch's pattern is a plain rpc.shutdown() here,
        # but distgrad's shutdown gives up waiting after 60 s by default.
        rpc.shutdown(timeout=_SERVE_TIMEOUT_S)
        return
    try:
        Driver(world_size, cfg).main()
    finally:
        rpc.shutdown()


# -- the driver -------------------------------------------------------------------
class Driver:
    def __init__(self, world_size: int, cfg: dict) -> None:
        import torch
        self.torch = torch
        self.cfg = cfg
        self.world_size = world_size
        self.names = worker_names(world_size)
        self.stage_names = self.names[2:]

    # -- setup -----------------------------------------------------------------
    def load_data(self) -> None:
        import numpy as np
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        torch = self.torch
        digits = load_digits()
        x = digits.data.astype(np.float32) / 16.0
        y = digits.target.astype(np.int64)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=self.cfg["seed"],
                                              stratify=y)
        self.xtr, self.ytr = torch.from_numpy(xtr), torch.from_numpy(ytr)
        self.xte, self.yte = torch.from_numpy(xte), torch.from_numpy(yte)

    def build_model(self) -> None:
        from distgrad import rpc

        from .model import Shard, stage_specs
        seed = self.cfg["seed"]
        self.specs = stage_specs(len(self.stage_names))
        self.ps = rpc.remote("ps", Shard, args=("normalizer", None, seed))
        self.stages = [rpc.remote(n, Shard, args=("stage", spec, seed + 1 + i))
                       for i, (n, spec) in enumerate(zip(self.stage_names, self.specs))]
        self.shards = [self.ps] + self.stages
        self.param_rrefs = []
        for s in self.shards:
            self.param_rrefs.extend(s.rpc_sync().parameter_rrefs())

    def forward(self, x):
        h = self.ps.rpc_sync().forward(x)
        for s in self.stages:
            h = s.rpc_sync().forward(h)
        return h

    def predict(self, x):
        h = self.ps.rpc_sync().predict(x)
        for s in self.stages:
            h = s.rpc_sync().predict(h)
        return h

    def test_accuracy(self) -> float:
        logits = self.predict(self.xte)
        return (logits.argmax(1) == self.yte).float().mean().item()

    def traffic_snapshot(self) -> dict[str, tuple[int, int]]:
        """Worker -> (messages, bytes) it sent so far, from every worker's debug counters."""
        from distgrad import rpc

        from .model import traffic_sent
        futs = {n: rpc.rpc_async(n, traffic_sent) for n in self.names[1:]}
        snap = {"driver": traffic_sent()}
        snap.update({n: f.wait() for n, f in futs.items()})
        return {w: (sum(m for m, _ in v.values()), sum(b for _, b in v.values())) for w, v in snap.items()}

    # -- gradient check + graph ----------------------------------------------------
    def gradient_check(self) -> str:
        """One forward/backward on a fixed batch; compare every parameter's
        distributed gradient with the same model's single-process gradient."""
        torch = self.torch
        import torch.nn.functional as F

        import distgrad.autograd as dist_autograd
        from distgrad.graph import describe_graph

        from .model import build_module

        x, y = self.xtr[:self.cfg["batch_size"]], self.ytr[:self.cfg["batch_size"]]
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(self.forward(x), y)
            desc = describe_graph(cid, roots=[loss])
            dist_autograd.backward(cid, [loss])
            dist_grads = [g for s in self.shards for g in s.rpc_sync().gradients(cid)]
        # the same model in this process, from the shards' current weights
        local = [build_module("normalizer", None, 0)] + [build_module("stage", sp, 0) for sp in self.specs]
        for m, s in zip(local, self.shards):
            m.load_state_dict(s.rpc_sync().state_dict())
        h = x
        for m in local:
            h = m(h)
        ref_loss = F.cross_entropy(h, y)
        ref_loss.backward()
        ref_grads = [p.grad for m in local for p in m.parameters()]
        if len(ref_grads) != len(dist_grads):
            raise RuntimeError(f"gradient check: {len(dist_grads)} distributed gradients for "
                               f"{len(ref_grads)} parameters")
        bad, worst = [], 0.0
        for i, (g, r) in enumerate(zip(dist_grads, ref_grads)):
            if g is None or not torch.allclose(g, r):
                bad.append(i)
            if g is not None:
                worst = max(worst, (g - r).abs().max().item())
        if bad or not torch.allclose(loss.detach(), ref_loss.detach()):
            raise RuntimeError(f"gradient check FAILED: parameters {bad} differ from the "
                               f"single-process gradients (max abs diff {worst:.3g})")
        self.graph_desc = desc
        self.graph_files, self.graph_engine = write_graph(desc, os.path.join(self.cfg["out"], GRAPH_BASE))
        return (f"gradient check: OK - distributed gradients match single-process gradients on all "
                f"{len(ref_grads)} parameters (torch.allclose; max abs diff {worst:.1e})")

    def traced_step(self, opt: Any, gen: Any) -> dict:
        """One more training step, recorded by distgrad.trace on every worker: trace.json
        (Perfetto / chrome://tracing) and trace.png (distgrad trace-plot's picture)."""
        import torch.nn.functional as F

        import distgrad
        import distgrad.autograd as dist_autograd
        from distgrad.trace.plot import plot

        torch, out = self.torch, self.cfg["out"]
        idx = torch.randint(0, len(self.xtr), (self.cfg["batch_size"],), generator=gen)
        x, y = self.xtr[idx], self.ytr[idx]
        path = os.path.join(out, TRACE_FILE)
        with distgrad.trace(path):
            with distgrad.trace.span("training step"), dist_autograd.context() as cid:
                with distgrad.trace.span("forward"):
                    logits = self.forward(x)
                with distgrad.trace.span("loss"):
                    loss = F.cross_entropy(logits, y)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
        picture = os.path.join(out, TRACE_PICTURE)
        text = plot(path, picture, title="distgrad demo: one training step, traced")
        return {"path": path, "picture": picture, "summary": text}

    # -- training --------------------------------------------------------------
    def main(self) -> None:
        torch = self.torch
        import torch.nn.functional as F

        import distgrad.autograd as dist_autograd
        from distgrad.optim import DistributedOptimizer

        from . import report
        from .model import describe_spec
        from .progress import progress

        cfg = self.cfg
        t_setup = time.perf_counter()
        self.load_data()
        self.build_model()
        print("model: ps: input scale+bias (Normalizer, 128 parameters); "
              + "; ".join(f"{n}: {describe_spec(sp)}" for n, sp in zip(self.stage_names, self.specs)),
              flush=True)
        print(f"data: scikit-learn digits, {len(self.xtr)} train / {len(self.xte)} test images (8x8)",
              flush=True)
        print(self.gradient_check(), flush=True)
        print(f"autograd graph of one step drawn by {self.graph_engine}: "
              f"{', '.join(os.path.basename(p) for p in self.graph_files)}", flush=True)

        opt = DistributedOptimizer(torch.optim.Adam, self.param_rrefs, lr=cfg["lr"])
        gen = torch.Generator().manual_seed(cfg["seed"])
        steps, bs = cfg["steps"], cfg["batch_size"]
        hist: dict[str, list] = {"step": [], "loss": [], "acc": [], "eval_step": [], "test_acc": []}
        fb_s = opt_s = 0.0
        driver_compute_s = 0.0
        eval_traffic: dict[str, tuple[int, int]] = {}
        for s in self.shards:
            s.rpc_sync().timing(reset=True)
        t_ready = time.perf_counter()
        b0 = self.traffic_snapshot()
        test_acc = float("nan")
        bar = progress(range(1, steps + 1), desc="training")
        for step in bar:
            idx = torch.randint(0, len(self.xtr), (bs,), generator=gen)
            x, y = self.xtr[idx], self.ytr[idx]
            t0 = time.perf_counter()
            with dist_autograd.context() as cid:
                logits = self.forward(x)
                c0 = time.perf_counter()
                loss = F.cross_entropy(logits, y)
                c1 = time.perf_counter()
                # the driver's share of the backward: from the loss's gradient to the logits'
                marks: dict[str, float] = {}
                loss.register_hook(_marker(marks, "loss"))
                logits.register_hook(_marker(marks, "logits"))
                dist_autograd.backward(cid, [loss])
                t1 = time.perf_counter()
                opt.step(cid)
            t2 = time.perf_counter()
            fb_s += t1 - t0
            opt_s += t2 - t1
            driver_compute_s += c1 - c0
            if "loss" in marks and "logits" in marks:
                driver_compute_s += max(0.0, marks["logits"] - marks["loss"])
            acc = (logits.detach().argmax(1) == y).float().mean().item()
            hist["step"].append(step)
            hist["loss"].append(loss.item())
            hist["acc"].append(acc)
            if step % cfg["eval_every"] == 0 or step == steps:
                e0 = self.traffic_snapshot()
                test_acc = self.test_accuracy()
                e1 = self.traffic_snapshot()
                for w in e1:
                    eval_traffic[w] = _add(eval_traffic.get(w, (0, 0)), _sub(e1[w], e0[w]))
                hist["eval_step"].append(step)
                hist["test_acc"].append(test_acc)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}", test_acc=f"{test_acc:.3f}")
        bar.close()
        b1 = self.traffic_snapshot()
        timings = {n: s.rpc_sync().timing() for n, s in zip(self.names[1:], self.shards)}
        train_s = fb_s + opt_s
        # bytes each worker sent; the evaluations (and the snapshots around them) are not training
        per_sender = {w: _sub(_sub(b1[w], b0[w]), eval_traffic.get(w, (0, 0))) for w in b1}
        train_msgs = sum(m for m, _ in per_sender.values())
        train_bytes = sum(b for _, b in per_sender.values())
        summary: dict[str, Any] = {
            "workers": self.names,
            "steps": steps, "batch_size": bs, "lr": cfg["lr"],
            "test_accuracy": hist["test_acc"][-1],
            "final_train_loss": hist["loss"][-1],
            "train_seconds": train_s,
            "steps_per_second": steps / train_s,
            "bytes_per_step": train_bytes / steps,
            "bytes_per_step_by_sender": {w: b / steps for w, (_, b) in per_sender.items()},
            "messages_per_step": train_msgs / steps,
            "forward_backward_seconds": fb_s,
            "optimizer_seconds": opt_s,
            "compute_seconds": {"driver": driver_compute_s,
                                **{n: t["forward_s"] + t["backward_s"] for n, t in timings.items()}},
            "compute_detail": timings,
            "setup_seconds": t_ready - t_setup,
            "history": hist,
            "graph": {"path": self.graph_files[0], "files": self.graph_files, "engine": self.graph_engine,
                      "nodes": sum(len(w["nodes"]) for w in self.graph_desc["workers"].values()),
                      "cross_worker_edges": len(self.graph_desc["cross_edges"])},
        }
        summary["trace"] = self.traced_step(opt, gen)
        summary["curves_path"] = report.plot_curves(hist, os.path.join(cfg["out"], CURVES_FILE))
        summary["summary_path"] = os.path.join(cfg["out"], "summary.json")
        report.write_summary(summary, summary["summary_path"])
        print(report.format_summary(summary), flush=True)


TRACE_FILE, TRACE_PICTURE = "trace.json", "trace.png"


def write_graph(desc: dict, base: str) -> tuple[list[str], str]:
    """The graph as ``base``.png and .svg (Graphviz's dot where installed, else
    matplotlib), .dot source and .json description; returns (paths, engine)."""
    from distgrad.graph import render, to_dot
    paths = [base + ".png", base + ".svg"]
    engine = render(desc, paths[0])
    render(desc, paths[1], engine=engine)
    from distgrad.safe_files import write_file
    write_file(base + ".dot", to_dot(desc))
    write_file(base + ".json", json.dumps(desc, indent=1))
    return paths + [base + ".dot", base + ".json"], engine


def _marker(marks: dict[str, float], key: str):
    def hook(grad):
        marks.setdefault(key, time.perf_counter())   # returns None: the gradient is unchanged
    return hook


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _sub(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] - b[0], a[1] - b[1]
