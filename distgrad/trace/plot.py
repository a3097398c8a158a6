"""``distgrad trace-plot trace.json -o step.png``: a trace drawn without a browser.

One row per worker (rank order), its time coloured by activity (computing,
serving, network, idle: :mod:`.summary`), an arrow per message from its send to
its arrival, the critical path as a line under the rows; the summary printed.
Needs matplotlib (``pip install distgrad[demo]``).

Example::

    >>> text = plot("trace.json", "step.png")
    >>> print(text.splitlines()[0])
    trace window 14.226 ms, 3 workers, 21 messages
"""
from __future__ import annotations

import json
import os

from ..safe_files import new_file
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = {w: i for i, w in enumerate(s.workers)}
    t0 = s.window[0]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * max(1, len(s.workers))))
    for w, segs in s.segments.items():
        if w not in rows:
            continue
        y = rows[w]
        for act in ("idle", "network", "serving", "computing"):
            bars = [((a - t0) / 1e3, (b - a) / 1e3) for a, b, k in segs if k == act]
            if bars:
                ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=COLOURS[act], edgecolor="none")
    for sender, sent, receiver, arrived in s.messages:
        if sender in rows and receiver in rows and sender != receiver:
            ax.annotate("", xy=((arrived - t0) / 1e3, rows[receiver]),
                        xytext=((sent - t0) / 1e3, rows[sender]),
                        arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 0.6, "alpha": 0.7})
    for w, a, b, label in s.path:
        if w in rows and not label.startswith("message"):
            y = rows[w] + 0.38
            ax.plot([(a - t0) / 1e3, (b - t0) / 1e3], [y, y], color="#c0392b", lw=2.2, solid_capstyle="butt")
    ax.set_yticks(range(len(s.workers)))
    ax.set_yticklabels([f"{w}\n" + " ".join(f"{k[0].upper()}{100 * s.shares[w][k]:.0f}%"
                                            for k in ("computing", "serving", "network")) for w in s.workers],
                       fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace's first event (tracing worker's clock)")
    ax.set_xlim(0, max((s.window[1] - t0) / 1e3, 1e-3))
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("computing", "serving", "network", "idle")]
    handles.append(plt.Line2D([], [], color="#c0392b", lw=2.2, label="critical path"))
    handles.append(plt.Line2D([], [], color="#333333", lw=0.8, marker=">", label="message"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8,
              frameon=False)
    fig.tight_layout()
    with new_file(out) as f:   # never through a link (see safe_files)
        fig.savefig(f, dpi=110, format=os.path.splitext(out)[1].lstrip(".").lower() or "png")
    plt.close(fig)


def main(args) -> int:
    """The ``trace-plot`` subcommand."""
    try:
        text = plot(args.trace, args.output, args.title)
    except (OSError, ValueError, KeyError) as e:
        print(f"distgrad trace-plot: cannot read {args.trace} as a distgrad trace: {e}")
        return 1
    except ImportError:
        print("distgrad trace-plot needs matplotlib: pip install 'distgrad[demo]'")
        return 1
    print(text)
    print(f"wrote {args.output}")
    return 0
