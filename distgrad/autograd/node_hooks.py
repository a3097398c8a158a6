"""Hooks registered on a leaf's ``AccumulateGrad`` node (``node.register_hook``,
``node.register_prehook``), found and run by the distributed backward.

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

Probing costs a few microseconds per leaf, so it is done only once some node
hook was registered after :func:`install` (at ``import distgrad.autograd``);
a node hook registered before that import is not seen.
"""
from __future__ import annotations

import threading
from typing import Any

import torch.autograd.function as _function

_tls = threading.local()
_installed: list = []   # the wrapped original, once installed
registered = [0]        # node hook registrations seen since install (not probes)


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


def _noop(*args: Any) -> None:
    return None


def hooks_of(node: Any) -> tuple[list, list]:
    """(pre-hooks, post-hooks) registered on ``node``, in registration order."""
    if not _installed or not registered[0]:
        return [], []
    out = []
    _tls.probing = True
    try:
        for register in (node.register_prehook, node.register_hook):
            try:
                register(_noop)
            except _Probe as p:
                out.append(list(p.hooks.values()) if p.hooks else [])
            else:  # not our wrapper (someone replaced it): nothing to learn
                return [], []
    finally:
        _tls.probing = False
    return out[0], out[1]


def run_pre(pre: list, grad: Any) -> Any:
    """``grad`` after the pre-hooks (each may return a replacement tuple)."""
    grads = (grad,)
    for hook in pre:
        out = hook(grads)
        if out is not None:
            grads = tuple(out)
    return grads[0]


def run_post(post: list, grad: Any) -> None:
    for hook in post:
        hook((), (grad,))
