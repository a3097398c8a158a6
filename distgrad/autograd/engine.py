"""The distributed backward engine: exact, each node once, never waiting on a
gradient that cannot come.

Every worker holds a share of the pass (a :class:`PassState`, kept in the
context): its *entries* are the roots (initiator only) and every send function
of the context, whose gradients arrive over the network in any order. On first
contact a worker walks its local graph from all its entries, counting every
node's incoming edges and noting whether two entries' regions share nodes.

* **Disjoint regions** (the common case): each entry runs as soon as its
  gradient arrives, as one native ``torch.autograd.grad`` call capturing the
  region's leaves (hooks run) and the recv anchor (so recv functions run and
  ship their gradients). Nothing ever waits, so an RPC whose result never
  reaches the loss costs nothing (torch's FAST mode hangs there).
* **Shared regions**: a node-by-node executor runs each node once, when all
  its counted inputs arrived. A shared node may then wait for a send function
  that will never receive a gradient (an unused RPC). Such waits are resolved
  at quiescence: gradient RPCs reply only after the receiver's own work and its
  outgoing gradient RPCs completed, and each reply says which workers still
  hold waiting nodes. When the roots' tree of replies is complete and someone
  waits, the initiator runs a *discovery* from the roots (which send functions
  are reachable at all), and the waiting workers recount their dependencies
  over the reachable part only and resume. Everything is exact and runs once;
  discovery costs messages only in that rare case.

Errors travel up the same tree of replies to the initiator's ``backward``.
Pass state lives in the context and goes with it.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ..rpc import api as rpc_api
from ..rpc.functions import async_execution
from .checks import check_roots as _check_roots
from .context import CONTAINER, DistAutogradContext
from .futures import all_of as _all
from .futures import chain as _chain
from .futures import done as _done
from .futures import failed as _failed
from .recording import _ANCHOR, _node_types

log = logging.getLogger(__name__)
_ACCUMULATE = None
_tls = threading.local()
_MAX_RESUMES = 8


def _grad(outputs: tuple, grads: tuple, inputs: tuple, retain_graph: bool) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)`` minus its per-input Python checks
    (we built every argument ourselves); falls back to the public call."""
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grads, retain_graph=retain_graph,
                                   allow_unused=True)
    return _engine_run_backward(outputs, grads, retain_graph, False, inputs, True,
                                accumulate_grad=False)


try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # older torch
    _engine_run_backward = None


def _accumulate_type() -> type:
    global _ACCUMULATE
    if _ACCUMULATE is None:
        a = torch.zeros(1, requires_grad=True)
        _ACCUMULATE = type((a * 1).grad_fn.next_functions[0][0])
    return _ACCUMULATE


class _Region:
    __slots__ = ("has_recv", "leaves")

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.has_recv = False


