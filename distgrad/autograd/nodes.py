"""Running one autograd node as torch's engine runs it.

The shared-region executor (:mod:`.executor`) runs nodes one at a time. torch's
engine does work around every node (``call_function`` and ``validate_outputs``
in ``torch/csrc/autograd/engine.cpp``, ``PyNode::apply`` in
``python_function.cpp``); where it can, this module lets the engine itself do
it:

* :func:`run_in_engine` runs one node inside one engine call that stops there
  (the node is the call's only ``inputs=`` edge, in ``backward`` mode, so
  nothing behind it runs): its tensors' hooks, ``retain_grad``, its pre-hooks,
  the node, ``validate_outputs``, its post-hooks, exactly as torch runs them; a
  temporary post-hook, registered last, takes the results. A Python
  ``autograd.Function``'s gradients are materialized (or not) by ``PyNode``
  itself, and its backward sees its graph task's ``keep_graph``. Its outputs
  must not be computed only where a next node needs them, so C++ nodes (whose
  formulas compute only what the graph task needs) run by hand instead:
* :func:`run_node` calls a C++ node directly (absent gradients stay absent,
  ``None``) and then does what ``validate_outputs`` does (a broadcast gradient
  reduced with ``sum_to_size``, a wrong dtype cast, a wrong device moved, an
  incompatible shape an error naming the function and the index);
* gradients arriving at one input slot are summed (dense + sparse in the
  order that works).

Example::

    >>> w = torch.zeros(1, requires_grad=True)
    >>> y = w + torch.ones(2)
    >>> run_node(y.grad_fn, [torch.ones(2)])   # reduced to w's shape
    [tensor([2.]), None]
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

# Hook handles distgrad itself made (probes, temporary hooks): every hook registration
# makes a torch.utils.hooks.RemovableHandle, whose class counts them (next_id), so
# next_id - OWN_HANDLES[0] moves exactly when someone else registers a hook
# (node_hooks.leaf_hooks builds on that).
OWN_HANDLES = [0]


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


def run_node(node: Any, grads: list, create_graph: bool = False) -> list:
    """Run a C++ ``node``'s backward on ``grads`` (one per input slot, ``None`` =
    absent); returns validated gradients, one per next edge. No hooks run here.
    ``create_graph``: the backward is recorded (its results carry a graph)."""
    with torch.set_grad_enabled(create_graph):
        outs = node(*grads)
    if not isinstance(outs, (tuple, list)):
        outs = (outs,)
    return validate(node, outs)


def run_in_engine(node: Any, grads: list, retain_graph: bool, create_graph: bool) -> list:
    """Run ``node`` (a Python Function's) on ``grads`` (one per input slot, ``None`` =
    absent) in one engine call that runs nothing else, hooks and all; returns its
    validated outputs, one per next edge, as its post-hooks left them.

    A node none of whose inputs got a gradient still runs in torch (a Function then
    gets zeros or ``None``, as it asked); an engine call cannot start from an absent
    gradient, so it starts from zeros and a pre-hook put first turns them back into
    absent ones before ``PyNode`` materializes them (its tensors' hooks see zeros)."""
    outs: list = []
    handle = node.register_hook(lambda gi, go: outs.append(gi))
    OWN_HANDLES[0] += 1
    first = None
    try:
        present = [i for i, g in enumerate(grads) if g is not None]
        if present:
            roots = tuple(GradientEdge(node, i) for i in present)
            given = tuple(grads[i] for i in present)
        else:
            roots = tuple(GradientEdge(node, i) for i in range(len(grads)))
            given = tuple(torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                          for m in node._input_metadata)
            first = _prehook_first(node, lambda gos: (None,) * len(gos))
        _backward_to(roots, given, GradientEdge(node, 0), retain_graph, create_graph)
    finally:
        handle.remove()
        if first is not None:
            first.remove()
    return list(outs[-1]) if outs else [None] * len(node.next_functions)


def _prehook_first(node: Any, hook: Any) -> Any:
    """Register ``hook`` as ``node``'s first Python pre-hook; returns its handle."""
    handle = node.register_prehook(hook)
    OWN_HANDLES[0] += 1
    hooks = handle.hooks_dict_ref()
    if hooks is not None and len(hooks) > 1:
        others = [(k, v) for k, v in hooks.items() if k != handle.id]
        hooks.clear()
        hooks[handle.id] = hook
        hooks.update(others)
    return handle


def _backward_to(roots: tuple, grads: tuple, stop: Any, retain_graph: bool,
                 create_graph: bool) -> None:
    """One engine call from ``roots`` that runs exactly what leads to edge ``stop``."""
    if _engine_run_backward is None:
        torch.autograd.backward(roots, grads, retain_graph=retain_graph,
                                create_graph=create_graph, inputs=(stop,))
        return
    _engine_run_backward(roots, grads, retain_graph, create_graph, (stop,), True,
                         accumulate_grad=True)


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
