"""The distributed backward engine: exact, each node once, never waiting on a
gradient that cannot come.

A pass runs in two phases (see docs/architecture.md and
../shared/design/autograd-engine.md):

1. **Discovery.** From the roots, each worker walks its local graph; every
   recv function reached names a send function on another worker, which is
   asked (one RPC per worker and hop, batched) to walk on from there. Only
   send functions reachable from the roots become entries, so an RPC whose
   result never reaches the loss is never waited for. The walk also counts,
   for every local node, its incoming edges within the pass, and notes
   whether the regions of two entries on one worker overlap.
2. **Execution.** Each worker runs an entry's region when the entry's
   gradient arrives. Where regions are disjoint (the common case) that is one
   native ``torch.autograd.grad`` call per entry, capturing the region's
   leaves (hooks run) and the recv anchor (so recv functions run and ship
   their gradients). Where regions share nodes, a node-by-node executor with
   the discovered dependency counts runs each shared node once, after all its
   gradients arrived.

Completion: a gradient RPC's reply completes only after the receiver's work
and its own outgoing gradient RPCs completed, so the initiator's pass is done
when its root execution and the tree of replies below it are done. Errors
travel up the same tree; the initiator then tells every participant to drop
the pass.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge

from ..rpc import api as rpc_api
from ..rpc.agent import agent_or_none
from ..rpc.functions import async_execution
from .context import CONTAINER, DistAutogradContext
from .recording import _ANCHOR, _node_types

log = logging.getLogger(__name__)
_ACCUMULATE = None
_tls = threading.local()


def _accumulate_type() -> type:
    global _ACCUMULATE
    if _ACCUMULATE is None:
        a = torch.zeros(1, requires_grad=True)
        _ACCUMULATE = type((a * 1).grad_fn.next_functions[0][0])
    return _ACCUMULATE


class _Region:
    __slots__ = ("leaves", "has_recv")

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.has_recv = False


class PassState:
    """One worker's share of one backward pass."""

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, initiator: int, retain_graph: bool):
        self.ctx, self.pass_id, self.initiator = ctx, pass_id, initiator
        self.retain_graph = retain_graph
        self.lock = threading.RLock()
        self.owner: dict[Any, Any] = {}
        self.deps: collections.Counter = collections.Counter()
        self.regions: dict[Any, _Region] = {}
        self.entries: set[int] = set()
        self.shared = False
        self.buffers: dict[Any, list] = {}
        self.participants: set[int] = set()
        self.nodes_run = 0

    # -- discovery -------------------------------------------------------------
    def walk(self, key: Any, starts: Sequence[Any]) -> list:
        """Walk the local graph from ``starts`` (an entry ``key``); returns recv nodes met."""
        send_t, recv_t = _node_types()
        acc_t = _accumulate_type()
        region = self.regions.setdefault(key, _Region())
        owner, deps = self.owner, self.deps
        recvs, stack = [], []
        for n in starts:
            o = owner.get(n)
            if o is None:
                owner[n] = key
                stack.append(n)
            elif o != key:
                self.shared = True
        while stack:
            n = stack.pop()
            t = type(n)
            if t is recv_t:
                recvs.append(n)
                region.has_recv = True
                continue
            if t is acc_t:
                region.leaves.append(n.variable)
                continue
            for nxt, _ in n.next_functions:
                if nxt is None:
                    continue
                deps[nxt] += 1
                o = owner.get(nxt)
                if o is None:
                    owner[nxt] = key
                    stack.append(nxt)
                elif o != key:
                    self.shared = True
        return recvs

    # -- execution -------------------------------------------------------------
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
        inputs = region.leaves + ([_ANCHOR] if region.has_recv else [])
        if not pairs or not inputs:
            return
        res = torch.autograd.grad([o for o, _ in pairs], inputs, grad_outputs=[g for _, g in pairs],
                                  retain_graph=self.retain_graph, allow_unused=True)
        # Keep returned gradients without a copy unless their memory is shared: the
        # engine may hand one tensor to several leaves (x + y) or pass a given
        # gradient through views.
        seen = {g.untyped_storage().data_ptr() for _, g in pairs}
        for leaf, g in zip(region.leaves, res):
            if g is not None:
                ptr = g.untyped_storage().data_ptr()
                self.ctx.accumulate(leaf, g, owned=ptr not in seen)
                seen.add(ptr)

    def _feed(self, outputs: list, grads: list) -> None:
        ready: list = []
        if outputs and isinstance(outputs[0], GradientEdge):
            # a send function: all its slots arrive in one message, one dependency
            node = outputs[0].node
            self.buffers[node] = list(grads)
            self.deps[node] -= 1
            if self.deps[node] == 0:
                ready.append(node)
        else:
            for o, g in zip(outputs, grads):  # roots: one dependency each
                self._add(o.grad_fn, o.output_nr, g, ready)
        while ready:
            self._execute(ready.pop(), ready)

    def _add(self, node: Any, slot: int, g: Any, ready: list) -> None:
        if g is not None:
            buf = self.buffers.get(node)
            if buf is None:
                buf = self.buffers[node] = [None] * len(node._input_metadata)
            buf[slot] = g if buf[slot] is None else buf[slot] + g
        self.deps[node] -= 1
        if self.deps[node] == 0:
            ready.append(node)

    def _execute(self, node: Any, ready: list) -> None:
        send_t, recv_t = _node_types()
        grads = self.buffers.pop(node, None) or [None] * len(node._input_metadata)
        self.nodes_run += 1
        t = type(node)
        if t is _accumulate_type():
            if grads[0] is not None:
                leaf = node.variable
                g = grads[0]
                for hook in (getattr(leaf, "_backward_hooks", None) or {}).values():
                    out = hook(g)
                    if out is not None:
                        g = out
                self.ctx.accumulate(leaf, g)
            return
        if t is recv_t:
            ship_gradients(node.dg_info, grads)
            return
        if t is send_t:
            outs = grads
        elif hasattr(node, "_forward_cls"):
            full = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype)
                    for g, m in zip(grads, node._input_metadata)]
            with torch.no_grad():
                res = node.apply(*full)
            res = res if isinstance(res, tuple) else (res,)
            picked = iter([g for g, need in zip(res, node.needs_input_grad) if need])
            outs = [next(picked, None) if nxt is not None else None for nxt, _ in node.next_functions]
        else:
            full = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype)
                    for g, m in zip(grads, node._input_metadata)]
            with torch.no_grad():
                res = node(*full)
            outs = res if isinstance(res, (tuple, list)) else (res,)
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is not None:
                self._add(nxt, slot, g, ready)