class PassState:
    """One worker's share of one backward pass."""

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, initiator: int,
                 retain_graph: bool, roots: Sequence[torch.Tensor] = ()) -> None:
        self.ctx, self.pass_id, self.initiator = ctx, pass_id, initiator
        self.retain_graph = retain_graph
        self.roots = list(roots)
        self.lock = threading.RLock()
        self.nodes: set = set()         # every node some entry reaches
        self.deps: collections.Counter = collections.Counter()
        self.regions: dict[Any, _Region] = {}
        self.shared = False
        self.buffers: dict[Any, list] = {}
        self.waiting: set = set()       # nodes holding some but not all inputs
        self.received: collections.Counter = collections.Counter()  # inputs arrived per node
        self.done: set = set()          # nodes the executor ran
        self.reach: set | None = None   # discovery's reachable nodes (fallback only)
        self.discovered: set[int] = set()
        self.nodes_run = 0
        self.running = 0
        self._prepare()

    # -- the walk ---------------------------------------------------------------
    def _prepare(self) -> None:
        with self.ctx.lock:
            sends = dict(self.ctx.send_functions)
        seen = 0
        if self.roots:
            seen += self._walk("root", [r.grad_fn for r in self.roots])
        for msg_id, node in sends.items():
            seen += self._walk(msg_id, [node])
        self.shared = seen > len(self.nodes)  # some node was reached from two entries
        if self.shared:  # the executor needs every node's count of inputs
            _, recv_t = _node_types()
            acc_t = _accumulate_type()
            deps = self.deps
            for r in self.roots:
                deps[r.grad_fn] += 1
            for node in sends.values():
                deps[node] += 1  # its gradient comes over the network
            for n in self.nodes:
                t = type(n)
                if t is recv_t or t is acc_t:
                    continue
                for nxt, _ in n.next_functions:
                    if nxt is not None:
                        deps[nxt] += 1

    def _walk(self, key: Any, starts: Sequence[Any]) -> int:
        """Collect ``key``'s region (its leaves, whether it holds recv functions);
        returns how many nodes it has. Kept minimal: it runs on every backward."""
        _, recv_t = _node_types()
        acc_t = _accumulate_type()
        region = self.regions.setdefault(key, _Region())
        leaves = region.leaves
        seen = set(starts)
        stack = list(seen)
        while stack:
            n = stack.pop()
            t = type(n)
            if t is acc_t:
                leaves.append(n)  # its .variable costs a tensor wrapper: only on demand
                continue
            if t is recv_t:
                region.has_recv = True
                continue
            for nxt, _ in n.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        self.nodes |= seen
        return len(seen)

    def walk_reach(self, starts: Sequence[Any]) -> list:
        """Discovery: mark what ``starts`` reach; returns the recv functions met."""
        _, recv_t = _node_types()
        if self.reach is None:
            self.reach = set()
        reach, recvs = self.reach, []
        stack = [n for n in starts if n not in reach]
        reach.update(stack)
        while stack:
            n = stack.pop()
            if type(n) is recv_t:
                recvs.append(n)
                continue
            for nxt, _ in n.next_functions:
                if nxt is not None and nxt not in reach:
                    reach.add(nxt)
                    stack.append(nxt)
        return recvs

    def blocked(self) -> bool:
        return bool(self.waiting)

    # -- execution ----------------------------------------------------------------
    def run_entry(self, key: Any, outputs: list, grads: list) -> None:
        """Run ``key``'s region with gradients for ``outputs`` (tensors or edges)."""
        if self.shared:
            with self.lock:
                self._feed(outputs, grads)
            return
        region = self.regions.get(key)
        if region is None:
            return
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        if not pairs or not (region.leaves or region.has_recv):
            return
        inputs = [GradientEdge(n, 0) for n in region.leaves]
        if region.has_recv:
            inputs.append(_ANCHOR)
        res = _grad(tuple(o for o, _ in pairs), tuple(g for _, g in pairs), tuple(inputs),
                    self.retain_graph)
        self.ctx.accumulate_fresh(region.leaves, res, [g for _, g in pairs])

    def resume(self) -> None:
        """After discovery: count only reachable inputs and run what is complete."""
        with self.lock:
            reach = self.reach or set()
            counted: collections.Counter = collections.Counter()
            for r in self.roots:
                counted[r.grad_fn] += 1
            for node in self.ctx.send_functions.values():
                if node in reach:
                    counted[node] += 1
            _, recv_t = _node_types()
            for n in reach:
                if type(n) is recv_t:
                    continue
                for nxt, _ in n.next_functions:
                    if nxt is not None:
                        counted[nxt] += 1
            ready = []
            for n in list(self.deps):
                if n in self.done or n not in reach:
                    continue
                self.deps[n] = counted[n] - self.received[n]
                if self.deps[n] == 0 and self.received[n]:
                    ready.append(n)
            self.waiting.difference_update(ready)
            while ready:
                self._execute(ready.pop(), ready)

    def _feed(self, outputs: list, grads: list) -> None:
        ready: list = []
        if outputs and isinstance(outputs[0], GradientEdge):
            # a send function: all its slots arrive in one message, one dependency
            node = outputs[0].node
            self.buffers[node] = list(grads)
            self._arrived(node, ready)
        else:
            for o, g in zip(outputs, grads):  # roots: one dependency each
                self._add(o.grad_fn, o.output_nr, g, ready)
        while ready:
            self._execute(ready.pop(), ready)

    def _arrived(self, node: Any, ready: list) -> None:
        self.received[node] += 1
        self.deps[node] -= 1
        if self.deps[node] == 0:
            self.waiting.discard(node)
            ready.append(node)
        else:
            self.waiting.add(node)

    def _add(self, node: Any, slot: int, g: Any, ready: list) -> None:
        if g is not None:
            buf = self.buffers.get(node)
            if buf is None:
                buf = self.buffers[node] = [None] * len(node._input_metadata)
            buf[slot] = g if buf[slot] is None else buf[slot] + g
        self._arrived(node, ready)

    def _execute(self, node: Any, ready: list) -> None:
        send_t, recv_t = _node_types()
        grads = self.buffers.pop(node, None) or [None] * len(node._input_metadata)
        self.done.add(node)
        self.nodes_run += 1
        t = type(node)
        if t is _accumulate_type():
            if grads[0] is not None:
                g = grads[0]
                for hook in (getattr(node.variable, "_backward_hooks", None) or {}).values():
                    out = hook(g)
                    if out is not None:
                        g = out
                self.ctx.accumulate(node, g)
            return
        if t is recv_t:
            ship_gradients(node.dg_info, grads)
            return
        if t is send_t:
            outs = grads
        else:
            full = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype)
                    for g, m in zip(grads, node._input_metadata)]
            with torch.no_grad():
                if hasattr(node, "_forward_cls"):  # a Python autograd.Function
                    res = node.apply(*full)
                    res = res if isinstance(res, tuple) else (res,)
                    picked = iter([g for g, need in zip(res, node.needs_input_grad) if need])
                    outs = [next(picked, None) if nxt is not None else None
                            for nxt, _ in node.next_functions]
                else:
                    res = node(*full)
                    outs = res if isinstance(res, (tuple, list)) else (res,)
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is not None:
                self._add(nxt, slot, g, ready)


