"""Draw a distributed autograd graph with matplotlib alone (no Graphviz).

The fallback of :func:`distgrad.graph.export.export_graph` where
Graphviz's ``dot`` is not installed; it draws what ``dot`` draws (a box per
worker, cross-worker edges labelled with their bytes and tensor shapes)
from a description made by ``describe_graph``.

Layout, a small Sugiyama-style one:

1. layers: the longest path from the sources (forward data flow goes down),
   then every node with successors moved down to just above its first
   successor, so that leaves sit next to their consumer;
2. workers are columns, ordered so that cross-worker edges are short and do
   not cross another worker's box (all orders are tried up to 6 workers);
3. a local edge spanning several layers runs through placeholder slots in
   its worker's column, so that it never crosses a node;
4. the order inside each (worker, layer) cell is improved by barycenter
   sweeps, then nodes move towards their neighbours (straighter edges);
5. worker titles and edge labels take the first candidate position that
   overlaps no node, title, label or edge.

Example::

    desc = describe_graph(cid, roots=[loss])
    draw(desc, "step.png")          # also .svg or .pdf
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..safe_files import new_file
from .labels import COLORS, CROSS_COLOR, edge_label, node_label, title

__all__ = ["draw", "layout"]

NODE_FONT = 8.0
EDGE_FONT = 7.5
TITLE_FONT = 10.0
H_GAP = 0.25        # inches between neighbouring nodes of one worker
COL_GAP = 0.45      # inches between worker boxes, at least (room for an edge label)
PAD = 0.14          # inside a worker box, around its nodes
MIN_V_GAP = 0.5     # inches between layers (edge labels live there)
MIN_WIDTH = 5.5     # inches: the title and legend need that much
LEGEND_ONE_ROW = 7.5
_ALONG = sorted((k / 20 for k in range(2, 19)), key=lambda t: (abs(t - 0.5), t))  # label spots


@dataclass
class Item:
    """A node (or a placeholder slot of a long local edge) with its place."""
    id: str
    worker: int
    label: str = ""
    kind: str = "op"
    root: bool = False
    dummy: bool = False
    layer: int = 0
    x: float = 0.0      # centre, inches
    y: float = 0.0


@dataclass
class Layout:
    items: dict[str, Item]
    edges: list[tuple[list[str], bool, str]]    # (path of item ids, cross-worker?, label)
    columns: list[int]                          # worker ranks, left to right
    boxes: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # x0,y0,x1,y1
    node_w: float = 1.5
    node_h: float = 0.4
    width: float = 0.0
    height: float = 0.0


# -- measuring text -------------------------------------------------------------------
class _Ruler:
    def __init__(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        self.fig = Figure(dpi=72)
        FigureCanvasAgg(self.fig)
        self.renderer = self.fig.canvas.get_renderer()

    def size(self, text: str, fontsize: float) -> tuple[float, float]:
        """(width, height) of ``text`` in inches."""
        t = self.fig.text(0, 0, text, fontsize=fontsize, ha="left", va="bottom")
        bb = t.get_window_extent(self.renderer)
        t.remove()
        return bb.width / 72.0, bb.height / 72.0


# -- the graph ---------------------------------------------------------------------------
def _graph(desc: dict) -> tuple[dict[str, Item], list[tuple[str, str, bool, str]]]:
    names = {int(w): wd["name"] for w, wd in desc["workers"].items()}
    items: dict[str, Item] = {}
    for w, wd in desc["workers"].items():
        w = int(w)
        for n in wd["nodes"]:
            items[n["id"]] = Item(n["id"], w, node_label(n, names), n["kind"], bool(n.get("root")))
        if not wd["nodes"]:   # a worker that could not describe its share still gets a box
            why = str(wd.get("error", "no nodes"))[:40]
            items[f"w{w}-empty"] = Item(f"w{w}-empty", w, f"(no graph)\n{why}", "op")
    tensors = {n["id"]: n.get("tensors") or [] for wd in desc["workers"].values() for n in wd["nodes"]}
    edges: list[tuple[str, str, bool, str]] = []
    seen: set[tuple[str, str]] = set()
    for wd in desc["workers"].values():
        for a, b in wd["edges"]:
            if a in items and b in items and a != b and (a, b) not in seen:
                seen.add((a, b))
                edges.append((a, b, False, ""))
    for e in desc["cross_edges"]:
        a, b = e["src"], e["dst"]
        if a in items and b in items and (a, b) not in seen:
            seen.add((a, b))
            edges.append((a, b, True, edge_label(e, tensors.get(a, []))))
    return items, edges


def _acyclic(ids: Sequence[str], edges: Sequence[tuple[str, str, bool, str]]) -> list[tuple[str, str]]:
    """The edges without those that close a cycle (found by depth-first search)."""
    succ: dict[str, list[str]] = {i: [] for i in ids}
    for a, b, _, _ in edges:
        succ[a].append(b)
    state: dict[str, int] = {}
    back: set[tuple[str, str]] = set()
    for start in ids:
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(succ[start]))]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                back.add((node, nxt))
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
    return [(a, b) for a, b, _, _ in edges if (a, b) not in back]


def _layers(ids: Sequence[str], dag: Sequence[tuple[str, str]]) -> dict[str, int]:
    succ: dict[str, list[str]] = {i: [] for i in ids}
    indeg = dict.fromkeys(ids, 0)
    for a, b in dag:
        succ[a].append(b)
        indeg[b] += 1
    order, ready = [], [i for i in ids if indeg[i] == 0]
    while ready:
        n = ready.pop(0)
        order.append(n)
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    layer = dict.fromkeys(ids, 0)
    for n in order:                          # longest path from the sources
        for s in succ[n]:
            layer[s] = max(layer[s], layer[n] + 1)
    for n in reversed(order):                # as late as the successors allow
        if succ[n]:
            layer[n] = max(layer[n], min(layer[s] for s in succ[n]) - 1)
    return layer


def _column_order(workers: list[int], spans: dict[int, tuple[int, int]],
                  cross: list[tuple[int, int, int, int]]) -> list[int]:
    """Workers left to right: short cross edges that pass no other worker's box."""
    if len(workers) > 6 or not cross:
        return workers

    def cost(order: tuple[int, ...]) -> int:
        pos = {w: i for i, w in enumerate(order)}
        total = 0
        for wa, wb, la, lb in cross:
            lo, hi = sorted((pos[wa], pos[wb]))
            total += hi - lo
            for w in order[lo + 1:hi]:
                s0, s1 = spans[w]
                if s0 <= max(la, lb) and min(la, lb) <= s1:
                    total += 100
        return total

    return list(min(itertools.permutations(workers), key=cost))