class Engine:
    """All backward passes this worker takes part in."""

    def __init__(self) -> None:
        self.passes: dict[tuple, PassState] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count()
        # passes this worker took part in, by how its share ran; executor node count
        self.stats: collections.Counter = collections.Counter()

    def new_pass(self, ctx: DistAutogradContext, retain_graph: bool) -> PassState:
        pass_id = (CONTAINER.worker_id, next(self._ids))
        state = PassState(ctx, pass_id, CONTAINER.worker_id, retain_graph)
        with self.lock:
            self.passes[(ctx.id, pass_id)] = state
        return state

    def get_or_create(self, context_id: int, pass_id: tuple, initiator: int,
                      retain_graph: bool) -> PassState:
        with self.lock:
            state = self.passes.get((context_id, pass_id))
            if state is None:
                ctx = CONTAINER.retrieve(context_id)
                state = self.passes[(context_id, pass_id)] = PassState(ctx, pass_id, initiator,
                                                                        retain_graph)
            return state

    def drop(self, context_id: int, pass_id: tuple) -> None:
        with self.lock:
            state = self.passes.pop((context_id, pass_id), None)
            if state is not None:
                self.stats["passes_shared" if state.shared else "passes_native"] += 1
                self.stats["executor_nodes_run"] += state.nodes_run

    def on_peer_lost(self, peer: int) -> None:
        """Drop the passes ``peer`` took part in or started: RPCs to it fail through
        the agent, and nothing it would have sent will come."""
        with self.lock:
            for key, state in list(self.passes.items()):
                if state.initiator == peer or peer in state.participants \
                        or peer in state.ctx.known_workers:
                    if state.initiator != CONTAINER.worker_id:
                        self.passes.pop(key, None)


