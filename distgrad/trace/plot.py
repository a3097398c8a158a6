"""``distgrad trace-plot trace.json -o step.png``: a trace drawn without a browser.

One row per worker (rank order), its time coloured by activity (computing,
serving, network, idle: :mod:`.summary`), a line per message from its send to its
arrival, the critical path as a line under the rows; the summary printed. Drawn
with collections (one artist per kind, not one per message): linear in the trace.
A file that is not a distgrad trace gets one line saying what is wrong. Needs
matplotlib (``pip install distgrad[demo]``).

Example::

    >>> text = plot("trace.json", "step.png")
    >>> print(text.splitlines()[0])
    trace window 14.226 ms (the tracing worker's), 3 workers, 21 messages
"""
from __future__ import annotations

import json

from .summary import Summary, report, summarize

COLOURS = {"computing": "#e8871e", "serving": "#3c9d4e", "network": "#4a7fc1", "idle": "#eeeeee"}


def plot(path: str, out: str, title: str | None = None) -> str:
    """Draw ``path`` (a distgrad trace) to the image ``out``; returns the summary text."""
    with open(path) as f:
        doc = json.load(f)
    s = summarize(doc)
    draw(s, out, title or f"distgrad trace: {path}")
    return report(s)


def draw(s: Summary, out: str, title: str) -> None:
    """Draw the summary ``s`` to the image file ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Patch

    rows = {w: i for i, w in enumerate(s.workers)}
    t0 = s.window[0]

    def ms(t: float) -> float:
        return (t - t0) / 1e3

    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.9 * max(1, len(s.workers))))
    for w, segs in s.segments.items():
        if w not in rows:
            continue
        y = rows[w]
        for act in ("idle", "network", "serving", "computing"):
            bars = [(ms(a), (b - a) / 1e3) for a, b, k in segs if k == act]
            if bars:
                ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=COLOURS[act], edgecolor="none")
    msgs = [((ms(sent), rows[snd]), (ms(arr), rows[rcv])) for snd, sent, rcv, arr, *_ in s.messages
            if snd in rows and rcv in rows and snd != rcv]
    if msgs:
        ax.add_collection(LineCollection(msgs, colors="#333333", linewidths=0.6, alpha=0.6))
        ax.scatter([b[0] for _, b in msgs], [b[1] for _, b in msgs], s=4, color="#333333", zorder=3)
    path = [((ms(a), rows[w] + 0.38), (ms(b), rows[w] + 0.38)) for w, a, b, label, _ in s.path
            if w in rows and not label.startswith("message")]
    if path:
        ax.add_collection(LineCollection(path, colors="#c0392b", linewidths=2.2, capstyle="butt"))
    ax.set_yticks(range(len(s.workers)))
    ax.set_yticklabels([f"{w}\n" + " ".join(f"{k[0].upper()}{100 * s.shares[w][k]:.0f}%"
                                            for k in ("computing", "serving", "network")) for w in s.workers],
                       fontsize=8)
    ax.set_ylim(len(s.workers) - 0.4, -0.6)
    ax.set_xlabel("ms since the tracing worker started (its clock)")
    ax.set_xlim(0, max(ms(s.window[1]), 1e-3))
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("computing", "serving", "network", "idle")]
    handles.append(plt.Line2D([], [], color="#c0392b", lw=2.2, label="critical path"))
    handles.append(plt.Line2D([], [], color="#333333", lw=0.8, marker=".", label="message"))
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(args) -> int:
    """The ``trace-plot`` subcommand."""
    try:
        text = plot(args.trace, args.output, args.title)
    except ImportError:
        print("distgrad trace-plot needs matplotlib: pip install 'distgrad[demo]'")
        return 1
    except Exception as e:  # noqa: BLE001 - one line on what is wrong with the file, no traceback
        what = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"distgrad trace-plot: cannot read {args.trace} as a distgrad trace: {what}")
        return 1
    print(text)
    print(f"wrote {args.output}")
    return 0