def layout(desc: dict, ruler: _Ruler | None = None) -> Layout:
    """Place every node of ``desc`` (see ``describe_graph``); sizes in inches."""
    ruler = ruler or _Ruler()
    items, edges = _graph(desc)
    if not items:
        raise ValueError("distgrad.graph.draw.layout: the description has no workers")
    ids = list(items)
    dag = _acyclic(ids, edges)
    layer = _layers(ids, dag)
    for i, it in items.items():
        it.layer = layer[i]
    workers = sorted({it.worker for it in items.values()})
    spans = {w: (min(it.layer for it in items.values() if it.worker == w),
                 max(it.layer for it in items.values() if it.worker == w)) for w in workers}
    cross = [(items[a].worker, items[b].worker, layer[a], layer[b]) for a, b, c, _ in edges if c]
    columns = _column_order(workers, spans, cross)

    # long local edges run through placeholder slots, one per layer crossed
    paths: list[tuple[list[str], bool, str]] = []
    in_dag = set(dag)
    for a, b, is_cross, label in edges:
        path = [a]
        if not is_cross and (a, b) in in_dag:
            for k in range(layer[a] + 1, layer[b]):
                d = f"{a}>{b}@{k}"
                items[d] = Item(d, items[a].worker, dummy=True, layer=k)
                path.append(d)
        path.append(b)
        paths.append((path, is_cross, label))

    # cells: (worker, layer) -> item ids in order
    cells: dict[tuple[int, int], list[str]] = {}
    for i, it in items.items():
        cells.setdefault((it.worker, it.layer), []).append(i)
    slots = {w: max(len(v) for (cw, _), v in cells.items() if cw == w) for w in workers}

    sizes = {i: ruler.size(it.label, NODE_FONT) for i, it in items.items() if not it.dummy}
    node_w = max(w for w, _ in sizes.values()) + 0.25
    node_h = max(h for _, h in sizes.values()) + 0.14
    label_sizes = [ruler.size(p[2], EDGE_FONT) for p in paths if p[1]]
    label_h = max([h for _, h in label_sizes] or [0.0])
    col_gap = max([COL_GAP] + [w + 0.3 for w, _ in label_sizes])
    v_gap = max(MIN_V_GAP, label_h + 0.3)
    title_h = ruler.size("Ag", TITLE_FONT)[1]
    pitch = node_w + H_GAP

    left: dict[int, float] = {}
    x = 0.0
    for w in columns:
        left[w] = x
        x += 2 * PAD + slots[w] * node_w + (slots[w] - 1) * H_GAP + col_gap
    width = x - col_gap

    def slot_x(w: int, k: float) -> float:
        return left[w] + PAD + node_w / 2 + k * pitch

    # initial x: centred in the column
    for (w, _), cell in cells.items():
        off = (slots[w] - len(cell)) / 2
        for k, i in enumerate(cell):
            items[i].x = slot_x(w, off + k)

    nbrs_up: dict[str, list[str]] = {i: [] for i in items}
    nbrs_down: dict[str, list[str]] = {i: [] for i in items}
    for path, _, _ in paths:
        for a, b in zip(path, path[1:]):
            nbrs_down[a].append(b)
            nbrs_up[b].append(a)

    def mean_x(i: str, which: Sequence[dict[str, list[str]]]) -> float | None:
        xs = [items[j].x for m in which for j in m[i]]
        return sum(xs) / len(xs) if xs else None

    def place(w: int, cell: list[str], which) -> None:
        """Order ``cell`` by its neighbours' mean x, then put each as near it as allowed."""
        want = {i: mean_x(i, which) for i in cell}
        cell.sort(key=lambda i: want[i] if want[i] is not None else items[i].x)
        lo, hi = slot_x(w, 0), slot_x(w, slots[w] - 1)
        xs = [min(max(want[i] if want[i] is not None else items[i].x, lo), hi) for i in cell]
        for k in range(1, len(xs)):
            xs[k] = max(xs[k], xs[k - 1] + pitch)
        if xs and xs[-1] > hi:
            xs[-1] = hi
            for k in range(len(xs) - 2, -1, -1):
                xs[k] = min(xs[k], xs[k + 1] - pitch)
        for i, xi in zip(cell, xs):
            items[i].x = xi

    n_layers = max(layer.values(), default=0) + 1
    by_layer = [[(w, cells[(w, k)]) for w in columns if (w, k) in cells] for k in range(n_layers)]
    for _ in range(4):
        for row in by_layer:
            for w, cell in row:
                place(w, cell, (nbrs_up,))
        for row in reversed(by_layer):
            for w, cell in row:
                place(w, cell, (nbrs_down,))
    for row in by_layer:      # final: both sides
        for w, cell in row:
            place(w, cell, (nbrs_up, nbrs_down))

    row_pitch = node_h + v_gap
    top = 0.15 + ruler.size(title(desc), TITLE_FONT + 1)[1] + 0.3   # the figure's title above
    for it in items.values():
        it.y = -(top + title_h + PAD + node_h / 2 + it.layer * row_pitch)
    boxes = {}
    for w in columns:
        s0, s1 = spans[w]
        y_top = -(top + s0 * row_pitch)
        y_bot = -(top + title_h + 2 * PAD + node_h + s1 * row_pitch)
        boxes[w] = (left[w], y_bot, left[w] + 2 * PAD + slots[w] * node_w + (slots[w] - 1) * H_GAP, y_top)
    legend_rows = 1 if width >= LEGEND_ONE_ROW else 2
    height = top + title_h + 2 * PAD + node_h + (n_layers - 1) * row_pitch + 0.3 + 0.2 * legend_rows
    return Layout(items, paths, columns, boxes, node_w, node_h, width, height)