ENGINE = Engine()


# -- futures helpers ------------------------------------------------------------
def _done(value: Any = None) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> torch.futures.Future:
    f = torch.futures.Future()
    f.set_exception(exc)
    return f


def _all(futures: list) -> torch.futures.Future:
    """Completes with the list of values when all complete; fails with the first
    error, unwrapped (``then`` would wrap it in a "running the callback" error)."""
    if not futures:
        return _done([])
    result = torch.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_f: torch.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        try:
            values = [f.wait() for f in futures]
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
            return
        result.set_result(values)

    for f in futures:
        f.add_done_callback(one)
    return result


def _chain(fut: torch.futures.Future, fn) -> torch.futures.Future:
    """``fut.then(fn)`` without wrapping errors raised by ``fn`` or by ``fut``."""
    result = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        try:
            value = fn(f)
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
            return
        result.set_result(value)
    fut.add_done_callback(done)
    return result


# -- discovery ------------------------------------------------------------------
def _discover_remote(state: PassState, recvs: list) -> torch.futures.Future:
    """Ask the senders of ``recvs`` to walk on; completes with the set of participants."""
    by_worker: dict[int, list[int]] = collections.defaultdict(list)
    for r in recvs:
        _, msg_id, sender = r.dg_info
        by_worker[sender].append(msg_id)
    futs = [rpc_api.rpc_async(w, _discover, args=(state.ctx.id, state.pass_id, state.initiator,
                                                  state.retain_graph, ids), timeout=0)
            for w, ids in by_worker.items()]

    def merge(f):
        out = set(by_worker)
        for s in f.wait():
            out |= s
        return out
    return _chain(_all(futs), merge)


@async_execution
def _discover(context_id: int, pass_id: tuple, initiator: int, retain_graph: bool,
              msg_ids: list[int]) -> torch.futures.Future:
    state = ENGINE.get_or_create(context_id, pass_id, initiator, retain_graph)
    recvs = []
    with state.lock:
        for m in msg_ids:
            if m in state.entries:
                continue
            node = state.ctx.send_functions.get(m)
            if node is None:
                raise RuntimeError(f"send function for autograd message {m} not found in "
                                   f"context {context_id}")
            state.entries.add(m)
            state.deps[node] += 1  # its gradient comes over the network
            recvs += state.walk(m, [node])
    return _discover_remote(state, recvs)


# -- execution ------------------------------------------------------------------
def ship_gradients(dg_info: tuple, grads: Sequence) -> None:
    """Send a recv function's gradients to the worker that sent its tensors."""
    context_id, msg_id, sender = dg_info
    state: PassState | None = getattr(_tls, "state", None)
    if state is None or state.ctx.id != context_id:
        raise RuntimeError(f"recv function of context {context_id} ran outside a distributed "
                           "backward pass (use distgrad.autograd.backward)")
    fut = rpc_api.rpc_async(sender, _propagate,
                            args=(context_id, state.pass_id, msg_id, list(grads)), timeout=0)
    _tls.collector.append(fut)


def _run(state: PassState, key: Any, outputs: list, grads: list) -> torch.futures.Future:
    """Run an entry on this thread; the future covers the gradients it shipped."""
    prev = getattr(_tls, "state", None), getattr(_tls, "collector", None)
    _tls.state, _tls.collector = state, []
    try:
        state.run_entry(key, outputs, grads)
        return _all(_tls.collector)
    except BaseException as e:  # noqa: BLE001
        return _failed(e)
    finally:
        _tls.state, _tls.collector = prev


