"""Distributed autograd contexts and the per-process container.

A context id carries the creating worker's id in its top 16 bits and a
counter in the low 48, so ids are unique across the cluster without talking
(a dynamic group's rank numbers each incarnation in its own slice of the
counter: see :mod:`distgrad.ids`).
Each worker holds its own copy of every context it saw; the copies share the
id. A context records the send and recv functions of its RPCs (by autograd
message id), the workers it talked to, and the gradients of this worker's
leaves.
"""
from __future__ import annotations

import collections
import itertools
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..ids import COUNTER_BITS as _COUNTER_BITS
from ..ids import COUNTER_MASK as _COUNTER_MASK

_GONE_KEPT = 1 << 16   # released context ids remembered (8 bytes and a link each)


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
        # the native engine's accumulation of one leaf (read, torch's rule, store) is atomic
        self.acc_lock = threading.Lock()
        self.send_functions: dict[int, Any] = {}
        self.send_outputs: dict[int, tuple] = {}   # keeps each send node alive
        self.recv_functions: dict[int, Any] = {}
        # message ids of recv functions made for a reply's tensors: their gradients go
        # back through this worker's own device maps (torch's inverse of the reply's
        # map); those of a request's tensors through the reverse maps (rpc/devices.py)
        self.recv_of_reply: set[int] = set()
        # torch's known workers: those this worker sent autograd information to under
        # the context (``_known_worker_ids()``; torch adds none on receipt)
        self.known_workers: set[int] = set()
        # every worker a message under the context came from (its loss releases the
        # context here, recv function or not)
        self.heard_from: set[int] = set()
        # keyed by the leaf's AccumulateGrad node (held here, so it stays the
        # leaf's one node); get_gradients() maps them to the leaf tensors
        self.gradients: dict[Any, torch.Tensor] = {}
        # leaves whose stored gradient later gradients are added into in place, as
        # torch's accumulateGrad does (``variable_grad += new_grad``): every first-order
        # gradient, kept or copied; not a create_graph pass's (summed out of place)
        self.grads_mine: set = set()
        # (device, stream id) -> an event after the last accumulation there (devices only)
        self.grad_events: dict = {}
        # engine results not yet taken into ``gradients`` (see accumulate_fresh): taken in
        # order, before anything reads or adds to ``gradients``
        self._pending: list = []
        # get_gradients gave the user the stored tensors: later results are taken in at
        # once (added into those tensors as the engine returns them, as torch does),
        # never left pending until the next read
        self.exposed = False
        self.passes: dict[tuple, Any] = {}         # backward passes' state on this worker
        self.ended_passes: set = set()             # native shares that ended here
        self.released = False
        # workers this context's RPCs reached that were lost since (rank -> the error): a
        # process that later joins under such a rank has none of this context
        self.lost_peers: dict[int, BaseException] = {}

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
            self._settle()
            self.exposed = True
            return {node.variable: g for node, g in self.gradients.items()}

    def gradient_of(self, leaf: Any) -> torch.Tensor | None:
        """The gradient held for ``leaf`` (its AccumulateGrad node), or None."""
        with self.lock:
            self._settle()
            return self.gradients.get(leaf)

    def _settle(self) -> None:
        """Take the pending engine results in (caller holds the lock)."""
        while self._pending:
            pending, self._pending = self._pending, []
            for batch in pending:
                self._take(*batch)

    def accumulate(self, leaf: Any, grad: torch.Tensor, owned: bool = False) -> None:
        """Add ``grad`` to the gradient of ``leaf`` (its AccumulateGrad node) in this
        context (never ``.grad``), by torch's rules (see :func:`_combine`).

        ``owned``: ``grad`` is a fresh tensor nobody else holds, kept without a
        copy when its layout is the one torch would give it; otherwise the first
        gradient is copied (sparse stays sparse; dense takes the leaf's strides).
        """
        with self.lock:
            self._settle()
            old = self.gradients.get(leaf)
            if old is not None:
                self.gradients[leaf] = _combine(self.grads_mine, leaf, old, grad)
            elif owned and _keepable(grad, leaf):
                self.gradients[leaf] = _kept(grad)
                self.grads_mine.add(leaf)
            else:
                self.gradients[leaf] = _copy(grad, leaf)
                self.grads_mine.add(leaf)

    def store(self, leaf: Any, grad: torch.Tensor, ready: Any = None, stream_id: int = 0) -> None:
        """Hold ``grad`` for ``leaf`` as it is: the native engine computed it by torch's
        ``AccumulateGrad::accumulateGrad`` rules (stolen, a view of the engine's, a copy,
        or the held tensor summed in place) from what :meth:`gradient_of` returned.
        ``ready``: on an accelerator, an event recorded on stream ``stream_id`` after
        the accumulation (what :meth:`wait_ready` makes a reader's stream wait for)."""
        with self.lock:
            self._settle()
            self.gradients[leaf] = grad
            self.grads_mine.add(leaf)
            if ready is not None:
                self.note_ready(ready, stream_id)

    def note_ready(self, ready: Any, stream_id: int) -> None:
        """An accumulation into a held device gradient (in place) ended where ``ready``
        was recorded (stream ``stream_id``): readers wait for it (:meth:`wait_ready`)."""
        with self.lock:
            self.grad_events[(ready.device, stream_id)] = ready

    def wait_ready(self) -> None:
        """Make the current stream of each device that holds a gradient wait for the
        accumulations into it, as torch's ``DistAutogradContext::getGradients`` blocks the
        current streams on its gradients' events (backward and a later read, such as an
        optimizer step, may run on different streams). Caller holds the lock."""
        for (device, _), ev in self.grad_events.items():
            ev.wait(torch.accelerator.current_stream(device))

    def replace(self, leaf: Any, grad: torch.Tensor) -> None:
        """Make ``grad`` the gradient of ``leaf`` (DDP's result for what the context
        held plus this pass's): written into the tensor the context holds, as DDP's
        reducer copies into the context's gradient, so a tensor taken from
        ``get_gradients`` shows it; a copy where that cannot be done."""
        g = grad.detach()
        with self.lock:
            self._settle()
            old = self.gradients.get(leaf)
            if (old is not None and leaf in self.grads_mine and old.layout == torch.strided
                    and g.layout == torch.strided and old.shape == g.shape):
                old.copy_(g)
            else:
                self.gradients[leaf] = _copy(g, leaf)
                self.grads_mine.add(leaf)

    def accumulate_fresh(self, leaves: list, grads: Sequence, given: Sequence,
                         owned: bool = False, lazy: bool = False,
                         given_refs: Sequence[int] | None = None) -> None:
        """Accumulate an engine call's results ``grads`` for ``leaves``
        (AccumulateGrad nodes), with torch's no-copy rule: a first gradient is
        kept as it is only when nobody else holds it and its layout is the one
        torch gives a gradient (dense: the leaf's strides; sparse: contiguous
        indices and values); otherwise it is copied. Held by someone else means:
        another Python reference (a hook that kept it; the same tensor handed to
        two leaves, as x + y does), or memory shared with an earlier result or
        with a ``given`` gradient (passed through views). ``owned``: the given
        gradients are this pass's own (received from the network) and may be
        kept as they are; they are never written to.

        ``lazy``: nobody but this pass can reach ``given`` (so a copy of a result
        that shares its memory may be made later). The references to each result are
        counted now, as torch counts them when it accumulates: when some result has
        another holder, everything is taken in at once (its copy made before the
        holder can change it); otherwise the results wait in ``_pending`` until the
        gradients are read or added to (the common path then costs no Python work
        per leaf).

        ``given_refs`` (with ``owned``): each ``given`` gradient's reference count read
        just before the engine call. A received gradient the engine hands back
        unchanged (a leaf sent as is) is then held by distgrad's own references too;
        only references added since (a hook kept it) count as another holder, so it
        is kept without a copy, as torch keeps it."""
        refs = list(map(sys.getrefcount, grads))  # the shape _calibrate() measures
        if owned and given_refs is not None:
            before = {id(t): n for t, n in zip(given, given_refs)}
            for i, g in enumerate(grads):
                n = before.get(id(g))
                if n is not None:
                    # since then: one reference per slot of ``grads`` holding it, plus
                    # whatever else took one (a holder)
                    slots = sum(1 for h in grads if h is g)
                    refs[i] = _BASE_REFS + max(0, refs[i] - n - slots)
        if lazy:
            # torch decides copy-or-keep as it accumulates: a result someone else holds
            # (a hook kept it; one tensor for two leaves) is copied now, before its holder
            # can change it; only results nobody else holds wait (keeping is lazy)
            counts = set(refs)
            counts.discard(list(map(sys.getrefcount, _ONE_NONE))[0])  # absent gradients
            lazy = max(counts, default=0) <= _BASE_REFS
        given_keys = {_memory_key(g) for g in given}
        with self.lock:
            if lazy and not self.exposed:
                self._pending.append((leaves, grads, refs, given_keys, owned))
            else:
                self._settle()
                self._take(leaves, grads, refs, given_keys, owned)

    def _take(self, leaves: list, grads: Sequence, refs: list, given_keys: set,
              owned: bool) -> None:
        """:meth:`accumulate_fresh`'s rule, applied (caller holds the lock); ``refs``:
        each result's reference count when the engine returned it."""
        seen: set = set()
        grads_of, mine = self.gradients, self.grads_mine
        for leaf, g, r in zip(leaves, grads, refs):
            if g is None:
                continue
            key = _memory_key(g)
            old = grads_of.get(leaf)
            if old is not None:
                grads_of[leaf] = _combine(mine, leaf, old, g)
            elif key in seen or r > _BASE_REFS or not _keepable(g, leaf):
                # shared with another result, held by someone else (a hook kept it: a
                # copy, as torch's use count rule), or a layout torch would not keep
                grads_of[leaf] = _copy(g, leaf)
                mine.add(leaf)
            elif key in given_keys and not owned:
                # a caller's tensor (grad_tensors) must not become ours
                grads_of[leaf] = _copy(g, leaf)
                mine.add(leaf)
            else:
                # a result nobody else holds, or a received buffer (this pass's own):
                # kept without a copy, and added into by later gradients, as torch does
                grads_of[leaf] = _kept(g)
                mine.add(leaf)
            seen.add(key)

    def accumulate_graph(self, leaves: Sequence, grads: Sequence) -> None:
        """Accumulate gradients of a ``create_graph=True`` pass: recorded, as torch's
        AccumulateGrad does in grad mode (a first gradient is copied, later ones
        summed out of place), so the stored gradients carry their graph."""
        with self.lock, torch.enable_grad():
            self._settle()
            for leaf, g in zip(leaves, grads):
                if g is None:
                    continue
                old = self.gradients.get(leaf)
                self.gradients[leaf] = _copy(g, leaf, keep_graph=True) if old is None else old + g
                self.grads_mine.discard(leaf)  # never written to in place

    def __repr__(self) -> str:
        return f"DistAutogradContext(id={self.id})"