class Engine:
    """Creates and finds passes (kept in their contexts) and counts them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ids = itertools.count()
        # how this worker's shares ran: native calls or the executor; executor node count
        self.stats: collections.Counter = collections.Counter()

    def _register(self, state: PassState) -> PassState:
        with self.lock:
            self.stats["passes_shared" if state.shared else "passes_native"] += 1
        with state.ctx.lock:
            state.ctx.passes[state.pass_id] = state
        return state

    def new_pass(self, ctx: DistAutogradContext, retain_graph: bool, roots: list) -> PassState:
        pass_id = (CONTAINER.worker_id, next(self._ids))
        return self._register(PassState(ctx, pass_id, CONTAINER.worker_id, retain_graph, roots))

    def get_or_create(self, context_id: int, pass_id: tuple, initiator: int,
                      retain_graph: bool) -> PassState:
        ctx = CONTAINER.retrieve(context_id)
        with ctx.lock:
            state = ctx.passes.get(pass_id)
            if state is None:
                state = PassState(ctx, pass_id, initiator, retain_graph)
                self._register(state)
            return state

    def finish(self, state: PassState) -> None:
        with state.ctx.lock:
            state.ctx.passes.pop(state.pass_id, None)
        with self.lock:
            self.stats["executor_nodes_run"] += state.nodes_run

    def current_passes(self) -> int:
        """Passes with work running or waiting on this worker."""
        with CONTAINER.lock:
            contexts = list(CONTAINER.contexts.values())
        n = 0
        for ctx in contexts:
            with ctx.lock:
                n += sum(1 for s in ctx.passes.values() if s.running or s.blocked())
        return n


ENGINE = Engine()


def _union(f: torch.futures.Future) -> set:
    out: set = set()
    for s in f.wait():
        out |= s
    return out


# -- execution ------------------------------------------------------------------
def ship_gradients(dg_info: tuple, grads: Sequence) -> None:
    """Send a recv function's gradients to the worker that sent its tensors."""
    context_id, msg_id, sender = dg_info
    state: PassState | None = getattr(_tls, "state", None)
    if state is None or state.ctx.id != context_id:
        raise RuntimeError(f"recv function of context {context_id} ran outside a distributed "
                           "backward pass (use distgrad.autograd.backward)")
    fut = rpc_api.rpc_async(sender, _propagate, timeout=0,
                            args=(context_id, state.pass_id, state.initiator, state.retain_graph,
                                  msg_id, list(grads)))
    _tls.collector.append(fut)


def _run(state: PassState, fn, *args) -> torch.futures.Future:
    """Run ``fn(*args)`` for ``state`` on this thread. The future covers the
    gradients it shipped and gives the set of workers left with waiting nodes."""
    prev = getattr(_tls, "state", None), getattr(_tls, "collector", None)
    _tls.state, _tls.collector = state, []
    state.running += 1
    try:
        fn(*args)
        shipped = _all(_tls.collector)
    except BaseException as e:  # noqa: BLE001
        return _failed(e)
    finally:
        state.running -= 1
        _tls.state, _tls.collector = prev
    me = CONTAINER.worker_id
    return _chain(shipped, lambda f: _union(f) | ({me} if state.blocked() else set()))


