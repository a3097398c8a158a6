"""Export the distributed autograd graph of one context as a picture.

Each worker that took part in the context describes its share of the graph:
the send and recv functions recorded in its copy of the context and the
local autograd nodes reachable from them (and, on the calling worker, from
optional ``roots``). The caller gathers the descriptions (transitively over
the workers each context knows), joins send -> recv pairs by autograd message
id and draws one graph with one cluster per worker.

Edges follow the forward data flow (an input's producer -> its consumer;
gradients travel the other way). A cross-worker edge goes from a
``SendRpcBackward`` node on the sender to the matching ``RecvRpcBackward``
node on the receiver, labelled with the bytes of the tensors it carried.

Example (inside a context, after the forward)::

    with dist_autograd.context() as cid:
        loss = model(x)
        desc = export_graph(cid, "step.svg", roots=[loss])
        dist_autograd.backward(cid, [loss])

Pictures (``.svg``, ``.png``, ``.pdf``) are drawn by Graphviz's ``dot``
where it is on PATH, otherwise by matplotlib with a layered layout of its own
(``distgrad.graph.draw``): the same boxes per worker and labelled cross-worker edges,
no system package needed. ``DISTGRAD_NO_DOT=1`` forces the matplotlib path.
A ``.dot``/``.gv`` path (DOT source) or ``.json`` needs neither.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import torch

from ..autograd.context import CONTAINER
from ..autograd.rpc_functions import _ANCHOR, _node_types
from ..errors import DistgradError
from ..rpc import api as rpc_api
from ..rpc.agent import agent_or_none
from ..safe_files import out_dir, write_file
from ..transport.auth import clean_env
from . import labels

__all__ = ["describe_graph", "dot_program", "export_graph", "render", "to_dot"]

_RENDER_FORMATS = {"svg", "png", "pdf"}
_DOT_FORMATS = {"dot", "gv"}


def _nbytes(meta: Any) -> int:
    n = 1
    for s in meta.shape:
        n *= int(s)
    return n * torch.empty((), dtype=meta.dtype).element_size()


def _place(d: dict, node: Any) -> None:
    """A node on an accelerator: its device (its first non-CPU input's, a leaf's own) and
    the stream torch's engine runs it on (``Node::stream``, C++ nodes, with the native
    engine built)."""
    devs = []
    var = getattr(node, "variable", None)
    if var is not None:
        devs.append(var.device)
    for m in getattr(node, "_input_metadata", ()) or ():
        dev = getattr(m, "device", None)
        if dev is not None:
            devs.append(dev)
    dev = next((x for x in devs if x.type not in ("cpu", "meta")), None)
    if dev is None:
        return
    d["device"] = str(dev)
    from ..autograd import native_pass
    if native_pass.M is not None:
        s = native_pass.M.node_stream(node)
        if s is not None:
            d["stream"] = int(s[1])


def _meta_list(node: Any) -> list[dict]:
    out = []
    for m in getattr(node, "_input_metadata", ()) or ():
        try:
            out.append({"shape": [int(s) for s in m.shape], "dtype": str(m.dtype).replace("torch.", ""),
                        "bytes": _nbytes(m)})
        except Exception:  # noqa: BLE001 - exotic metadata (nested tensors...)
            out.append({"shape": [], "dtype": "?", "bytes": 0})
    return out


def _local_description(context_id: int, roots: Sequence[Any] = ()) -> dict:
    """This worker's share of context ``context_id``'s graph (JSON-able).

    Runs on every participating worker (through ``rpc_sync``). ``roots`` are
    extra starting nodes (``grad_fn`` of local tensors), e.g. the loss.
    """
    ctx = CONTAINER.retrieve(context_id)
    agent = agent_or_none()
    rank = CONTAINER.worker_id
    name = agent.name if agent is not None else f"worker{rank}"
    send_t, recv_t = _node_types()
    sends = ctx._send_functions()
    recvs = ctx._recv_functions()

    ids: dict[int, str] = {}
    keep: list[Any] = []           # keeps walked nodes alive while ids are in use
    nodes: list[dict] = []
    edges: list[list[str]] = []

    def node_id(n: Any) -> str:
        key = id(n)
        nid = ids.get(key)
        if nid is None:
            nid = ids[key] = f"w{rank}n{len(ids)}"
            keep.append(n)
        return nid

    def is_anchor(n: Any) -> bool:
        return getattr(n, "variable", None) is _ANCHOR

    stack: list[Any] = []
    seen: set[int] = set()
    start_kind: dict[int, str] = {}
    for n in sends.values():
        start_kind[id(n)] = "send"
        stack.append(n)
    for n in recvs.values():
        start_kind[id(n)] = "recv"
        stack.append(n)
    for r in roots:
        if r is not None:
            start_kind.setdefault(id(r), "root")
            stack.append(r)
    send_ids = {id(n): m for m, n in sends.items()}
    recv_ids = {id(n): m for m, n in recvs.items()}

    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        nid = node_id(n)
        t = type(n)
        d: dict[str, Any] = {"id": nid, "name": n.name().rsplit("::", 1)[-1], "kind": "op"}
        if t is send_t or id(n) in send_ids:
            meta = _meta_list(n)
            d.update(kind="send", message_id=send_ids.get(id(n)), tensors=meta,
                     bytes=sum(x["bytes"] for x in meta))
        elif t is recv_t or id(n) in recv_ids:
            info = getattr(n, "dg_info", None)
            d.update(kind="recv", message_id=recv_ids.get(id(n), info[1] if info else None),
                     sender=info[2] if info else None, tensors=_meta_list(n))
        elif hasattr(n, "variable"):
            v = n.variable
            d.update(kind="leaf", shape=[int(s) for s in v.shape], dtype=str(v.dtype).replace("torch.", ""))
        _place(d, n)
        if start_kind.get(id(n)) == "root":
            d["root"] = True
        nodes.append(d)
        if d["kind"] == "recv":
            continue  # its inputs are distgrad's internal anchor: the sender is the real input
        for nxt, _ in n.next_functions:
            if nxt is None or is_anchor(nxt):
                continue
            edges.append([node_id(nxt), nid])   # forward direction: producer -> consumer
            if id(nxt) not in seen:
                stack.append(nxt)

    return {"rank": rank, "name": name, "nodes": nodes, "edges": edges,
            "known_workers": sorted(ctx._known_worker_ids())}


def _describe_remote(context_id: int) -> dict:
    """Module-level so that other workers can call it by ``rpc_sync``."""
    return _local_description(context_id)


def describe_graph(context_id: int, roots: Sequence[torch.Tensor] = ()) -> dict:
    """Gather the graph of ``context_id`` from every worker that saw it.

    Returns ``{"context_id", "workers": {rank: {...}}, "cross_edges": [...]}``
    where each worker entry has ``name``, ``nodes`` (``id``, ``name``, ``kind``
    in send/recv/leaf/op, ...), local ``edges`` ([producer, consumer] ids) and
    ``known_workers``; each cross edge has ``src``/``dst`` node ids,
    ``src_worker``/``dst_worker`` ranks, ``message_id`` and ``bytes``.
    ``roots``: local tensors (e.g. the loss) whose graphs to include.
    """
    root_nodes = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    me = CONTAINER.worker_id
    workers: dict[int, dict] = {me: _local_description(context_id, root_nodes)}
    todo = [w for w in workers[me]["known_workers"] if w != me]
    while todo:
        w = todo.pop()
        if w in workers:
            continue
        try:
            desc = rpc_api.rpc_sync(w, _describe_remote, args=(context_id,))
        except Exception as e:  # noqa: BLE001 - e.g. the context is gone there
            workers[w] = {"rank": w, "name": f"worker{w}", "nodes": [], "edges": [],
                          "known_workers": [], "error": str(e)}
            continue
        workers[w] = desc
        todo.extend(x for x in desc["known_workers"] if x not in workers)

    sends: dict[int, tuple[int, dict]] = {}
    for w, desc in workers.items():
        for n in desc["nodes"]:
            if n["kind"] == "send" and n.get("message_id") is not None:
                sends[n["message_id"]] = (w, n)
    cross = []
    for w, desc in workers.items():
        for n in desc["nodes"]:
            if n["kind"] != "recv":
                continue
            found = sends.get(n.get("message_id"))
            if found is None:
                continue
            sw, sn = found
            cross.append({"src": sn["id"], "dst": n["id"], "src_worker": sw, "dst_worker": w,
                          "message_id": n["message_id"], "bytes": sn["bytes"]})
    return {"context_id": context_id, "workers": {int(k): v for k, v in sorted(workers.items())},
            "cross_edges": cross}


def to_dot(desc: dict) -> str:
    """Graphviz DOT source of a description from :func:`describe_graph`.

    Example::

        open("step.dot", "w").write(to_dot(describe_graph(cid)))
    """
    def q(s: Any) -> str:
        return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    lines = ["digraph distgrad {",
             f"  label={q(labels.title(desc))};",
             "  labelloc=t; fontname=Helvetica; rankdir=TB; compound=true;",
             "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
             "  edge [fontname=Helvetica, fontsize=9];"]
    names = {int(w): wd["name"] for w, wd in desc["workers"].items()}
    for w, wd in desc["workers"].items():
        lines.append(f"  subgraph cluster_w{w} {{")
        title = f"{wd['name']} (rank {w})"
        lines.append(f"    label={q(title)}; style=\"rounded\"; color=\"#555555\";")
        for n in wd["nodes"]:
            extra = ", penwidth=2" if n.get("root") else ""
            lines.append(f"    {n['id']} [label={q(labels.node_label(n, names))}, "
                         f"fillcolor={q(labels.COLORS[n['kind']])}{extra}];")
        for a, b in wd["edges"]:
            lines.append(f"    {a} -> {b};")
        lines.append("  }")
    tensors = {n["id"]: n.get("tensors") or [] for wd in desc["workers"].values() for n in wd["nodes"]}
    for e in desc["cross_edges"]:
        label = labels.edge_label(e, tensors.get(e["src"], []))
        lines.append(f"  {e['src']} -> {e['dst']} [label={q(label)}, color=\"{labels.CROSS_COLOR}\", "
                     f"fontcolor=\"{labels.CROSS_COLOR}\", penwidth=1.6, style=bold];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_program() -> str | None:
    """Path of Graphviz's ``dot``, or None when it is not on PATH or
    ``DISTGRAD_NO_DOT=1`` is set (to try the matplotlib drawing where dot exists).

    Example::

        engine = "dot" if dot_program() else "matplotlib"
    """
    if os.environ.get("DISTGRAD_NO_DOT", "").strip().lower() not in ("", "0", "false", "no"):
        return None
    return shutil.which("dot")


def render(desc: dict, path: str, engine: str = "auto") -> str:
    """Draw a description (from :func:`describe_graph`) into ``path``; returns
    the engine that drew it, ``"dot"`` or ``"matplotlib"``.

    The format follows the extension: ``.svg``, ``.png`` or ``.pdf``.
    ``engine="auto"`` uses Graphviz's ``dot`` where it is installed (see
    :func:`dot_program`) and otherwise draws the same picture with matplotlib
    (``distgrad.graph.draw``: layered layout, one box per worker); ``"dot"`` or
    ``"matplotlib"`` insists on one. When the engine is missing, the DOT
    source is written next to ``path`` (``.dot``) and DistgradError says what
    to install.

    Example::

        desc = describe_graph(cid, roots=[loss])
        render(desc, "step.svg")
        render(desc, "step.png", engine="matplotlib")
    """
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in _RENDER_FORMATS:
        raise ValueError(f"render: unknown picture format {ext!r} for {path!r} (use .svg .png .pdf)")
    if engine not in ("auto", "dot", "matplotlib"):
        raise ValueError(f"render: engine must be 'auto', 'dot' or 'matplotlib', not {engine!r}")
    dot = dot_program() if engine != "matplotlib" else None
    out_dir(os.path.dirname(os.path.abspath(path)), f"render {path}")
    if dot is not None:
        src = to_dot(desc)
        try:   # to stdout: distgrad writes the file, never through a link (see safe_files)
            done = subprocess.run([dot, f"-T{ext}"], input=src.encode(), capture_output=True,
                                  timeout=120, check=False, env=clean_env())
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DistgradError(f"render: Graphviz's dot failed on {path!r}: {e}") from e
        if done.returncode != 0:
            raise DistgradError(f"render: Graphviz's dot failed on {path!r} (exit {done.returncode}): "
                                f"{done.stderr.decode(errors='replace').strip()[-500:]}")
        write_file(path, done.stdout)
        return "dot"
    dot_path = os.path.splitext(path)[0] + ".dot"
    if engine == "dot":
        _write(dot_path, to_dot(desc))
        raise DistgradError(f"render: cannot draw {path!r} with Graphviz: its 'dot' program is not on "
                            f"PATH (or DISTGRAD_NO_DOT is set); the DOT source is in {dot_path!r}")
    try:
        import matplotlib  # noqa: F401

        from . import draw
    except ImportError as e:
        _write(dot_path, to_dot(desc))
        raise DistgradError(f"render: cannot draw {path!r}: Graphviz's 'dot' is not on PATH and "
                            f"matplotlib is not installed ({e}); pip install matplotlib (or "
                            f"'distgrad[demo]'). The DOT source is in {dot_path!r}") from e
    draw.draw(desc, path)
    return "matplotlib"


def _write(path: str, text: str) -> None:
    write_file(path, text)


def export_graph(context_id: int, path: str, roots: Sequence[torch.Tensor] = (),
                 engine: str = "auto") -> dict:
    """Draw the distributed autograd graph of ``context_id`` into ``path``.

    Call it while the context is alive (inside ``with dist_autograd.context()``),
    after the forward pass (or after ``backward(..., retain_graph=True)``).
    The format follows ``path``'s extension: ``.svg``, ``.png`` or ``.pdf``
    (a picture, see :func:`render` for ``engine``), ``.dot``/``.gv`` (DOT
    source) or ``.json`` (the description). ``roots``: local tensors, e.g. the
    loss, whose graph on this worker to include (the recorded RPCs are always
    included). Returns the description (see :func:`describe_graph`).

    Example::

        desc = export_graph(cid, "out/step.png", roots=[loss])
    """
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in _RENDER_FORMATS | _DOT_FORMATS | {"json"}:
        raise ValueError(f"export_graph: unknown format {ext!r} for {path!r} "
                         f"(use one of .svg .png .pdf .dot .gv .json)")
    desc = describe_graph(context_id, roots)
    out_dir(os.path.dirname(os.path.abspath(path)), f"export_graph {path}")
    if ext == "json":
        write_file(path, json.dumps(desc, indent=1))
    elif ext in _DOT_FORMATS:
        _write(path, to_dot(desc))
    else:
        render(desc, path, engine)
    return desc
