"""DistributedDataParallel inside a distributed backward, wherever its parameters are.

DDP averages gradients from hooks on its parameters' AccumulateGrad nodes, and
its reducer writes the averaged gradient back at the end of the engine call in
which the last bucket became ready. It expects one backward: every parameter's
hook, then the end. A distributed backward instead runs a worker's graph in
pieces (the root's region, later the region behind each send function, as
their gradients arrive), and captures leaf gradients without running
AccumulateGrad. So the engine (:mod:`.share`) *holds* the gradients of DDP's
parameters until the pass is quiet everywhere (no gradient in flight, no run
active), then :mod:`.engine` asks each worker that holds some to *flush*: all
of them go through their AccumulateGrad nodes in one engine call (:func:`synced`:
the hooks fire, buckets fill, the all-reduce runs, the reducer writes the
average into ``.grad``); the average is then taken out of ``.grad`` for the
context and ``.grad`` restored. The context thus holds what torch's context
holds with DDP: the group's average, whether DDP's layers lie before, after or
on both sides of an RPC.

``find_unused_parameters=True``: DDP's forward looks for its unused parameters
by walking the local graph from the outputs, and stops at a recv function, so a
layer before an RPC would look unused. Inside a distributed autograd context
that search is therefore deferred to the flush, where the pass has shown which
parameters got a gradient (the others are the unused ones).

DDP's parameters are known from its constructor (wrapped once, when this module
is imported); nothing is checked while no DDP exists.

Example::

    >>> model = DistributedDataParallel(Hybrid(fc1, remote_emb, fc2), process_group=trainers)
    >>> with dist_autograd.context() as cid:
    ...     loss = model(x).sum()                    # fc1 -> RPC -> fc2
    ...     dist_autograd.backward(cid, [loss])      # every trainer gets the average
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .context import CONTAINER
from .nodes import _engine_run_backward

_params: dict[int, weakref.ref] = {}            # id -> parameter some DDP instance syncs
_owner: dict[int, weakref.ref] = {}             # id of a parameter -> its DDP instance
_deferred: dict[int, Any] = {}                  # id(reducer) -> reducer whose unused-search waits
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
        me = weakref.ref(self)
        for p in self.module.parameters():
            if p.requires_grad:
                _params[id(p)] = weakref.ref(p, lambda _r, k=id(p): (_params.pop(k, None),
                                                                      _owner.pop(k, None)))
                _owner[id(p)] = me
        active[0] = True

    __init__._distgrad = True  # type: ignore[attr-defined]
    DDP.__init__ = __init__
    _wrap_reducer()


def _wrap_reducer() -> None:
    try:
        from torch.distributed import Reducer
    except ImportError:
        return
    orig = Reducer.prepare_for_backward
    if getattr(orig, "_distgrad", False):
        return

    def prepare_for_backward(self, outputs):
        ctx = CONTAINER.current() if outputs else None
        if ctx is not None and (ctx.send_functions or ctx.recv_functions):
            # find_unused_parameters after RPCs inside a distributed autograd context:
            # the local graph ends at recv functions, so the search waits for the flush
            _deferred[id(self)] = self
            return None
        return orig(self, outputs)

    prepare_for_backward._distgrad = True  # type: ignore[attr-defined]
    prepare_for_backward._orig = orig  # type: ignore[attr-defined]
    Reducer.prepare_for_backward = prepare_for_backward


_wrap_ddp()


def _is_ddp(t: torch.Tensor) -> bool:
    ref = _params.get(id(t))
    return ref is not None and ref() is t


def held(leaves: Sequence[Any], grads: Sequence) -> list[int]:
    """Indices of the gradients in ``grads`` (one per AccumulateGrad node of
    ``leaves``) that belong to a DDP parameter: the engine holds those until the
    pass's flush."""
    if not active[0] or not _params:
        return []
    return [i for i, g in enumerate(grads) if g is not None and _is_ddp(leaves[i].variable)]


def _search_unused(variables: list) -> None:
    """Run the unused-parameter search that DDP's forward deferred (see above), with
    the parameters that got a gradient in this pass as what the outputs reached."""
    from torch.distributed import Reducer
    owners: dict[int, list] = {}
    for v in variables:
        ref = _owner.get(id(v))
        module = ref() if ref is not None else None
        if module is not None and id(module.reducer) in _deferred:
            owners.setdefault(id(module.reducer), []).append(v)
    for key, vs in owners.items():
        reducer = _deferred.pop(key)
        with torch.enable_grad():
            reached = [v.view_as(v) for v in vs]
        Reducer.prepare_for_backward._orig(reducer, reached)


def synced(leaves: Sequence[Any], grads: Sequence) -> Sequence:
    """``grads`` (one per AccumulateGrad node in ``leaves``) with those of DDP's
    parameters replaced by what DDP makes of them (the average over its group),
    in one engine call through their AccumulateGrad nodes: the node's hooks and
    post-accumulate-grad hooks run there. The leaves' own tensor hooks do not run
    again (the engine applied them when it captured the gradients)."""
    idx = held(leaves, grads)
    if not idx:
        return grads
    out = list(grads)
    variables = [leaves[i].variable for i in idx]
    with _lock:
        if _deferred:
            _search_unused(variables)
        saved = [v.grad for v in variables]
        hooked = [(v, v._backward_hooks) for v in variables if v._backward_hooks]
        for v in variables:
            v.grad = None
        for v, _ in hooked:
            v._backward_hooks = None
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
            for v, hooks in hooked:
                v._backward_hooks = hooks
    return out