@async_execution
def _propagate(context_id: int, pass_id: tuple, msg_id: int, grads: list) -> torch.futures.Future:
    with ENGINE.lock:
        state = ENGINE.passes.get((context_id, pass_id))
    if state is None:
        raise RuntimeError(f"no backward pass {pass_id} of context {context_id} on this worker "
                           "(aborted or never discovered)")
    node = state.ctx.send_functions[msg_id]
    outputs = [GradientEdge(node, i) for i in range(len(grads))]
    return _run(state, msg_id, outputs, grads)


def _end_pass(context_id: int, pass_id: tuple) -> None:
    ENGINE.drop(context_id, pass_id)


# -- the public entry ---------------------------------------------------------------
def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                   grad_tensors: Sequence[torch.Tensor] | None = None) -> torch.futures.Future:
    """Start a distributed backward pass; returns a Future done when every worker is done."""
    if isinstance(roots, torch.Tensor) or not isinstance(roots, (list, tuple)):
        raise TypeError("backward(): incompatible function arguments. roots must be a list of "
                        f"tensors, got {type(roots).__name__}")
    ctx = CONTAINER.retrieve(context_id)
    roots, grads = _check_roots(roots, grad_tensors)
    state = ENGINE.new_pass(ctx, retain_graph)
    for r in roots:
        state.deps[r.grad_fn] += 1
    try:
        recvs = state.walk("root", [r.grad_fn for r in roots])
        disc = _discover_remote(state, recvs) if recvs else _done(set())
    except BaseException as e:  # noqa: BLE001
        ENGINE.drop(ctx.id, state.pass_id)
        return _failed(e)
    result = torch.futures.Future()

    def finish(f: torch.futures.Future) -> None:
        ENGINE.drop(ctx.id, state.pass_id)
        for w in state.participants:
            if w != CONTAINER.worker_id:
                _fire_and_forget(w, _end_pass, (ctx.id, state.pass_id))
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001
            result.set_exception(e)
            return
        result.set_result(None)

    def after_discovery(f: torch.futures.Future) -> None:
        try:
            state.participants = f.wait()
        except BaseException as e:  # noqa: BLE001
            finish(_failed(e))
            return
        _run(state, "root", list(roots), grads).add_done_callback(finish)

    disc.add_done_callback(after_discovery)
    return result


def _fire_and_forget(to: int, fn, args: tuple) -> None:
    agent = agent_or_none()
    if agent is None or to in agent.lost:
        return
    try:
        fut = rpc_api.rpc_async(to, fn, args=args, timeout=0)
    except Exception:
        return
    fut.add_done_callback(_swallow)


def _swallow(f: torch.futures.Future) -> None:
    try:
        f.wait()
    except Exception as e:  # the peer may be gone; nothing to do
        log.debug("fire-and-forget call failed: %s", e)


def _check_roots(roots: Any, grad_tensors: Any) -> tuple[list, list]:
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    if grad_tensors is not None:
        if isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        if len(grad_tensors) != len(roots):
            raise RuntimeError(f"grad_tensors has {len(grad_tensors)} tensors for {len(roots)} roots")
    grads = []
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"backward(): incompatible function arguments. root {i} is a "
                            f"{type(r).__name__}, not a tensor")
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        g = grad_tensors[i] if grad_tensors is not None else None
        if g is None:
            if r.numel() != 1:
                raise RuntimeError(f"Tensor of shape {tuple(r.shape)} is not a scalar, all roots "
                                   "need to be scalar (or pass grad_tensors)")
            g = torch.ones_like(r)
        elif g.shape != r.shape:
            raise RuntimeError(f"grad_tensors[{i}] has shape {tuple(g.shape)}, root has "
                               f"{tuple(r.shape)}")
        if r.grad_fn is None:
            raise RuntimeError(f"Tensor of shape {tuple(r.shape)} does not have a valid gradient "
                               "function.")
        grads.append(g)
    return list(roots), grads