# -- drawing ----------------------------------------------------------------------------
def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _hits_segment(r: tuple[float, float, float, float], p: tuple[float, float],
                  q: tuple[float, float]) -> bool:
    """Does segment p-q meet rectangle r (x0, y0, x1, y1)? (Liang-Barsky clipping)"""
    dx, dy = q[0] - p[0], q[1] - p[1]
    t0, t1 = 0.0, 1.0
    for den, num in ((-dx, p[0] - r[0]), (dx, r[2] - p[0]), (-dy, p[1] - r[1]), (dy, r[3] - p[1])):
        if den == 0:
            if num < 0:
                return False
            continue
        t = num / den
        if den < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return False
    return True


class _Free:
    """Rectangles and segments already drawn: where new text must not go."""

    def __init__(self) -> None:
        self.rects: list[tuple[float, float, float, float]] = []
        self.segs: list[tuple[tuple[float, float], tuple[float, float]]] = []

    def fits(self, r) -> bool:
        if any(_overlaps(r, o) for o in self.rects):
            return False
        return not any(_hits_segment(r, p, q) for p, q in self.segs)


def _attach_offsets(lay: Layout) -> tuple[dict[int, float], dict[int, float]]:
    """Where each edge leaves its source and enters its target, as an x offset
    from the node's centre: edges that share a node are spread along its side
    in the order of the nodes at their other ends (fewer crossings)."""
    outs: dict[str, list[tuple[float, int]]] = {}
    ins: dict[str, list[tuple[float, int]]] = {}
    for e, (path, _, _) in enumerate(lay.edges):
        outs.setdefault(path[0], []).append((lay.items[path[1]].x, e))
        ins.setdefault(path[-1], []).append((lay.items[path[-2]].x, e))
    step_max = 0.22

    def spread(ends: dict[str, list[tuple[float, int]]]) -> dict[int, float]:
        off: dict[int, float] = {}
        for lst in ends.values():
            lst.sort()
            step = min(step_max, lay.node_w * 0.7 / max(1, len(lst)))
            for k, (_, e) in enumerate(lst):
                off[e] = (k - (len(lst) - 1) / 2) * step
        return off

    return spread(outs), spread(ins)