def _stop_native(ctx: DistAutogradContext, stop: bool) -> None:
    """A released context's native shares: as torch's, a running pass goes on (a
    gradient that arrives for the released context fails it, "Could not find
    autograd context"); a share nobody started (discovery built it) ends now; with
    ``stop`` (a worker of the context is lost, or this one shuts down) every share
    stops, since no initiator can end them."""
    with ctx.lock:
        states = list(ctx.passes.values())
    for st in states:
        if getattr(st, "native", False):
            if stop:
                st.abort()
            else:
                st.end_if_idle()


def _calibrate() -> int:
    """What accumulate_fresh's count of references says of a result nobody else holds."""
    grads = (torch.empty(0),)
    return list(map(sys.getrefcount, grads))[0]


_BASE_REFS = _calibrate()
_ONE_NONE = (None,)  # an absent gradient's count of references, read the way refs are


def _memory_key(t: torch.Tensor) -> int:
    """Where ``t``'s data lives (its values' storage for a sparse tensor): two
    tensors with one key may share memory."""
    if t.layout == torch.sparse_coo:
        t = t._values()
    elif t.layout != torch.strided:
        return id(t)
    return t.untyped_storage().data_ptr()


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory exactly (any order of dimensions)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _keepable(g: torch.Tensor, leaf: Any) -> bool:
    """Whether torch would keep ``g`` as a leaf's first gradient without a copy, as far
    as its layout goes: a sparse one needs contiguous indices and values; a dense
    one the leaf's strides (dimensions of size 1 aside, though not at stride 0:
    those are broadcast views) when the leaf is non-overlapping and dense, else
    to be contiguous."""
    if g.layout == torch.sparse_coo:
        return g._indices().is_contiguous() and g._values().is_contiguous()
    if g.layout != torch.strided:
        return False
    var = leaf.variable
    if var.layout != torch.strided:
        return g.is_contiguous()
    g_strides, var_strides = g.stride(), var.stride()
    if g_strides == var_strides and 0 not in g_strides and g.is_contiguous():
        return True  # the common case (both contiguous), whichever rule applies
    if not _non_overlapping_and_dense(var):
        return g.is_contiguous()
    for n, gs, vs in zip(g.shape, g_strides, var_strides):
        if (gs != vs) if n != 1 else (gs == 0):
            return False
    return True


