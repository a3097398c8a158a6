"""distgrad.graph (export, draw) on a real 3-process cluster.

worker0 -> worker1 -> worker2 (worker2 is known to worker0 only through
worker1, so the gather must be transitive), results flow back the same way.
"""
import json
import os
import shutil
import tempfile
import xml.etree.ElementTree as ET

import pytest
import torch
from mp_utils import run_workers

F32_4x4 = 4 * 4 * 4
F64_3 = 3 * 8
F32_2x5 = 2 * 5 * 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_DOT = shutil.which("dot") is None


def _on_worker1(x, s):
    from distgrad import rpc
    y = x * 2 + s.sum()
    w = torch.ones(2, 5, requires_grad=True) * y.mean()
    z = rpc.rpc_sync("worker2", _on_worker2, args=(y, w))
    return z.relu()


def _on_worker2(y, w):
    return y * 3 + w.sum()


def _export(rank, world_size, out_dir):
    if rank != 0:
        return None
    import distgrad.autograd as dist_autograd
    from distgrad import rpc
    from distgrad.graph import export as graph_export
    from distgrad.graph import export_graph
    t = torch.rand(4, 4, requires_grad=True)
    s = torch.rand(3, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", _on_worker1, args=(t, s))
        loss = out.sum()
        # the package's public name (distgrad.graph), as users reach it
        desc = export_graph(cid, os.path.join(out_dir, "g.json"), roots=[loss])
        graph_export.export_graph(cid, os.path.join(out_dir, "g.dot"), roots=[loss])
        dist_autograd.backward(cid, [loss], retain_graph=True)
        # still drawable after a backward that kept the graph; matplotlib needs no system binary
        graph_export.export_graph(cid, os.path.join(out_dir, "g.png"), roots=[loss], engine="matplotlib")
        if graph_export.dot_program():
            graph_export.export_graph(cid, os.path.join(out_dir, "g.svg"), roots=[loss], engine="dot")
        grads = dist_autograd.get_gradients(cid)
        ok_grads = grads[t].shape == t.shape and grads[s].shape == s.shape
    return {"desc": desc, "ok_grads": ok_grads}


def test_export_graph_three_workers():
    out_dir = tempfile.mkdtemp(prefix="distgrad-graph-")
    res = run_workers(_export, world_size=3, timeout=90, args=(out_dir,))[0]
    desc = res["desc"]
    assert res["ok_grads"]
    workers = desc["workers"]
    assert sorted(workers) == [0, 1, 2]
    assert [workers[r]["name"] for r in range(3)] == ["worker0", "worker1", "worker2"]
    for r in range(3):
        assert workers[r]["nodes"], f"no nodes from worker{r}"
        assert "error" not in workers[r]
    names = {r: {n["name"] for n in workers[r]["nodes"]} for r in range(3)}
    assert "SumBackward0" in names[0]               # the loss, from roots=
    assert "MulBackward0" in names[1] and "ReluBackward0" in names[1]
    assert "MulBackward0" in names[2]
    for r in range(3):
        assert {"SendRpcBackward", "RecvRpcBackward"} <= names[r]
    # leaves show up where they live
    leaf_shapes = {tuple(n["shape"]) for n in workers[0]["nodes"] if n["kind"] == "leaf"}
    assert {(4, 4), (3,)} <= leaf_shapes

    edges = {(e["src_worker"], e["dst_worker"]): e for e in desc["cross_edges"]}
    assert len(desc["cross_edges"]) == 4
    assert edges[(0, 1)]["bytes"] == F32_4x4 + F64_3      # t and s
    assert edges[(1, 2)]["bytes"] == F32_4x4 + F32_2x5    # y and w
    assert edges[(2, 1)]["bytes"] == F32_4x4              # the result of _on_worker2
    assert edges[(1, 0)]["bytes"] == F32_4x4              # z.relu()
    # every cross edge joins a send node on its source to a recv node on its destination
    kinds = {n["id"]: (r, n["kind"]) for r in range(3) for n in workers[r]["nodes"]}
    for e in desc["cross_edges"]:
        assert kinds[e["src"]] == (e["src_worker"], "send")
        assert kinds[e["dst"]] == (e["dst_worker"], "recv")
    # local edges stay inside their worker and name known nodes
    for r in range(3):
        for a, b in workers[r]["edges"]:
            assert kinds[a][0] == r and kinds[b][0] == r

    with open(os.path.join(out_dir, "g.json")) as f:
        assert json.load(f)["context_id"] == desc["context_id"]
    with open(os.path.join(out_dir, "g.dot")) as f:
        dot = f.read()
    assert dot.startswith("digraph") and dot.count("subgraph cluster_w") == 3
    png = os.path.join(out_dir, "g.png")
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(png) > 10_000
    if shutil.which("dot"):
        root = ET.parse(os.path.join(out_dir, "g.svg")).getroot()
        assert root.tag.endswith("svg")
    # the matplotlib layout of this real graph: nothing overlaps
    _check_layout(desc)


def test_autograd_does_not_import_the_drawing():
    """Autograd is a floor below graph (tests/test_layers.py): it neither imports nor
    re-exports it; its old name only points to the new one."""
    import subprocess
    import sys
    code = ("import sys, distgrad, distgrad.autograd as da\n"
            "assert 'distgrad.graph' not in sys.modules, 'autograd imported the drawing'\n"
            "assert 'export_graph' not in da.__all__ and 'export_graph' not in dir(da)\n"
            "try:\n"
            "    da.export_graph\n"
            "except AttributeError as e:\n"
            "    assert 'distgrad.graph.export_graph' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('distgrad.autograd.export_graph exists')\n"
            "assert 'distgrad.graph' not in sys.modules, 'the pointer imported the drawing'\n"
            "import distgrad.graph\n"
            "assert distgrad.graph.export_graph is distgrad.graph.export.export_graph\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_to_dot_escapes_labels():
    from distgrad.graph import to_dot
    desc = {"context_id": 7, "cross_edges": [],
            "workers": {0: {"name": 'we"ird', "nodes": [{"id": "w0n0", "name": "A\\B", "kind": "op"}],
                            "edges": []}}}
    src = to_dot(desc)
    assert 'we\\"ird' in src and "A\\\\B" in src


# -- drawing, without a cluster: descriptions built by hand ---------------------------
def _desc(workers, cross):
    """workers: {rank: (name, [(id, autograd name, kind, extra)], [[src, dst], ...])};
    cross: [(src id, dst id, bytes)] (src a send node, dst a recv node)."""
    out = {"context_id": 3, "workers": {}, "cross_edges": []}
    rank_of = {}
    for r, (name, nodes, edges) in workers.items():
        ns = []
        for nid, label, kind, extra in nodes:
            n = {"id": nid, "name": label, "kind": kind, **extra}
            if kind == "send":
                n.setdefault("tensors", [{"shape": [64, 64], "dtype": "float32", "bytes": 16384}])
                n.setdefault("bytes", sum(t["bytes"] for t in n["tensors"]))
            ns.append(n)
            rank_of[nid] = r
        out["workers"][r] = {"rank": r, "name": name, "nodes": ns, "edges": edges, "known_workers": []}
    for i, (a, b, nbytes) in enumerate(cross):
        out["cross_edges"].append({"src": a, "dst": b, "src_worker": rank_of[a], "dst_worker": rank_of[b],
                                   "message_id": i, "bytes": nbytes})
    return out


def _leaf(shape):
    return {"shape": shape, "dtype": "float32"}


def _two_workers():
    return _desc({0: ("trainer", [("a", "AccumulateGrad", "leaf", _leaf([4, 4])),
                                  ("b", "SendRpcBackward", "send", {"message_id": 0}),
                                  ("c", "RecvRpcBackward", "recv", {"message_id": 1, "sender": 1}),
                                  ("d", "SumBackward0", "op", {"root": True})],
                                 [["a", "b"], ["c", "d"]]),
                  1: ("ps", [("e", "RecvRpcBackward", "recv", {"message_id": 0, "sender": 0}),
                             ("f", "MulBackward0", "op", {}),
                             ("g", "SendRpcBackward", "send", {"message_id": 1})],
                      [["e", "f"], ["f", "g"]])},
                 [("b", "e", 16384), ("g", "c", 16384)])


def _demo_like():
    """The shape of `distgrad demo`'s graph: driver relays between ps, stage1 and stage2."""
    send, recv, acc = "SendRpcBackward", "RecvRpcBackward", "AccumulateGrad"
    return _desc({
        0: ("driver", [("d1", recv, "recv", {"sender": 1}), ("d2", send, "send", {}),
                       ("d3", recv, "recv", {"sender": 2}), ("d4", send, "send", {}),
                       ("d5", recv, "recv", {"sender": 3}), ("d6", "LogSoftmaxBackward0", "op", {}),
                       ("d7", "NllLossBackward0", "op", {"root": True})],
            [["d1", "d2"], ["d3", "d4"], ["d5", "d6"], ["d6", "d7"]]),
        1: ("ps", [("p1", acc, "leaf", _leaf([64])), ("p2", acc, "leaf", _leaf([64])),
                   ("p3", "MulBackward0", "op", {}), ("p4", "AddBackward0", "op", {}),
                   ("p5", send, "send", {})],
            [["p1", "p3"], ["p3", "p4"], ["p2", "p4"], ["p4", "p5"]]),
        2: ("stage1", [("s1", recv, "recv", {"sender": 0}), ("s2", acc, "leaf", _leaf([128, 64])),
                       ("s3", "TBackward0", "op", {}), ("s4", "AccumulateGrad", "leaf", _leaf([128])),
                       ("s5", "AddmmBackward0", "op", {}), ("s6", "ReluBackward0", "op", {}),
                       ("s7", send, "send", {})],
            [["s2", "s3"], ["s1", "s5"], ["s3", "s5"], ["s4", "s5"], ["s5", "s6"], ["s6", "s7"]]),
        3: ("stage2", [("t1", recv, "recv", {"sender": 0}), ("t2", acc, "leaf", _leaf([10, 128])),
                       ("t3", "TBackward0", "op", {}), ("t4", "AccumulateGrad", "leaf", _leaf([10])),
                       ("t5", "AddmmBackward0", "op", {}), ("t6", send, "send", {})],
            [["t2", "t3"], ["t1", "t5"], ["t3", "t5"], ["t4", "t5"], ["t5", "t6"]]),
    }, [("p5", "d1", 16384), ("d2", "s1", 16384), ("s7", "d3", 32768), ("d4", "t1", 32768),
        ("t6", "d5", 2560)])


def _check_layout(desc):
    """Nodes never overlap, each sits inside its worker's box, boxes are disjoint,
    every edge points down (forward data flow, layered)."""
    from distgrad.graph.draw import layout
    lay = layout(desc)
    real = [it for it in lay.items.values() if not it.dummy]
    assert len(real) == sum(max(1, len(w["nodes"])) for w in desc["workers"].values())
    hw, hh = lay.node_w / 2, lay.node_h / 2
    for i, a in enumerate(real):
        for b in real[i + 1:]:
            assert abs(a.x - b.x) >= 2 * hw or abs(a.y - b.y) >= 2 * hh, (a, b)
        x0, y0, x1, y1 = lay.boxes[a.worker]
        assert x0 < a.x - hw and a.x + hw < x1 and y0 < a.y - hh and a.y + hh < y1, (a.id, lay.boxes)
    boxes = list(lay.boxes.values())
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)
    for path, _, _ in lay.edges:
        ys = [lay.items[i].y for i in path]
        assert all(p > q for p, q in zip(ys, ys[1:])), path
    return lay


@pytest.mark.parametrize("make", [_two_workers, _demo_like], ids=["two_workers", "demo_like"])
def test_fallback_draws_png_and_svg(make, tmp_path, monkeypatch):
    from distgrad.graph import export as graph_export
    monkeypatch.setenv("DISTGRAD_NO_DOT", "1")
    assert graph_export.dot_program() is None
    desc = make()
    _check_layout(desc)
    png, svg = tmp_path / "g.png", tmp_path / "g.svg"
    assert graph_export.render(desc, str(png)) == "matplotlib"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5_000
    assert graph_export.render(desc, str(svg)) == "matplotlib"
    text = svg.read_text()
    assert ET.fromstring(text).tag.endswith("svg")
    for w in desc["workers"].values():      # worker boxes are titled (text kept as text)
        assert f"{w['name']} (rank {w['rank']})" in text
    assert "16.0 KiB" in text and "64x64 float32" in text      # cross-edge labels
    assert not (tmp_path / "g.dot").exists()


def test_fallback_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from distgrad.errors import DistgradError
    from distgrad.graph import export as graph_export
    monkeypatch.setenv("DISTGRAD_NO_DOT", "1")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(DistgradError, match="pip install matplotlib"):
        graph_export.render(_two_workers(), str(tmp_path / "g.png"))
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    with pytest.raises(DistgradError, match="not on PATH"):
        graph_export.render(_two_workers(), str(tmp_path / "h.png"), engine="dot")


@pytest.mark.skipif(NO_DOT, reason="Graphviz's 'dot' is not on PATH: the dot path cannot run here "
                                   "(the matplotlib fallback is tested above)")
def test_dot_renders_png_and_svg(tmp_path, monkeypatch):
    from distgrad.graph import export as graph_export
    monkeypatch.delenv("DISTGRAD_NO_DOT", raising=False)
    desc = _demo_like()
    assert graph_export.render(desc, str(tmp_path / "g.png")) == "dot"
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_MAGIC
    assert graph_export.render(desc, str(tmp_path / "g.svg"), engine="dot") == "dot"
    text = (tmp_path / "g.svg").read_text()
    assert "cluster_w3" in text and "stage2 (rank 3)" in text
