"""distgrad.autograd.graph_export on a real 3-process cluster.

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
    from distgrad.autograd import graph_export
    t = torch.rand(4, 4, requires_grad=True)
    s = torch.rand(3, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", _on_worker1, args=(t, s))
        loss = out.sum()
        desc = graph_export.export_graph(cid, os.path.join(out_dir, "g.json"), roots=[loss])
        graph_export.export_graph(cid, os.path.join(out_dir, "g.dot"), roots=[loss])
        dist_autograd.backward(cid, [loss], retain_graph=True)
        # still drawable after a backward that kept the graph
        if shutil.which("dot"):
            graph_export.export_graph(cid, os.path.join(out_dir, "g.svg"), roots=[loss])
        # without dot: a clear error, and the DOT source is kept
        real = graph_export.shutil
        graph_export.shutil = type("NoDot", (), {"which": staticmethod(lambda _: None)})
        try:
            graph_export.export_graph(cid, os.path.join(out_dir, "nodot.png"))
            err = None
        except RuntimeError as e:
            err = str(e)
        finally:
            graph_export.shutil = real
        grads = dist_autograd.get_gradients(cid)
        ok_grads = grads[t].shape == t.shape and grads[s].shape == s.shape
    return {"desc": desc, "err": err, "ok_grads": ok_grads}


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
    if shutil.which("dot"):
        root = ET.parse(os.path.join(out_dir, "g.svg")).getroot()
        assert root.tag.endswith("svg")
    assert res["err"] is not None and "dot" in res["err"]
    assert os.path.exists(os.path.join(out_dir, "nodot.dot"))


def test_to_dot_escapes_labels():
    from distgrad.autograd.graph_export import to_dot
    desc = {"context_id": 7, "cross_edges": [],
            "workers": {0: {"name": 'we"ird', "nodes": [{"id": "w0n0", "name": "A\\B", "kind": "op"}],
                            "edges": []}}}
    src = to_dot(desc)
    assert 'we\\"ird' in src and "A\\\\B" in src


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed")
def test_dot_renders_png(tmp_path):
    import graphviz

    from distgrad.autograd.graph_export import to_dot
    desc = {"context_id": 1, "cross_edges": [],
            "workers": {0: {"name": "w", "nodes": [{"id": "w0n0", "name": "X", "kind": "op"}], "edges": []}}}
    data = graphviz.Source(to_dot(desc)).pipe(format="png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
