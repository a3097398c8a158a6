"""DistributedDataParallel inside a distributed backward (the ddp_rpc pattern).

DDP averages gradients from hooks on its parameters' AccumulateGrad nodes, and
its reducer writes the averaged gradient back at the end of the engine call in
which the last bucket became ready. The distributed engine captures leaf
gradients without running AccumulateGrad (they go to the context, not
``.grad``), so those hooks would never fire and each replica would step with its
own gradient. Here the gradients of DDP's parameters are passed through their
AccumulateGrad nodes in one engine call (hooks fire, the all-reduce runs, the
reducer writes the average into ``.grad``); the average is then taken out of
``.grad`` for the context and ``.grad`` restored, so the context holds what
torch's context holds with DDP: the averaged gradient.

DDP's parameters are known from its constructor (wrapped once, when this module
is imported); nothing is checked while no DDP exists.

Example::

    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=trainers)
    >>> with dist_autograd.context() as cid:
    ...     loss = ddp(remote_emb(x)).sum()
    ...     dist_autograd.backward(cid, [loss])      # every trainer gets the average
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

_params: dict[int, weakref.ref] = {}            # id -> parameter some DDP instance syncs
_lock = threading.Lock()                        # one .grad round trip at a time
active = [False]


def _wrap_ddp() -> None:
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:  # a torch without distributed
        return
    if getattr(DDP.__init__, "_distgrad", False):
        return
    orig = DDP.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        for p in self.module.parameters():
            if p.requires_grad:
                _params[id(p)] = weakref.ref(p, lambda _r, k=id(p): _params.pop(k, None))
        active[0] = True

    __init__._distgrad = True  # type: ignore[attr-defined]
    DDP.__init__ = __init__


_wrap_ddp()


def _is_ddp(t: torch.Tensor) -> bool:
    ref = _params.get(id(t))
    return ref is not None and ref() is t


def synced(leaves: Sequence[Any], grads: Sequence) -> Sequence:
    """``grads`` (one per AccumulateGrad node in ``leaves``) with those of DDP's
    parameters replaced by what DDP makes of them (the average over its group)."""
    if not active[0] or not _params:
        return grads
    idx = [i for i, g in enumerate(grads) if g is not None and _is_ddp(leaves[i].variable)]
    if not idx:
        return grads
    from .share import _engine_run_backward
    out = list(grads)
    variables = [leaves[i].variable for i in idx]
    with _lock:
        saved = [v.grad for v in variables]
        for v in variables:
            v.grad = None
        try:
            edges = tuple(GradientEdge(leaves[i], 0) for i in idx)
            gs = tuple(grads[i].detach() for i in idx)
            if _engine_run_backward is not None:
                _engine_run_backward(edges, gs, False, False, (), True, accumulate_grad=True)
            else:  # older torch: the public call accumulates the same way
                torch.autograd.backward(edges, gs)
            for i, v in zip(idx, variables):
                out[i] = v.grad
        finally:
            for v, s in zip(variables, saved):
                v.grad = s
    return out
