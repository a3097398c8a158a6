"""distgrad.graph: pictures of distributed autograd graphs.

Built on :mod:`distgrad.autograd` (it reads a context's send/recv functions
and the local graph behind them), a floor below, which never imports it.
Modules:

* ``export``: gather one context's graph from every worker that saw it
  (:func:`describe_graph`), write it as DOT source, JSON or a picture
  (:func:`export_graph`, :func:`render`, :func:`to_dot`);
* ``draw``: the picture without Graphviz (matplotlib, a layered layout);
* ``labels``: node and edge texts and colours both drawings share.

Example (worker0, with worker1 up)::

    import distgrad.autograd as dist_autograd
    from distgrad.graph import export_graph
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(w, 2)).sum()
        export_graph(cid, "step.svg", roots=[loss])
        dist_autograd.backward(cid, [loss])
"""
from __future__ import annotations

from .export import describe_graph, dot_program, export_graph, render, to_dot

__all__ = ["describe_graph", "dot_program", "export_graph", "render", "to_dot"]
