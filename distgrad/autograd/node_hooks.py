"""Hooks that torch's engine runs and a distributed backward must run itself:
those on a leaf's ``AccumulateGrad`` node (``node.register_hook``,
``node.register_prehook``), and, where the node-by-node executor calls nodes by
hand, every node's hooks and the hooks of the tensors it produced.

A distributed backward captures leaf gradients without running their
``AccumulateGrad`` node (running it would write ``.grad``), and torch offers no
way to list a node's hooks. But every hook a Python caller registers on an
autograd node goes through ``torch.autograd.function.Function._register_hook(hooks_dict,
hook)`` (the C++ side looks it up on that class at every call), which receives
the node's existing hook dict (None when it has none). :func:`install`
replaces it with a transparent wrapper; :func:`hooks_of` *probes* a node by
registering a dummy hook with the wrapper in probe mode, which raises with the
dict it was given instead of registering anything, so probing never changes a
node. torch's distributed engine runs an accumulator's pre-hooks and
post-hooks around its capture of a leaf's gradient; :func:`run_pre` and
:func:`run_post` do that with the same arguments torch passes
(``pre(grad_outputs) -> grad_outputs | None``, ``post((), grad_outputs)``).

Probing costs about 6 us a node. The executor (already the slow path) probes
every node it runs, and finds hooks registered before :func:`install` too. A
native region captures its leaves; their nodes are probed only once some
registration was seen (a leaf's node is made anew for each forward, so a hook on it was
registered through the wrapper unless it came before ``import distgrad`` on a
node alive since), and :func:`leaf_hooks` keeps the live dicts in the node's
``metadata``.

Tensor hooks on intermediates (``y.register_hook``) live in a dict that torch
hands to ``y.grad_fn`` without a Python call (``_register_hook_dict``), and
``retain_grad`` works in C++ alone; :func:`install` wraps both
``Tensor.register_hook`` and ``Tensor.retain_grad`` to note, in the node's
``metadata``, which of its outputs has which hooks (:func:`tensor_pre_hooks`).
The executor then runs them as torch's ``call_tensor_pre_hooks`` does: on the
summed gradient of each slot, in registration order, before the node's own
pre-hooks. (Such hooks registered before ``import distgrad`` are not seen.)

Example::

    >>> h = x.exp()
    >>> h.register_hook(lambda g: g * 0.5)
    >>> tensor_pre_hooks(h.grad_fn)      # [(0, {id: hook}, None)]
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.autograd.function as _function

_tls = threading.local()
_installed: list = []   # the wrapped original, once installed
registered = [0]        # node hook registrations seen since install (not probes)
post_acc_registered = [0]  # register_post_accumulate_grad_hook calls seen since install
_KEY = "_distgrad_tensor_hooks"  # node.metadata key: [(output_nr, hooks dict | None, tensor ref)]


class _Probe(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, hooks: Any) -> None:
        self.hooks = hooks


def install() -> None:
    """Wrap ``Function._register_hook`` (idempotent)."""
    if _installed:
        return
    original = _function.Function._register_hook

    def _register_hook(backward_hooks, hook):
        if getattr(_tls, "probing", False):
            raise _Probe(backward_hooks)
        registered[0] += 1
        return original(backward_hooks, hook)

    _installed.append(original)
    _function.Function._register_hook = staticmethod(_register_hook)
    _wrap_tensor_hooks()


def _wrap_tensor_hooks() -> None:
    tensor = torch.Tensor
    register, retain = tensor.register_hook, tensor.retain_grad
    post_acc = tensor.register_post_accumulate_grad_hook

    def register_hook(self, hook):
        fn = self.grad_fn
        fresh = fn is not None and self._backward_hooks is None
        handle = register(self, hook)
        if fresh and self._backward_hooks is not None:  # torch gave fn a new hook dict
            fn.metadata.setdefault(_KEY, []).append((self.output_nr, self._backward_hooks, None))
        return handle

    def retain_grad(self):
        fn = self.grad_fn
        if fn is not None and not self.retains_grad and self.requires_grad:
            fn.metadata.setdefault(_KEY, []).append((self.output_nr, None, weakref.ref(self)))
        return retain(self)

    def register_post_accumulate_grad_hook(self, hook):
        post_acc_registered[0] += 1
        return post_acc(self, hook)

    register_hook.__doc__, retain_grad.__doc__ = register.__doc__, retain.__doc__
    register_post_accumulate_grad_hook.__doc__ = post_acc.__doc__
    tensor.register_hook = register_hook
    tensor.retain_grad = retain_grad
    tensor.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook


def tensor_pre_hooks(node: Any) -> list:
    """``[(output_nr, hooks dict or None, retained tensor's weakref or None)]`` noted
    for the tensors ``node`` produced, in registration order; usually empty."""
    return node.metadata.get(_KEY) or []


def run_tensor_pre_hooks(noted: list, grads: list) -> list:
    """``grads`` (one per input slot of the node, ``None`` = absent) after its tensors'
    hooks, as torch's ``call_tensor_pre_hooks``: the hooks of each slot in order,
    then ``retain_grad``'s (the retained tensor's ``.grad`` gets the result)."""
    grads = list(grads)
    retained = []
    for slot, hooks, ref in noted:
        if hooks is None:
            retained.append((slot, ref))
            continue
        for hook in list(hooks.values()):  # torch calls them with None too (absent)
            out = hook(grads[slot])
            if out is not None:
                grads[slot] = out
    for slot, ref in retained:
        t, g = ref(), grads[slot]
        if t is not None and g is not None and t.retains_grad:
            with torch.no_grad():
                t.grad = g.clone() if t.grad is None else t.grad + g
    return grads


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


def run_post_accumulate(variable: Any, grad: Any) -> None:
    """``register_post_accumulate_grad_hook`` hooks of ``variable``, called as torch's
    AccumulateGrad calls them after accumulating; ``variable.grad`` is, while they
    run, the gradient the context now holds for it (restored after)."""
    hooks = getattr(variable, "_post_accumulate_grad_hooks", None)
    if not hooks:
        return
    saved = variable.grad
    try:
        with torch.no_grad():
            variable.grad = grad
        for hook in list(hooks.values()):
            hook(variable)
    finally:
        variable.grad = saved


def _noop(*args: Any) -> None:
    return None


def hooks_of(node: Any, always: bool = False) -> tuple[list, list]:
    """(pre-hooks, post-hooks) registered on ``node``, in registration order
    (``always``: probe even when no registration was seen since :func:`install`)."""
    if not _installed or not (always or registered[0]):
        return [], []
    dicts = _probe_dicts(node)
    if dicts is None:  # not our wrapper (someone replaced it): nothing to learn
        return [], []
    pre_d, post_d = dicts
    return (list(pre_d.values()) if pre_d else [], list(post_d.values()) if post_d else [])


def _probe_dicts(node: Any) -> tuple[Any, Any] | None:
    """The live (pre-hook dict, post-hook dict) of ``node`` (``None`` where it has
    none yet), or None when the wrapper is not in place."""
    out = []
    _tls.probing = True
    try:
        for register in (node.register_prehook, node.register_hook):
            try:
                register(_noop)
            except _Probe as p:
                out.append(p.hooks)
            else:
                return None
    finally:
        _tls.probing = False
    return out[0], out[1]


_LEAF_KEY = "_distgrad_leaf_hooks"


def leaf_hooks(node: Any) -> tuple[list, list, bool]:
    """(pre-hooks, post-hooks, has post-accumulate-grad hooks) of a leaf's
    AccumulateGrad ``node``. A node is probed once, and again only after a
    registration was seen since: the probe keeps the node's live hook dicts in
    its ``metadata`` (a removed hook is gone from them; a node's first hook makes
    a new dict, and that registration is seen), so hooks registered before
    :func:`install` are found too, at the cost of a dictionary look-up a leaf."""
    md = node.metadata
    seen = md.get(_LEAF_KEY)
    if seen is None or seen[0] != registered[0] or seen[1] != post_acc_registered[0]:
        dicts = _probe_dicts(node) if _installed else None
        pre_d, post_d = dicts if dicts is not None else (None, None)
        post_acc = bool(getattr(node.variable, "_post_accumulate_grad_hooks", None))
        md[_LEAF_KEY] = seen = (registered[0], post_acc_registered[0], pre_d, post_d, post_acc)
    _, _, pre_d, post_d, post_acc = seen
    if not (pre_d or post_d or post_acc):
        return _NONE
    return (list(pre_d.values()) if pre_d else [], list(post_d.values()) if post_d else [], post_acc)


_NONE: tuple = ([], [], False)


def run_pre(pre: list, grad: Any) -> Any:
    """A leaf's ``grad`` after its AccumulateGrad node's pre-hooks (:func:`run_node_pre`
    with its one input)."""
    return run_node_pre(pre, [grad])[0]


def run_post(post: list, grad: Any) -> None:
    """A leaf's AccumulateGrad post-hooks: no outputs, its gradient as the input
    (:func:`run_node_post`; what they return is ignored, as torch's engine does)."""
    run_node_post(post, [], [grad])
