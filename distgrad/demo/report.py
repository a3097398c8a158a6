"""The demo's outputs: training curves (matplotlib, Agg), summary.json and the
printed summary."""
from __future__ import annotations

import json
import os
from typing import Any

from ..safe_files import new_file


def plot_curves(hist: dict[str, list], path: str) -> str:
    """Loss and accuracy curves into ``path`` (PNG); returns the path."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(hist["step"], hist["loss"], color="#2166ac", lw=0.8, alpha=0.5, label="batch loss")
    sm = _smooth(hist["loss"])
    ax1.plot(hist["step"], sm, color="#2166ac", lw=2, label="mean of last 10")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy loss")
    ax1.set_title("training loss")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(hist["step"], _smooth(hist["acc"]), color="#1b7837", lw=1.5,
             label="train batch (mean of last 10)")
    ax2.plot(hist["eval_step"], hist["test_acc"], "o-", color="#b2182b", ms=3, lw=1.5,
             label="held-out test")
    ax2.set_xlabel("step")
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(0, 1.02)
    ax2.set_title("accuracy")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="lower right")
    fig.suptitle("distgrad demo: model-parallel digits classifier")
    fig.tight_layout()
    with new_file(path) as f:   # never through a link (see distgrad.safe_files)
        fig.savefig(f, dpi=110, format=os.path.splitext(path)[1].lstrip(".").lower() or "png")
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int = 10) -> list[float]:
    """Mean of the last ``window`` values at each point."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_summary(summary: dict[str, Any], path: str) -> None:
    with new_file(path, binary=False) as f:
        json.dump(summary, f, indent=1)


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def format_summary(s: dict[str, Any]) -> str:
    steps = s["steps"]
    ms = lambda sec: f"{1000 * sec / steps:.2f} ms"
    compute = sum(s["compute_seconds"].values())
    fb, opt = s["forward_backward_seconds"], s["optimizer_seconds"]
    total = fb + opt
    comm = max(0.0, fb - compute)
    pct = lambda x: f"{100 * x / total:.1f}%"
    by_sender = ", ".join(f"{w} {_kib(v)}" for w, v in s["bytes_per_step_by_sender"].items())
    comp_by = ", ".join(f"{w} {ms(v)}" for w, v in s["compute_seconds"].items())
    w = s["workers"]
    lines = ["", "== distgrad demo summary =="]
    add = lines.append
    add(f"cluster          {len(w)} processes on 127.0.0.1: {', '.join(w)}")
    add(f"test accuracy    {100 * s['test_accuracy']:.1f}% on the held-out split "
        f"(final train loss {s['final_train_loss']:.3f})")
    add(f"speed            {steps} steps of batch {s['batch_size']} in {s['train_seconds']:.2f} s: "
        f"{s['steps_per_second']:.1f} steps/s")
    add(f"traffic          {_kib(s['bytes_per_step'])} in {s['messages_per_step']:.1f} messages sent "
        f"per step, all workers together")
    add(f"                 (rpc._get_debug_info per-peer counters; by sender: {by_sender})")
    add(f"time per step    {ms(total)}:")
    add(f"  compute        {ms(compute)} ({pct(compute)}) - forward+backward measured inside the "
        f"model code on each worker ({comp_by})")
    add(f"  communication  {ms(comm)} ({pct(comm)}) - rest of forward+backward: RPCs, "
        f"serialization, waiting (for peers and the CPU), engine bookkeeping")
    add(f"  optimizer      {ms(opt)} ({pct(opt)}) - DistributedOptimizer.step: Adam on each owner, "
        f"incl. its RPCs")
    if s.get("trace"):
        add(f"one step traced  {s['trace']['path']}: open it at https://ui.perfetto.dev (or "
            f"chrome://tracing); drawn in {os.path.basename(s['trace']['picture'])}")
    add("files written:")
    files = files_written(s)
    width = max(len(p) for p, _ in files)
    for path, what in files:
        add(f"  {path:<{width}}  {what}")
    return "\n".join(lines)


def files_written(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, what it shows) for every file the demo wrote, pictures first."""
    g = s["graph"]
    graph = (f"one training step's autograd graph ({g['nodes']} nodes): a box per worker, "
             f"red arrows = tensors sent between workers (bytes, shapes)")
    engine = {"dot": "Graphviz's dot", "matplotlib": "matplotlib (no Graphviz 'dot' on PATH)"}
    what = {".png": f"{graph}; drawn by {engine.get(g['engine'], g['engine'])}",
            ".svg": "the same graph as a scalable picture (open it in a browser)",
            ".dot": "the graph's Graphviz source (dot -Tpdf ... renders it anew)",
            ".json": "the graph's description: nodes, edges, bytes per cross-worker edge"}
    out = [(s["curves_path"], "loss and accuracy over the training steps (train batches, held-out test)")]
    for path in g.get("files", [g["path"]]):
        out.append((path, what.get(os.path.splitext(path)[1], "the autograd graph")))
    if s.get("trace"):
        out.append((s["trace"]["picture"], "one traced step: workers as rows (computing / serving / "
                                           "network / idle), messages as arrows, the critical path"))
        out.append((s["trace"]["path"], "that step's trace (Chrome trace-event JSON): open it at "
                                        "https://ui.perfetto.dev or chrome://tracing"))
    if s.get("summary_path"):
        out.append((s["summary_path"], "these numbers and the per-step history (JSON)"))
    return out