@async_execution
def _propagate(context_id: int, pass_id: tuple, initiator: int, retain_graph: bool,
               msg_id: int, grads: list) -> torch.futures.Future:
    state = ENGINE.get_or_create(context_id, pass_id, initiator, retain_graph)
    node = state.ctx.send_functions[msg_id]
    outputs = [GradientEdge(node, i) for i in range(len(grads))]
    return _run(state, state.run_entry, msg_id, outputs, grads)


# -- the fallback: discovery, then resume ------------------------------------------
def _discover_remote(state: PassState, recvs: list) -> torch.futures.Future:
    by_worker: dict[int, list[int]] = collections.defaultdict(list)
    for r in recvs:
        _, msg_id, sender = r.dg_info
        by_worker[sender].append(msg_id)
    futs = [rpc_api.rpc_async(w, _discover, timeout=0,
                              args=(state.ctx.id, state.pass_id, state.initiator,
                                    state.retain_graph, ids))
            for w, ids in by_worker.items()]
    return _all(futs)


@async_execution
def _discover(context_id: int, pass_id: tuple, initiator: int, retain_graph: bool,
              msg_ids: list[int]) -> torch.futures.Future:
    state = ENGINE.get_or_create(context_id, pass_id, initiator, retain_graph)
    with state.lock:
        starts = []
        for m in msg_ids:
            if m not in state.discovered:
                state.discovered.add(m)
                starts.append(state.ctx.send_functions[m])
        recvs = state.walk_reach(starts)
    return _discover_remote(state, recvs)


@async_execution
def _resume(context_id: int, pass_id: tuple) -> torch.futures.Future:
    state = ENGINE.get_or_create(context_id, pass_id, -1, True)
    return _run(state, state.resume)


def _resume_all(state: PassState, blocked: set) -> torch.futures.Future:
    futs = [_run(state, state.resume) if w == CONTAINER.worker_id
            else rpc_api.rpc_async(w, _resume, args=(state.ctx.id, state.pass_id), timeout=0)
            for w in blocked]
    return _chain(_all(futs), _union)


# -- the public entry ---------------------------------------------------------------
def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                   grad_tensors: Sequence[torch.Tensor] | None = None) -> torch.futures.Future:
    """Start a distributed backward pass; returns a Future done when every worker is done."""
    if isinstance(roots, torch.Tensor) or not isinstance(roots, (list, tuple)):
        raise TypeError("backward(): incompatible function arguments. roots must be a list of "
                        f"tensors, got {type(roots).__name__}")
    ctx = CONTAINER.retrieve(context_id)
    roots, grads = _check_roots(roots, grad_tensors)
    state = ENGINE.new_pass(ctx, retain_graph, roots)
    result = torch.futures.Future()
    resumes = [0]

    def finish(exc: BaseException | None) -> None:
        ENGINE.finish(state)
        if exc is None:
            result.set_result(None)
        else:
            result.set_exception(exc)

    def settled(f: torch.futures.Future) -> None:
        try:
            blocked = f.wait()
        except BaseException as e:  # noqa: BLE001
            finish(e)
            return
        if not blocked:
            finish(None)
            return
        resumes[0] += 1
        if resumes[0] > _MAX_RESUMES:
            finish(RuntimeError(f"distributed backward in context {ctx.id} did not settle: "
                                f"workers {sorted(blocked)} still wait for gradients"))
            return
        # Someone waits for a gradient that may never come: find what is reachable.
        if resumes[0] == 1:
            with ENGINE.lock:
                ENGINE.stats["passes_discovered"] += 1
            with state.lock:
                recvs = state.walk_reach([r.grad_fn for r in roots])
            disc = _discover_remote(state, recvs)
        else:
            disc = _done([])
        disc.add_done_callback(lambda f: _after_discovery(f, blocked))

    def _after_discovery(f: torch.futures.Future, blocked: set) -> None:
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001
            finish(e)
            return
        _resume_all(state, blocked).add_done_callback(settled)

    _run(state, state.run_entry, "root", list(roots), grads).add_done_callback(settled)
    return result
