"""Running one autograd node by hand, as torch's engine runs it.

The shared-region executor (:mod:`.share`) calls nodes itself. torch's engine
does work around every node that a direct call skips (``call_function`` and
``validate_outputs`` in ``torch/csrc/autograd/engine.cpp``, ``PyNode::apply`` in
``python_function.cpp``); this module does that work:

* an absent gradient stays absent (``None``), never zeros, except where torch
  materializes it: a Python ``autograd.Function`` whose ctx did not call
  ``set_materialize_grads(False)`` gets zeros for absent inputs;
* a Python ``Function``'s results are checked (count) and routed to its next
  edges the way ``PyNode`` does (one result per forward argument; those of
  inputs that needed no gradient are dropped);
* each output is validated against what the next node expects
  (``node._input_metadata[slot]``): a broadcast gradient is reduced with
  ``sum_to_size``, a wrong dtype cast, a wrong device moved, an incompatible
  shape an error naming the function and the index;
* gradients arriving at one input slot are summed (dense + sparse in the
  order that works).

Example::

    >>> w = torch.zeros(1, requires_grad=True)
    >>> y = w + torch.ones(2)
    >>> run_node(y.grad_fn, [torch.ones(2)])   # reduced to w's shape
    [tensor([2.]), None]
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

# torch keeps a Function ctx's materialize_grads flag write-only; remember what
# set_materialize_grads() was told, so the executor can do what PyNode::apply does.
_FunctionCtx = torch.autograd.function.FunctionCtx
_orig_set_materialize = _FunctionCtx.set_materialize_grads


def _set_materialize_grads(self, value: bool) -> None:
    _orig_set_materialize(self, value)
    try:
        self._dg_materialize = bool(value)
    except AttributeError:  # a ctx without a __dict__: stays the default (True)
        pass


if getattr(_FunctionCtx.set_materialize_grads, "__name__", "") != "_set_materialize_grads":
    _FunctionCtx.set_materialize_grads = _set_materialize_grads


class _Unreached:
    """No path from the roots reached this slot (local autograd would not even run the
    node behind it), as opposed to ``None``: reached, but the gradient is absent."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREACHED"


UNREACHED = _Unreached()


def accumulate(old: Any, g: Any) -> Any:
    """Sum of two gradients for one input slot: tensors add; ``None`` (reached,
    absent) adds nothing but marks the slot reached; :data:`UNREACHED` adds nothing."""
    if g is UNREACHED or g is None and old is not UNREACHED:
        return old
    if old is UNREACHED or old is None:
        return g
    if old.is_sparse and not g.is_sparse:
        return g + old  # sparse + dense is not defined, dense + sparse is
    return old + g


def _expandable(shape: Sequence[int], to: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (so ``to`` reduces to it)."""
    if len(shape) > len(to):
        return False
    for a, b in zip(reversed(shape), reversed(to)):
        if a != 1 and a != b:
            return False
    return True


def validate(node: Any, outs: Sequence) -> list:
    """``outs`` (one per next edge of ``node``) made fit for the next nodes, as torch's
    ``validate_outputs`` does; raises RuntimeError as torch does."""
    edges = node.next_functions
    if len(outs) != len(edges):
        raise RuntimeError(f"Function {node.name()} returned an invalid number of gradients - "
                           f"expected {len(edges)}, but got {len(outs)}")
    res = list(outs)
    for i, ((nxt, slot), g) in enumerate(zip(edges, outs)):
        if nxt is None or g is None:
            continue
        meta = nxt._input_metadata[slot]
        shape = tuple(meta.shape)
        if tuple(g.shape) != shape:
            if not _expandable(shape, tuple(g.shape)):
                raise RuntimeError(f"Function {node.name()} returned an invalid gradient at index {i} "
                                   f"- got {list(g.shape)} but expected shape compatible with "
                                   f"{list(shape)}")
            g = g.sum_to_size(shape)
        if g.dtype != meta.dtype:
            if not (g.dtype.is_floating_point or g.dtype.is_complex == meta.dtype.is_complex):
                raise RuntimeError(f"Function {node.name()} returned an invalid gradient at index "
                                   f"{i} - expected dtype {meta.dtype} but got {g.dtype}")
            g = g.to(meta.dtype)
        if g.device != meta.device:
            g = g.to(meta.device)
        res[i] = g
    return res


def _python_node(node: Any, grads: list) -> list:
    """What ``PyNode::apply`` does: materialize, call ``backward``, route results."""
    if getattr(node, "_dg_materialize", True):
        grads = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                 for g, m in zip(grads, node._input_metadata)]
    res = node.apply(*grads)
    if not isinstance(res, tuple):
        res = (res,)
    needs = node.needs_input_grad
    n_in = len(needs)
    if len(res) > n_in and all(r is None for r in res[n_in:]):
        res = res[:n_in]
    if len(res) != n_in:
        raise RuntimeError(f"function {node.name()} returned an incorrect number of gradients "
                           f"(expected {n_in}, got {len(res)})")
    # The next edges are the forward's tensor arguments in order; exactly those that
    # required grad (needs_input_grad) have a node, the others an empty edge.
    wanted = iter([r for r, need in zip(res, needs) if need])
    return [next(wanted, None) if nxt is not None else None for nxt, _ in node.next_functions]


def run_node(node: Any, grads: list, create_graph: bool = False, retain_graph: bool = True) -> list:
    """Run ``node``'s backward on ``grads`` (one per input slot, ``None`` = absent);
    returns validated gradients, one per next edge. No hooks run here.
    ``create_graph``: the backward is recorded (its results carry a graph).
    ``retain_graph``: what the node sees as its graph task's keep_graph (see
    :func:`_keep_graph`)."""
    with torch.set_grad_enabled(create_graph):
        if hasattr(node, "_forward_cls"):  # a Python autograd.Function
            prev = getattr(_tls, "keep_graph", None)
            _tls.keep_graph = retain_graph
            try:
                outs = _python_node(node, grads)
            finally:
                _tls.keep_graph = prev
        else:
            outs = node(*grads)
            if not isinstance(outs, (tuple, list)):
                outs = (outs,)
    return validate(node, outs)


# A Python Function's backward may ask whether its graph task keeps the graph
# (torch.compile's: a backward compiled with donated buffers refuses to run where
# the graph is kept). Outside any engine call torch answers True; a node this
# module runs is part of a pass whose retain_graph is known, so that is the answer.
_tls = threading.local()
_orig_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _keep_graph() -> bool:
    keep = getattr(_tls, "keep_graph", None)
    return _orig_keep_graph() if keep is None else keep


if _orig_keep_graph is not None and getattr(_orig_keep_graph, "__name__", "") != "_keep_graph":
    torch._C._autograd._get_current_graph_task_keep_graph = _keep_graph


def grad_call(outputs: tuple, grads: tuple, inputs: tuple, retain_graph: bool,
          create_graph: bool = False) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)`` minus its per-input Python checks
    (we built every argument ourselves); falls back to the public call."""
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grads, retain_graph=retain_graph,
                                   create_graph=create_graph, allow_unused=True)
    return _engine_run_backward(outputs, grads, retain_graph, create_graph, inputs, True,
                                accumulate_grad=False)


try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # older torch
    _engine_run_backward = None
