"""``distgrad trace-plot trace.json -o step.png``: a trace drawn without a browser.

One row per worker (rank order), its time coloured by activity (computing,
serving, network, idle: :mod:`.summary`), its phases above it (user spans, backward,
optimizer, named), a thin row per busy thread under it with that thread's spans
(named where wide enough), failed calls marked with a red x, a missing worker's row
saying why, a line per message from its send to its arrival, the critical path as a
line under the rows; the summary printed. Drawn
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
import os

from ..errors import DistgradError
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


# a thread's spans, drawn in this order (the outer kinds first, the inner ones over them)
_SPAN_COLOURS = {"rpc.wait": "#b9cce6", "backward.call": "#b9cce6", "optim.call": "#b9cce6",
                 "rpc.call": "#4a7fc1", "rpc.serve": "#3c9d4e", "backward": "#e8871e",
                 "backward.region": "#e8871e", "optim": "#e8871e", "op": "#f0b46a", "rpc.send": "#4a7fc1",
                 "rpc.recv": "#4a7fc1"}
_PHASES = {"user": "#9e9e9e", "user.wait": "#9e9e9e", "backward.call": "#8e44ad", "optim.call": "#8d6e63"}
_LANES = 6         # thread rows drawn per worker (the busiest)
_LABEL_SHARE = 0.03  # a span gets its name written on it when it is this much of the window


def _rows(s: Summary) -> list[tuple[str, str, int | None, float]]:
    """(kind, worker, tid, y): a row per worker (its activities), under it a thin row per
    thread that did something, the busiest first; a missing worker gets a row too."""
    rows, y = [], 0.0
    for w in s.workers + [m for m in s.missing if m not in s.workers]:
        y += 0.15  # the phase bands above the row
        rows.append(("worker", w, None, y))
        y += 0.75
        busy: dict[int, float] = {}
        for a, b, _, cat, tid, *_ in s.spans.get(w, ()):
            if cat in _SPAN_COLOURS:
                busy[tid] = busy.get(tid, 0.0) + (b - a)
        for tid in sorted(busy, key=lambda t: -busy[t])[:_LANES]:
            rows.append(("thread", w, tid, y))
            y += 0.32
        y += 0.35
    return rows


def draw(s: Summary, out: str, title: str) -> None:
    """Draw the summary ``s`` to the image file ``out``: per worker its activities, the
    phases (user spans, backward, optimizer) above them, a row per busy thread with
    its spans (named where they are wide enough), failed calls marked, messages and
    the critical path; a missing worker's row says why it is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Patch

    t0, width = s.window[0], max(s.window[1] - s.window[0], 1e-3)

    def ms(t: float) -> float:
        return (t - t0) / 1e3

    rows = _rows(s)
    ys = {w: y for kind, w, _, y in rows if kind == "worker"}
    height = rows[-1][3] + 1 if rows else 1
    fig, ax = plt.subplots(figsize=(13, 1.8 + 0.75 * height))
    for kind, w, tid, y in rows:
        if kind == "worker" and w not in s.segments:
            ax.broken_barh([(0, ms(s.window[1]))], (y - 0.25, 0.5), facecolors="none", edgecolor="#c0392b",
                           hatch="//", linewidth=0.5)
            ax.text(ms(s.window[1]) / 2, y, f"{w} missing: {s.missing.get(w, '')}"[:150], ha="center",
                    va="center", fontsize=7, color="#c0392b")
        elif kind == "worker":
            for act in ("idle", "network", "serving", "computing"):
                bars = [(ms(a), (b - a) / 1e3) for a, b, k in s.segments[w] if k == act]
                if bars:
                    ax.broken_barh(bars, (y - 0.25, 0.5), facecolors=COLOURS[act], edgecolor="none")
            _phases(ax, s, w, y, ms, width)
        else:
            _thread(ax, s, w, tid, y, ms, width)
    _failures(ax, s, ys, ms)
    msgs = [((ms(sent), ys[snd]), (ms(arr), ys[rcv])) for snd, sent, rcv, arr, *_ in s.messages
            if snd in ys and rcv in ys and snd != rcv]
    if msgs:
        ax.add_collection(LineCollection(msgs, colors="#333333", linewidths=0.6, alpha=0.6))
        ax.scatter([b[0] for _, b in msgs], [b[1] for _, b in msgs], s=4, color="#333333", zorder=3)
    path = [((ms(a), ys[w] + 0.3), (ms(b), ys[w] + 0.3)) for w, a, b, label, _ in s.path
            if w in ys and not label.startswith("message")]
    if path:
        ax.add_collection(LineCollection(path, colors="#c0392b", linewidths=2.2, capstyle="butt"))
    ax.set_yticks([y for *_, y in rows])
    ax.set_yticklabels([_row_label(s, kind, w, tid) for kind, w, tid, _ in rows], fontsize=7)
    ax.set_ylim(height - 0.3, -0.75)
    ax.set_xlabel("ms since the tracing worker started (its clock)")
    ax.set_xlim(0, max(ms(s.window[1]), 1e-3))
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("computing", "serving", "network", "idle")]
    handles += [Patch(color=_SPAN_COLOURS["rpc.wait"], label="waiting (thread rows)"),
                Patch(color=_PHASES["user"], label="user span"), Patch(color=_PHASES["backward.call"],
                                                                      label="backward"),
                Patch(color=_PHASES["optim.call"], label="optimizer")]
    handles.append(plt.Line2D([], [], color="#c0392b", lw=2.2, label="critical path"))
    handles.append(plt.Line2D([], [], color="#333333", lw=0.8, marker=".", label="message"))
    handles.append(plt.Line2D([], [], color="#c0392b", lw=0, marker="x", label="failed call"))
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    try:
        with new_file(out) as f:   # never through a link (see safe_files)
            fig.savefig(f, dpi=110, format=os.path.splitext(out)[1].lstrip(".").lower() or "png")
    except (OSError, DistgradError, ValueError) as e:  # the output (directory, file, format), not the trace
        raise _WriteError(str(e)) from e
    finally:
        plt.close(fig)