def _endpoints(lay: Layout, path: list[str], out_dx: float, in_dx: float) -> list[tuple[float, float]]:
    pts = []
    half = lay.node_h / 2
    for k, i in enumerate(path):
        it = lay.items[i]
        if it.dummy:
            pts.append((it.x, it.y))
        elif k == 0:
            down = lay.items[path[1]].y < it.y
            pts.append((it.x + out_dx, it.y - half if down else it.y + half))
        else:
            down = lay.items[path[k - 1]].y > it.y
            pts.append((it.x + in_dx, it.y + half if down else it.y - half))
    return pts


def draw(desc: dict, path: str, fmt: str | None = None) -> str:
    """Render ``desc`` (from ``describe_graph``) into ``path`` with matplotlib.

    The format follows the extension (``png``, ``svg``, ``pdf``) unless
    ``fmt`` is given. Needs matplotlib (``pip install matplotlib``); uses the
    Agg canvas, never a window. Returns ``path``.

    Example::

        draw(describe_graph(cid, roots=[loss]), "graph.png")
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    from matplotlib.path import Path

    ruler = _Ruler()
    lay = layout(desc, ruler)
    margin = 0.3
    extra = max(0.0, MIN_WIDTH - lay.width) / 2
    fig = Figure(figsize=(lay.width + 2 * (margin + extra), lay.height), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-margin - extra, lay.width + margin + extra)
    ax.set_ylim(-lay.height, 0)
    ax.axis("off")
    free = _Free()
    cx = lay.width / 2
    ax.text(cx, -0.15, title(desc), ha="center", va="top", fontsize=TITLE_FONT + 1)
    th = ruler.size(title(desc), TITLE_FONT + 1)[1]
    free.rects.append((cx - 4, -0.15 - th, cx + 4, 0))

    # nodes
    hw, hh = lay.node_w / 2, lay.node_h / 2
    for it in lay.items.values():
        if it.dummy:
            continue
        ax.add_patch(FancyBboxPatch((it.x - hw, it.y - hh), lay.node_w, lay.node_h,
                                    boxstyle="round,pad=0,rounding_size=0.08",
                                    fc=COLORS[it.kind], ec="black", lw=2.0 if it.root else 0.8, zorder=3))
        ax.text(it.x, it.y, it.label, ha="center", va="center", fontsize=NODE_FONT, zorder=4,
                linespacing=1.15)
        free.rects.append((it.x - hw, it.y - hh, it.x + hw, it.y + hh))

    # edges
    drawn: list[tuple[list[tuple[float, float]], bool, str]] = []
    out_dx, in_dx = _attach_offsets(lay)
    for e, (ids, is_cross, label) in enumerate(lay.edges):
        pts = _endpoints(lay, ids, out_dx[e], in_dx[e])
        codes = [Path.MOVETO] + [Path.LINETO] * (len(pts) - 1)
        color, lw = (CROSS_COLOR, 1.6) if is_cross else ("black", 0.9)
        ax.add_patch(FancyArrowPatch(path=Path(pts, codes), arrowstyle="-|>,head_length=5,head_width=2.5",
                                     color=color, lw=lw, zorder=2, shrinkA=0, shrinkB=0))
        for p, q in zip(pts, pts[1:]):
            free.segs.append((p, q))
        drawn.append((pts, is_cross, label))

    # worker boxes and their titles
    for w in lay.columns:
        x0, y0, x1, y1 = lay.boxes[w]
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.12",
                                    fc="none", ec="#555555", lw=1.0, zorder=1))
        wd = desc["workers"].get(w, desc["workers"].get(str(w), {}))
        text = f"{wd.get('name', f'worker{w}')} (rank {w})"
        tw, th = ruler.size(text, TITLE_FONT)
        spots = [((x0 + x1) / 2, "center"), (x0 + 0.08, "left"), (x1 - 0.08, "right")]
        rects = []
        for x, ha in spots:
            rx0 = x - tw / 2 if ha == "center" else (x if ha == "left" else x - tw)
            rects.append((rx0, y1 - 0.04 - th, rx0 + tw, y1 - 0.04))
        pick = next((k for k, r in enumerate(rects) if free.fits(r)), 0)
        ax.text(spots[pick][0], y1 - 0.04, text, ha=spots[pick][1], va="top", fontsize=TITLE_FONT,
                zorder=5, bbox={"fc": "white", "ec": "none", "pad": 0.5})
        free.rects.append(rects[pick])
        corners = [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]
        free.segs.extend(zip(corners, corners[1:]))

    # cross-edge labels: beside the edge, where nothing else is
    boxes = list(lay.boxes.values())
    for pts, is_cross, label in drawn:
        if not is_cross or not label:
            continue
        lw_, lh = ruler.size(label, EDGE_FONT)
        (ax_, ay), (bx, by) = pts[0], pts[-1]
        ux, uy = bx - ax_, by - ay
        # how far beside the line the label must start so that its near corner clears it
        side = min(3.0, 0.06 + abs(lh / 2 * ux / uy)) if uy else 3.0
        updown = min(3.0, 0.05 + abs(lw_ / 2 * uy / ux)) if ux else 3.0
        spots = []
        for t in _ALONG:
            px, py = ax_ + t * ux, ay + t * uy
            for rx0, ry0 in ((px + side, py - lh / 2), (px - side - lw_, py - lh / 2),
                             (px - lw_ / 2, py + updown), (px - lw_ / 2, py - updown - lh)):
                spots.append((rx0, ry0, rx0 + lw_, ry0 + lh))
        # outside every worker's box first (inside one, a label reads as that worker's)
        chosen = next((r for r in spots if not any(_overlaps(r, b) for b in boxes) and free.fits(r)), None)
        chosen = chosen or next((r for r in spots if free.fits(r)), None)
        if chosen is None:   # nowhere free: on the edge itself, over a white patch
            px, py = (ax_ + bx) / 2, (ay + by) / 2
            chosen = (px - lw_ / 2, py - lh / 2, px + lw_ / 2, py + lh / 2)
        r = chosen
        ax.text((r[0] + r[2]) / 2, (r[1] + r[3]) / 2, label, ha="center", va="center", fontsize=EDGE_FONT,
                color=CROSS_COLOR, zorder=5, linespacing=1.1,
                bbox={"fc": "white", "ec": "none", "pad": 0.3, "alpha": 0.85})
        free.rects.append(r)

    legend = [Patch(fc=COLORS["leaf"], ec="black", lw=0.6, label="leaf (AccumulateGrad)"),
              Patch(fc=COLORS["op"], ec="black", lw=0.6, label="local op"),
              Patch(fc=COLORS["send"], ec="black", lw=0.6, label="SendRpcBackward"),
              Patch(fc=COLORS["recv"], ec="black", lw=0.6, label="RecvRpcBackward"),
              Patch(fc=CROSS_COLOR, ec=CROSS_COLOR, label="sent between workers")]
    ax.legend(handles=legend, loc="lower center", ncol=5 if lay.width >= LEGEND_ONE_ROW else 3, fontsize=7,
              frameon=False, bbox_to_anchor=(0.5, 0.0), handlelength=1.2, columnspacing=1.0)
    with matplotlib.rc_context({"svg.fonttype": "none"}):   # SVG text stays text (searchable)
        with new_file(path) as f:   # never through a link (see distgrad.safe_files)
            fig.savefig(f, format=fmt or path.rsplit(".", 1)[-1].lower())
    return path