def _copy(g: torch.Tensor, leaf: Any, keep_graph: bool = False) -> torch.Tensor:
    """A copy of ``g`` in the layout torch gives a copied gradient: sparse stays
    sparse; dense takes the leaf's strides (contiguous when the leaf has gaps).
    ``keep_graph``: the copy is recorded (its gradient flows back to ``g``)."""
    if not keep_graph:
        g = g.detach()
    if g.layout != torch.strided:
        return g.clone()
    var = leaf.variable
    if var.layout == torch.strided and _non_overlapping_and_dense(var) and var.shape == g.shape:
        return torch.empty_strided(var.shape, var.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


def _kept(g: torch.Tensor) -> torch.Tensor:
    """``g`` kept as a first gradient without a copy, as torch keeps it: dense
    detached; sparse as a new tensor over the same indices and values (a detached
    sparse tensor refuses the in-place sum a later gradient makes)."""
    if g.layout == torch.sparse_coo:
        return torch.sparse_coo_tensor(g._indices(), g._values(), g.shape,
                                       is_coalesced=g.is_coalesced())
    return g.detach() if g.requires_grad else g


def _combine(mine: set, leaf: Any, old: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``old + g`` for ``leaf``, as torch's context does (grad mode off,
    ``AccumulateGrad::accumulateGrad``): into ``old`` in place (dense + dense,
    dense + sparse, sparse + sparse), so a tensor taken from ``get_gradients``
    shows the new sum; sparse + dense is a new dense tensor (its layout changes).
    There torch 2.13's context keeps the sparse one and drops the sum
    (``c10::Dict::insert`` does not replace a key): distgrad keeps the sum.
    A create_graph pass's gradient (not in ``mine``) is summed out of place, its
    graph left alone."""
    g = g.detach()
    if leaf in mine and (old.layout == torch.strided or g.layout != torch.strided):
        return old.add_(g)
    mine.add(leaf)
    old = old.detach()
    if old.layout != torch.strided and g.layout == torch.strided:
        return g + old  # sparse + dense is not defined, dense + sparse is
    return old + g



class Container:
    """All contexts this process knows, and each thread's current context."""

    def __init__(self) -> None:
        self.worker_id = -1
        self.contexts: dict[int, DistAutogradContext] = {}
        self.lock = threading.Lock()
        self._counter = itertools.count()
        self._msg_counter = itertools.count()
        self._tls = threading.local()
        # ids released here, newest last (bounded): a request or reply read after its
        # context's release (read together with it, or still in flight) finds the
        # context released, instead of making it anew (a context no one would ever
        # release, and a reply cut off from the graph). An agent never reuses an id;
        # a later init_rpc in this process may (init() forgets them).
        self._gone: collections.OrderedDict[int, None] = collections.OrderedDict()

    def init(self, worker_id: int, first: int = 0, end: int = 1 << _COUNTER_BITS) -> None:
        """Number this worker's contexts and messages from ``first`` up to ``end``
        (a later incarnation of a rank in a dynamic group numbers in its own slice,
        past every id an earlier one may have used: see :mod:`distgrad.ids`)."""
        if not 0 <= worker_id < (1 << 16):
            raise ValueError(f"worker id {worker_id} does not fit in 16 bits")
        with self.lock:
            self.worker_id = worker_id
            self.first, self.end = first, end
            self._counter = itertools.count(first)
            self._msg_counter = itertools.count(first)
            self._gone.clear()   # a new agent: its ids start again (static groups from 0)

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
        if n >= getattr(self, "end", 1 << _COUNTER_BITS):
            raise RuntimeError(f"distributed autograd context ids exhausted on worker {self.worker_id}")
        ctx = DistAutogradContext((self.worker_id << _COUNTER_BITS) + n)
        with self.lock:
            self.contexts[ctx.id] = ctx
        self._tls.current = ctx
        return ctx

    def new_message_id(self) -> int:
        """The next autograd message id of this worker (never one of an earlier
        incarnation's: exhausting the slice raises instead of wrapping)."""
        n = next(self._msg_counter)
        if n >= getattr(self, "end", 1 << _COUNTER_BITS):
            raise RuntimeError(f"distributed autograd message ids exhausted on worker {self.worker_id}")
        return (self.worker_id << _COUNTER_BITS) + n

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``, made here when it is new; a context released
        here lately comes back released (not kept: see ``_gone``)."""
        with self.lock:
            ctx = self.contexts.get(context_id)
            if ctx is None and context_id in self._gone:
                ctx = DistAutogradContext(context_id)
                ctx.released = True
                return ctx
            if ctx is None:
                n = context_id & _COUNTER_MASK
                if context_id >> _COUNTER_BITS == self.worker_id and \
                        not getattr(self, "first", 0) <= n < getattr(self, "end", n + 1):
                    when = "an earlier" if n < getattr(self, "first", 0) else "a later"
                    raise RuntimeError(f"autograd context {context_id} was created by {when} "
                                       f"process under this worker's rank {self.worker_id} (another "
                                       "incarnation of it): it is not this process's")
                ctx = self.contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def retrieve(self, context_id: int) -> DistAutogradContext:
        with self.lock:
            ctx = self.contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return ctx

    def release(self, context_id: int, stop: bool = False) -> DistAutogradContext | None:
        """Drop the context here; returns it (None when unknown). ``stop``: its native
        shares stop too (a worker of the context was lost)."""
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
            self._bury(context_id)
        if ctx is not None:
            ctx.released = True
            _stop_native(ctx, stop)
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

    def clear(self, keep_own: bool = False) -> None:
        """Release every context; with ``keep_own``, all but those this worker
        created (their ``with`` blocks release them)."""
        with self.lock:
            for cid, ctx in list(self.contexts.items()):
                if keep_own and cid >> _COUNTER_BITS == self.worker_id:
                    continue
                ctx.released = True
                del self.contexts[cid]
                self._bury(cid)
                _stop_native(ctx, True)

    def _bury(self, context_id: int) -> None:
        """Remember ``context_id`` as released (the newest _GONE_KEPT ids); under lock."""
        self._gone[context_id] = None
        self._gone.move_to_end(context_id)
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)


CONTAINER = Container()
