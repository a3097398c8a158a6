"""Hooks that torch's engine runs and a distributed backward must run itself:
those on a leaf's ``AccumulateGrad`` node (``node.register_hook``,
``node.register_prehook``), and, where
the node-by-node executor runs a C++ node by hand, that node's hooks and those
of the tensors it produced. Nothing of torch is replaced for this: only torch's
public hook registration is used.

**A node's hooks** (:func:`hook_dicts`): registering a hook on a node
(``Node.register_prehook`` / ``register_hook``) returns a ``RemovableHandle``
whose ``hooks_dict_ref()`` is the node's own dict of Python hooks of that kind.
Registering a no-op hook and removing it at once thus yields the live dict,
changes no hook that runs, and, where the node had none, leaves an empty dict that torch
reuses for every later registration on that node. The pair is kept in the
node's ``metadata``, so a node costs two registrations once (about 14 us) and a
dictionary look-up after that.

A leaf's AccumulateGrad node is made anew once the graphs holding the last one are
gone, often every forward; probing each would cost 14 us a parameter a pass.
:func:`leaf_hooks` avoids that by counting: every hook registration makes a
``torch.utils.hooks.RemovableHandle``, whose class numbers them (``next_id``);
less the handles distgrad made itself, that number moves exactly when someone
registers a hook. A leaf whose node had no hooks when the count was ``c`` has
none while the count is still ``c``: not on that node, nor on a new one (made
after that one died, so after ``c`` was read). Such a leaf costs a dictionary
look-up; any registration anywhere sends the next pass's leaves back to their
node's dicts (probing the new nodes). torch's distributed engine runs a captured
leaf's accumulator pre-hooks and post-hooks itself; :func:`run_pre` and
:func:`run_post` do that with the arguments torch passes
(``pre(grad_outputs) -> grad_outputs | None``, ``post((), grad_outputs)``).

**The hooks of the tensors a node produced** (``y.register_hook``,
``y.retain_grad()``) live in C++ on ``y.grad_fn``, out of Python's reach. torch's
engine runs them on a node it *captures* (an ``inputs=`` edge into the node that
nothing else needs) without running the node: :func:`run_tensor_hooks` is such a
call, from the node's gradients to its own input slots, so the hooks run in
torch's order, absent gradients passed as ``None``, ``retain_grad`` writing
``.grad`` as torch does.

Example::

    >>> h = x.exp()
    >>> h.register_hook(lambda g: g * 0.5)
    >>> run_tensor_hooks(h.grad_fn, [torch.ones(3)])   # [tensor([0.5, 0.5, 0.5])]
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .nodes import OWN_HANDLES, grad_call

try:
    from torch.utils.hooks import RemovableHandle as _Handle
    _Handle.next_id  # noqa: B018 - the count leaf_hooks relies on
except (ImportError, AttributeError):  # another torch: every leaf's node is looked at
    _Handle = None

_KEY = "_distgrad_hook_dicts"  # node.metadata key: (pre-hook dict, post-hook dict)


def _noop(*args: Any) -> None:
    return None


def hook_dicts(node: Any) -> tuple[dict, dict]:
    """The live (pre-hook dict, post-hook dict) of ``node``: what torch calls, in order,
    around it (see the module's docstring); the first call on a node registers and
    removes a no-op hook of each kind."""
    md = node.metadata
    dicts = md.get(_KEY)
    if dicts is None:
        handle = node.register_prehook(_noop)
        OWN_HANDLES[0] += 1
        pre = handle.hooks_dict_ref()
        handle.remove()
        handle = node.register_hook(_noop)
        OWN_HANDLES[0] += 1
        post = handle.hooks_dict_ref()
        handle.remove()
        md[_KEY] = dicts = (pre, post)
    return dicts


def _registrations() -> int:
    """Hook registrations made by others than distgrad so far (-1: unknown)."""
    return -1 if _Handle is None else _Handle.next_id - OWN_HANDLES[0]


# id(variable) -> (its weakref, the registration count at which its node had no hooks)
_clean: dict[int, tuple] = {}


def hooks_of(node: Any) -> tuple[list, list]:
    """(pre-hooks, post-hooks) registered on ``node`` from Python, in registration order."""
    pre, post = hook_dicts(node)
    return (list(pre.values()) if pre else [], list(post.values()) if post else [])


def leaf_hooks(node: Any, variable: Any = None) -> tuple[list, list]:
    """(pre-hooks, post-hooks) of a leaf's AccumulateGrad ``node`` (``variable``: its
    tensor, where the caller has it); without a look at the node while nobody
    registered a hook since it was last found without any (see the module's
    docstring). A tensor's post-accumulate-grad hooks are not among them: torch's
    distributed engine captures a leaf's gradient without running AccumulateGrad,
    which is what calls them, so they never run in a distributed backward."""
    if variable is None:
        variable = node.variable
    count = _registrations()
    seen = _clean.get(id(variable))
    if seen is not None and seen[1] == count >= 0 and seen[0]() is variable:
        return _NONE
    pre, post = hook_dicts(node)
    if not (pre or post):
        if count >= 0:  # read before the look: a registration since shows
            key = id(variable)
            _clean[key] = (weakref.ref(variable, lambda _r: _clean.pop(key, None)), count)
        return _NONE
    _clean.pop(id(variable), None)
    return (list(pre.values()) if pre else [], list(post.values()) if post else [])


_NONE: tuple = ([], [])

# A root that torch's engine never runs (nothing captured lies behind it). With it a
# call has two roots, so torch puts its own GraphRoot first: a call's single root
# would itself be the graph's root, which always runs.
_IDLE: list = []


def _idle_root() -> tuple:
    if not _IDLE:
        leaf = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            out = leaf * 1
        _IDLE.append((out, GradientEdge(out.grad_fn, 0), torch.zeros(())))
    return _IDLE[0][1], _IDLE[0][2]


def run_tensor_hooks(node: Any, grads: list, create_graph: bool = False) -> list:
    """``grads`` (one per input slot of ``node``, ``None`` = absent) after the hooks of
    the tensors ``node`` produced and their ``retain_grad``, run by torch's engine on
    the node captured at its own input slots (the node itself does not run)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:  # no engine call starts from absent gradients alone
        return list(grads)
    edge, zero = _idle_root()
    roots = tuple(GradientEdge(node, i) for i in present) + (edge,)
    given = tuple(grads[i] for i in present) + (zero,)
    slots = tuple(GradientEdge(node, i) for i in range(len(grads)))
    return list(grad_call(roots, given, slots, True, create_graph))


def run_node_pre(pre: list, grads: list) -> list:
    """A node's inputs after its pre-hooks (``hook(grad_outputs) -> tuple | None``)."""
    out = tuple(grads)
    for hook in pre:
        res = hook(out)
        if res is not None:
            out = tuple(res)
    return list(out)


def run_node_post(post: list, outs: list, grads: list) -> list:
    """A node's outputs after its post-hooks (``hook(grad_inputs, grad_outputs)``,
    which may return replacement grad_inputs)."""
    res_outs, ins = tuple(outs), tuple(grads)
    for hook in post:
        res = hook(res_outs, ins)
        if res is not None:
            res_outs = tuple(res)
    return list(res_outs)


def run_pre(pre: list, grad: Any) -> Any:
    """A leaf's ``grad`` after its AccumulateGrad node's pre-hooks (:func:`run_node_pre`
    with its one input)."""
    return run_node_pre(pre, [grad])[0]


def run_post(post: list, grad: Any) -> None:
    """A leaf's AccumulateGrad post-hooks: no outputs, its gradient as the input
    (:func:`run_node_post`; what they return is ignored, as torch's engine does)."""
    run_node_post(post, [], [grad])
