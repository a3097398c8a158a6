"""distgrad.autograd: torch.distributed.autograd's API on distgrad's RPC.

Example (worker0, with worker1 up)::

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    with dist_autograd.context() as context_id:
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = rpc.rpc_sync("worker1", torch.add, args=(t1, t1))
        dist_autograd.backward(context_id, [t2.sum()])
        grads = dist_autograd.get_gradients(context_id)   # {t1: tensor of 2s}
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import observe as _observe
from ..observe import local_ns
from ..rpc import extensions as _extensions
from .anomaly import detect_anomaly
from .context import CONTAINER, DistAutogradContext
from .engine import ENGINE, debug_info
from .engine import backward_async as _backward_async
from .engine import backward_sync as _backward_sync
from .recording import spread_release  # (importing it registers the agent extension)

__all__ = [
    "DistAutogradContext",
    "backward",
    "backward_async",
    "context",
    "detect_anomaly",
    "get_engine_stats",
    "get_gradients",
    "is_available",
]


def __getattr__(name: str) -> Any:
    """Only a pointer for the name this package no longer has: distributed graphs are
    drawn by :func:`distgrad.graph.export_graph` (a layer above this one, which never
    imports it)."""
    if name == "export_graph":
        raise AttributeError(f"module {__name__!r} has no attribute 'export_graph': "
                             "use distgrad.graph.export_graph")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_available() -> bool:
    """True: distgrad's distributed autograd is always built."""
    return True


def _init(worker_id: int) -> None:
    """Initialise the context container for ``worker_id`` (``init_rpc`` does this)."""
    CONTAINER.init(worker_id)


def _new_context() -> DistAutogradContext:
    """Create a context and make it this thread's current one."""
    return CONTAINER.new_context()


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context with ``context_id``; RuntimeError when this worker has none."""
    return CONTAINER.retrieve(context_id)


def _current_context() -> DistAutogradContext:
    """This thread's current context; RuntimeError when there is none."""
    ctx = CONTAINER.current()
    if ctx is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap your "
                           "code using: `with torch.distributed.autograd.context() as context_id` "
                           "to generate a valid context")
    return ctx


def _is_valid_context(context_id: int) -> bool:
    """True when this worker holds a context with ``context_id``."""
    with CONTAINER.lock:
        return context_id in CONTAINER.contexts


def _get_max_id() -> int:
    """The largest context id this worker can create: ``(worker_id << 48) + 2**48 - 1``."""
    return CONTAINER.max_id()


def _release_context(context_id: int) -> None:
    """Release a context here and, without waiting, on every worker it reached."""
    ctx = CONTAINER.release(context_id)
    if ctx is None:
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    spread_release(ctx, exclude=None)


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id.

    Every RPC made inside carries the id; leaving releases the context on this
    worker and on every worker that saw it.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.mul, args=(w, 2)).sum()
        ...     dist_autograd.backward(context_id, [loss])
    """
    ctx = CONTAINER.new_context()
    try:
        yield ctx.id
    finally:
        if CONTAINER.release(ctx.id) is not None:
            spread_release(ctx, exclude=None)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
             grad_tensors: Sequence[torch.Tensor] | None = None, create_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots``; gradients of leaves go to
    the context of the worker that owns each leaf (see :func:`get_gradients`).

    ``grad_tensors`` (distgrad's extra, as in ``torch.autograd.backward``) gives
    the gradients of non-scalar roots. Blocks until every worker is done.

    ``create_graph=True`` (distgrad's extra) records the backward on every worker,
    gradients shipped between workers included, so the gradients in the context
    require grad and a later ``backward`` over a function of them (in the same
    context) adds exact second derivatives, as ``loss.backward(create_graph=True)``
    then ``f(w.grad).backward()`` does locally. It implies ``retain_graph``.

    Example::

        >>> with dist_autograd.context() as cid:
        ...     y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3))
        ...     dist_autograd.backward(cid, [y.sum()])
        ...     dist_autograd.get_gradients(cid)[x]
        tensor([3., 3.])
        >>> with dist_autograd.context() as cid:      # a gradient penalty
        ...     y = rpc.rpc_sync("worker1", torch.pow, args=(x, 3))
        ...     dist_autograd.backward(cid, [y.sum()], create_graph=True)
        ...     g = dist_autograd.get_gradients(cid)[x]            # 3 x**2, requires grad
        ...     dist_autograd.backward(cid, [(g ** 2).sum()])    # adds 36 x**3
    """
    tr = _observe.ACTIVE
    if tr is None:
        _backward_sync(context_id, roots, retain_graph, grad_tensors, create_graph)
        return
    t0 = local_ns()
    try:
        _backward_sync(context_id, roots, retain_graph, grad_tensors, create_graph)
    finally:
        tr.span("dist_autograd.backward", "backward.call", t0, {"context": context_id})


def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                   grad_tensors: Sequence[torch.Tensor] | None = None,
                   create_graph: bool = False) -> torch.futures.Future:
    """Like :func:`backward`, returning a ``torch.futures.Future`` at once.

    Example::

        >>> fut = dist_autograd.backward_async(cid, [loss])
        >>> fut.wait()
    """
    return _backward_async(context_id, roots, retain_graph, grad_tensors, create_graph)


_extensions.provide_backward(backward_async)   # RRef.backward(ctx) on the owner: RPC never imports this


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Leaf tensor -> accumulated gradient, for this worker's leaves in the context.

    Example::

        >>> dist_autograd.get_gradients(context_id)[w]
        tensor([2., 2.])
    """
    ctx = CONTAINER.retrieve(context_id)
    with ctx.lock:
        if ctx.grad_events:   # (a device's gradients: the reader's streams wait for them)
            ctx.wait_ready()
        return ctx.leaf_gradients()


def get_engine_stats() -> dict[str, int]:
    """distgrad's own engine counters on this worker (torch's two keys stay in
    :func:`_get_debug_info`): ``passes_graph_task`` (this worker's share ran as
    one graph task of torch's engine: the native engine), and on the Python engine
    ``passes_native`` (this worker's share ran as
    native engine calls), ``passes_shared`` (entries shared nodes, so the
    node-by-node executor ran it), ``executor_nodes_run``, ``passes_discovered``
    (passes this worker started that needed the discovery fallback because a
    shared node waited for an RPC result that never reached the loss).

    Example::

        >>> dist_autograd.get_engine_stats()["passes_graph_task"]
        12
    """
    with ENGINE.lock:
        return {k: ENGINE.stats.get(k, 0) for k in ("passes_graph_task", "passes_native", "passes_shared",
                                                    "executor_nodes_run", "passes_discovered")}


def _get_debug_info() -> dict[str, int]:
    """torch's two counters: ``num_current_backward_passes`` and ``num_autograd_contexts``."""
    return debug_info()