def _row_label(s: Summary, kind: str, w: str, tid: int | None) -> str:
    if kind == "thread":
        return f"  {s.threads.get((w, tid), f'thread {tid}')[:22]}"
    if w not in s.shares:
        return f"{w}\n(missing)"
    return f"{w}\n" + " ".join(f"{k[0].upper()}{100 * s.shares[w][k]:.0f}%" for k in ("computing", "serving",
                                                                                      "network"))


def _phases(ax, s: Summary, w: str, y: float, ms, width: float) -> None:
    """The worker's phases in two bands above its row: user spans (outermost named),
    then the backward and the optimizer."""
    for band, cats in ((y - 0.5, ("user", "user.wait")), (y - 0.37, ("backward.call", "optim.call"))):
        spans = sorted((sp for sp in s.spans.get(w, ()) if sp[3] in cats and sp[1] > s.window[0]
                        and sp[0] < s.window[1]), key=lambda sp: (sp[0], -sp[1]))
        for colour in {_PHASES[sp[3]] for sp in spans}:  # one artist per colour, not one per span
            ax.broken_barh([(ms(a), (b - a) / 1e3) for a, b, _, cat, *_ in spans if _PHASES[cat] == colour],
                           (band, 0.11), facecolors=colour, edgecolor="white", linewidth=0.3)
        last = -1e300
        for a, b, name, *_ in spans:
            if b - a >= _LABEL_SHARE * width and a >= last:
                ax.text(ms(max(a, s.window[0])), band - 0.01, name[:40], fontsize=6, va="bottom",
                        clip_on=True)
                last = b


def _thread(ax, s: Summary, w: str, tid: int, y: float, ms, width: float) -> None:
    """One thread's spans (outermost under innermost), named where wide enough."""
    spans = [sp for sp in s.spans.get(w, ()) if sp[4] == tid and sp[3] in _SPAN_COLOURS]
    for cat in _SPAN_COLOURS:
        bars = [(ms(a), (b - a) / 1e3) for a, b, _, c, *_ in spans if c == cat]
        if bars:
            ax.broken_barh(bars, (y - 0.12, 0.24), facecolors=_SPAN_COLOURS[cat], edgecolor="none")
    wide = sorted((sp for sp in spans if sp[1] - sp[0] >= _LABEL_SHARE * width), key=lambda sp: sp[0])
    last = -1.0
    for a, b, name, *_ in wide[:60]:
        if a >= last:  # never write over the previous label
            ax.text(ms(max(a, s.window[0])), y, name[:48], fontsize=5.5, va="center", clip_on=True)
            last = b


def failures(s: Summary) -> list[tuple[str, float]]:
    """(worker, µs) of every failed call in ``s``: an error reply sent or received."""
    return [(w, a) for w, spans in s.spans.items() for a, _, name, *_ in spans
            if name.startswith("send error") or name.startswith("recv error")]


def _failures(ax, s: Summary, ys: dict, ms) -> None:
    """A red x on the worker's row where a call failed."""
    points = [(ms(a), ys[w]) for w, a in failures(s) if w in ys]
    if points:
        ax.scatter([x for x, _ in points], [y for _, y in points], marker="x", s=30, color="#c0392b",
                   zorder=4)


class _WriteError(Exception):
    """The image could not be written (its directory, its file)."""


def main(args) -> int:
    """The ``trace-plot`` subcommand: one line saying what is wrong, the trace (cannot
    read it) or the output (cannot write it), instead of a traceback."""
    where = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(where):   # as savefig or cp: a file is written, no folder made
        print(f"distgrad trace-plot: cannot write {args.output}: the folder {where} does not "
              f"exist (create it first: mkdir -p {where})")
        return 1
    try:
        with open(args.trace) as f:
            doc = json.load(f)
        s = summarize(doc)
        text = report(s)
        draw(s, args.output, args.title or f"distgrad trace: {args.trace}")
    except ImportError:
        print("distgrad trace-plot needs matplotlib: pip install 'distgrad[demo]'")
        return 1
    except _WriteError as e:
        print(f"distgrad trace-plot: cannot write {args.output}: {_first(e.__cause__ or e)}")
        return 1
    except Exception as e:  # noqa: BLE001 - one line on what is wrong with the file, no traceback
        print(f"distgrad trace-plot: cannot read {args.trace} as a distgrad trace: {_first(e)}")
        return 1
    print(text)
    print(f"wrote {args.output}")
    return 0


def _first(e: BaseException) -> str:
    """The first line of an error's message (its type where it has none)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__
