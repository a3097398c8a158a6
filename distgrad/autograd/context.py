"""Distributed autograd contexts and the per-process container.

A context id carries the creating worker's id in its top 16 bits and a
counter in the low 48, so ids are unique across the cluster without talking.
Each worker holds its own copy of every context it saw; the copies share the
id. A context records the send and recv functions of its RPCs (by autograd
message id), the workers it talked to, and the gradients of this worker's
leaves.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

_COUNTER_BITS = 48
_COUNTER_MASK = (1 << _COUNTER_BITS) - 1


class DistAutogradContext:
    """One worker's copy of a distributed autograd context.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     ctx = dist_autograd._retrieve_context(context_id)
        ...     ctx._context_id() == context_id
        True
    """

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.RLock()
        self.send_functions: dict[int, Any] = {}
        self.send_outputs: dict[int, tuple] = {}   # keeps each send node alive
        self.recv_functions: dict[int, Any] = {}
        self.known_workers: set[int] = set()
        # keyed by the leaf's AccumulateGrad node (held here, so it stays the
        # leaf's one node); get_gradients() maps them to the leaf tensors
        self.gradients: dict[Any, torch.Tensor] = {}
        self.passes: dict[tuple, Any] = {}         # backward passes' state on this worker
        self.released = False

    def _context_id(self) -> int:
        """This context's id."""
        return self.id

    def _send_functions(self) -> dict[int, Any]:
        """Autograd message id -> send function (an autograd node) recorded here."""
        with self.lock:
            return dict(self.send_functions)

    def _recv_functions(self) -> dict[int, Any]:
        """Autograd message id -> recv function (an autograd node) recorded here."""
        with self.lock:
            return dict(self.recv_functions)

    def _known_worker_ids(self) -> set[int]:
        """Ids of every worker this context exchanged a message with."""
        with self.lock:
            return set(self.known_workers)

    def leaf_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """Leaf tensor -> its accumulated gradient."""
        with self.lock:
            return {node.variable: g for node, g in self.gradients.items()}

    def accumulate(self, leaf: Any, grad: torch.Tensor, owned: bool = False) -> None:
        """Add ``grad`` to the gradient of ``leaf`` (its AccumulateGrad node) in this
        context (never ``.grad``).

        ``owned``: ``grad`` is a fresh tensor nobody else holds, kept without a copy.
        """
        with self.lock:
            old = self.gradients.get(leaf)
            if old is None:
                self.gradients[leaf] = grad.detach() if owned else grad.detach().clone()
            else:
                self.gradients[leaf] = old + grad

    def accumulate_fresh(self, leaves: list, grads: Sequence, given: Sequence,
                         owned: bool = False) -> None:
        """Accumulate an engine call's results for ``leaves`` (AccumulateGrad
        nodes). Results are kept
        without a copy unless their memory is shared: the engine may hand one
        tensor to several leaves (x + y) or pass a ``given`` gradient through views
        (``owned``: the given gradients are this pass's own, received from the
        network, and may be kept as they are)."""
        seen = set() if owned else {g.untyped_storage().data_ptr() for g in given}
        grads_of = self.gradients
        with self.lock:
            for leaf, g in zip(leaves, grads):
                if g is None:
                    continue
                ptr = g.untyped_storage().data_ptr()
                old = grads_of.get(leaf)
                if old is not None:
                    grads_of[leaf] = old + g
                else:
                    grads_of[leaf] = g.clone() if ptr in seen else g
                seen.add(ptr)

    def __repr__(self) -> str:
        return f"DistAutogradContext(id={self.id})"


class Container:
    """All contexts this process knows, and each thread's current context."""

    def __init__(self) -> None:
        self.worker_id = -1
        self.contexts: dict[int, DistAutogradContext] = {}
        self.lock = threading.Lock()
        self._counter = itertools.count()
        self._msg_counter = itertools.count()
        self._tls = threading.local()

    def init(self, worker_id: int) -> None:
        if not 0 <= worker_id < (1 << 16):
            raise ValueError(f"worker id {worker_id} does not fit in 16 bits")
        with self.lock:
            self.worker_id = worker_id
            self._counter = itertools.count()
            self._msg_counter = itertools.count()

    def _check_init(self) -> None:
        if self.worker_id < 0:
            raise RuntimeError("Need to initialize distributed autograd using "
                               "torch.distributed.autograd.init()")

    def max_id(self) -> int:
        self._check_init()
        return (self.worker_id << _COUNTER_BITS) + _COUNTER_MASK

    def new_context(self) -> DistAutogradContext:
        self._check_init()
        if self.current_id() is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        n = next(self._counter)
        if n > _COUNTER_MASK:
            raise RuntimeError("distributed autograd context ids exhausted on this worker")
        ctx = DistAutogradContext((self.worker_id << _COUNTER_BITS) + n)
        with self.lock:
            self.contexts[ctx.id] = ctx
        self._tls.current = ctx
        return ctx

    def new_message_id(self) -> int:
        return (self.worker_id << _COUNTER_BITS) + (next(self._msg_counter) & _COUNTER_MASK)

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self.lock:
            ctx = self.contexts.get(context_id)
            if ctx is None:
                ctx = self.contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def retrieve(self, context_id: int) -> DistAutogradContext:
        with self.lock:
            ctx = self.contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return ctx

    def release(self, context_id: int) -> DistAutogradContext | None:
        """Drop the context here; returns it (None when unknown)."""
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
        if ctx is not None:
            ctx.released = True
        cur = getattr(self._tls, "current", None)
        if cur is not None and cur.id == context_id:
            self._tls.current = None
        return ctx

    def current(self) -> DistAutogradContext | None:
        ctx = getattr(self._tls, "current", None)
        if ctx is not None and ctx.released:
            self._tls.current = None
            return None
        return ctx

    def current_id(self) -> int | None:
        ctx = self.current()
        return None if ctx is None else ctx.id

    def set_current(self, ctx: DistAutogradContext | None) -> DistAutogradContext | None:
        prev = getattr(self._tls, "current", None)
        self._tls.current = ctx
        return prev

    def clear(self) -> None:
        with self.lock:
            for ctx in self.contexts.values():
                ctx.released = True
            self.contexts.clear()


CONTAINER = Container()
