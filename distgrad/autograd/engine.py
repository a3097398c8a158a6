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
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ..rpc import api as rpc_api
from ..rpc.functions import async_execution
from ..rpc.remote_exc import pack_exception, unpack_exception
from .checks import check_roots as _check_roots
from .context import CONTAINER, DistAutogradContext
from .futures import all_of as _all
from .futures import done as _done
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
        # initiator only: termination (see "execution and termination" below)
        self.weight = Fraction(0)       # returned in this round
        self.round_blocked: set = set()  # workers that reported waiting nodes in it
        self.participants: set = {CONTAINER.worker_id}
        self.finished = False
        self.on_round: Callable[[BaseException | None, set], None] | None = None
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
        self.initiated: dict[tuple, PassState] = {}  # passes started here, until they end
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
        state = self._register(PassState(ctx, pass_id, CONTAINER.worker_id, retain_graph, roots))
        self.initiated[pass_id] = state
        return state

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
        self.initiated.pop(state.pass_id, None)
        with state.ctx.lock:
            state.ctx.passes.pop(state.pass_id, None)
        with self.lock:
            self.stats["executor_nodes_run"] += state.nodes_run

    def current_passes(self) -> int:
        """Passes with work running or waiting on this worker."""
        with CONTAINER.lock:
            contexts = list(CONTAINER.contexts.values())
        ids = {pid for pid, s in list(self.initiated.items()) if not s.finished}
        for ctx in contexts:
            with ctx.lock:
                ids.update(pid for pid, s in ctx.passes.items() if s.running or s.blocked())
        return len(ids)


ENGINE = Engine()


# -- execution and termination ----------------------------------------------------
# Termination by weight throwing: a backward round starts with weight 1 at the
# initiator. Every run of a share (the roots, a gradient arriving, a resume)
# holds a weight 2**-exp; each gradient it ships takes half of what it holds
# (so every weight is a power of two and travels as its exponent), and when the
# run ends it returns the rest straight to the initiator with whether this
# worker is left waiting. The round is over exactly when the initiator holds 1
# again: no gradient is in flight and no run is active anywhere. One message
# per worker run reaches the initiator directly, instead of a reply climbing
# back through every hop of the chain.
def _agent():
    from ..rpc.agent import current_agent
    return current_agent()


def ship_gradients(dg_info: tuple, grads: Sequence) -> None:
    """Send a recv function's gradients to the worker that sent its tensors."""
    context_id, msg_id, sender = dg_info
    state: PassState | None = getattr(_tls, "state", None)
    if state is None or state.ctx.id != context_id:
        raise RuntimeError(f"recv function of context {context_id} ran outside a distributed "
                           "backward pass (use distgrad.autograd.backward)")
    _tls.exp += 1
    _tls.targets.add(sender)
    _agent().notify(sender, _propagate, (context_id, state.pass_id, state.initiator,
                                         state.retain_graph, msg_id, list(grads), _tls.exp))


def _run(state: PassState, exp: int, fn, *args) -> None:
    """Run ``fn(*args)`` for ``state`` on this thread holding weight ``2**-exp``;
    then return what is left of it to the initiator."""
    prev = getattr(_tls, "state", None), getattr(_tls, "exp", 0), getattr(_tls, "targets", None)
    _tls.state, _tls.exp, _tls.targets = state, exp, set()
    state.running += 1
    err = None
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the initiator
        err = e
    finally:
        state.running -= 1
        exp, targets = _tls.exp, _tls.targets
        _tls.state, _tls.exp, _tls.targets = prev
    _report(state.ctx.id, state.pass_id, state.initiator, exp, state.blocked(), targets, err)


def _report(context_id: int, pass_id: tuple, initiator: int, exp: int, blocked: bool,
            targets: set, err: BaseException | None) -> None:
    me = CONTAINER.worker_id
    if initiator == me:
        _returned(pass_id, me, exp, blocked, targets, err)
        return
    agent = _agent()
    blob = pack_exception(err, agent.name, agent.rank) if err is not None else None
    agent.send_control(initiator, "ag_report", context_id, pass_id, exp, blocked, sorted(targets), blob)


def on_report(sender: int, context_id: int, pass_id: tuple, exp: int, blocked: bool,
              targets: list, blob: bytes | None) -> None:
    """Control message (I/O thread): a worker's run of one of our passes ended."""
    err = unpack_exception(blob) if blob is not None else None
    _returned(tuple(pass_id), sender, int(exp), bool(blocked), set(targets), err)


def _returned(pass_id: tuple, worker: int, exp: int, blocked: bool, targets: set,
              err: BaseException | None) -> None:
    """Initiator: weight ``2**-exp`` came back from ``worker``."""
    state = ENGINE.initiated.get(pass_id)
    if state is None:
        return  # finished (an error came first)
    with state.lock:
        if state.finished:
            return
        if err is None:
            state.participants |= targets
            lost = _agent().lost
            gone = next((w for w in state.participants if w in lost), None)
            if gone is not None:
                err = _agent()._lost_error(gone)
        if err is None:
            state.weight += Fraction(1, 1 << exp)
            if blocked:
                state.round_blocked.add(worker)
            if state.weight != 1:
                return
            waiting, state.round_blocked, state.weight = state.round_blocked, set(), Fraction(0)
        else:
            state.finished = True
    state.on_round(err, waiting if err is None else set())


def fail_passes(peer: int, err_for: Any) -> None:
    """``peer`` is lost: fail the passes started here that it took part in."""
    for state in list(ENGINE.initiated.values()):
        with state.lock:
            if state.finished or peer not in state.participants:
                continue
            state.finished = True
        state.on_round(err_for(peer), set())


def _propagate(context_id: int, pass_id: tuple, initiator: int, retain_graph: bool,
               msg_id: int, grads: list, exp: int) -> None:
    """One-way request: gradients for send function ``msg_id`` of this worker."""
    try:
        state = ENGINE.get_or_create(context_id, pass_id, initiator, retain_graph)
        node = state.ctx.send_functions[msg_id]
    except BaseException as e:  # noqa: BLE001
        _report(context_id, pass_id, initiator, exp, False, set(), e)
        return
    outputs = [GradientEdge(node, i) for i in range(len(grads))]
    _run(state, exp, state.run_entry, msg_id, outputs, grads)


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


def _resume(context_id: int, pass_id: tuple, exp: int) -> None:
    """One-way request: recount over what discovery reached and run what is complete."""
    try:
        state = ENGINE.get_or_create(context_id, pass_id, pass_id[0], True)
    except BaseException as e:  # noqa: BLE001
        _report(context_id, pass_id, pass_id[0], exp, False, set(), e)
        return
    _run(state, exp, state.resume)


def _resume_all(state: PassState, blocked: set) -> None:
    """A new round: each waiting worker resumes with a share of weight 1."""
    me, exp, mine = CONTAINER.worker_id, 0, None
    agent = _agent()
    for w in sorted(blocked):
        exp += 1
        if w == me:
            mine = exp
        elif not agent.notify(w, _resume, (state.ctx.id, state.pass_id, exp)):
            _returned(state.pass_id, me, 0, False, {w}, None)  # lost: fails the pass
            return
    if mine is not None:
        _run(state, mine, state.resume)
    _returned(state.pass_id, me, exp, False, set(), None)  # the rest of the round's weight


# -- the public entry ---------------------------------------------------------------
def start_backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool,
                   grad_tensors: Sequence[torch.Tensor] | None,
                   deliver: Callable[[BaseException | None], None]) -> None:
    """Start a distributed backward pass; ``deliver(error or None)`` is called once,
    on whichever thread sees the pass end (the I/O thread included)."""
    if isinstance(roots, torch.Tensor) or not isinstance(roots, (list, tuple)):
        raise TypeError("backward(): incompatible function arguments. roots must be a list of "
                        f"tensors, got {type(roots).__name__}")
    ctx = CONTAINER.retrieve(context_id)
    roots, grads = _check_roots(roots, grad_tensors)
    state = ENGINE.new_pass(ctx, retain_graph, roots)
    rounds = [0]

    def finish(exc: BaseException | None) -> None:
        ENGINE.finish(state)
        deliver(exc)

    def on_round(exc: BaseException | None, blocked: set) -> None:
        if exc is not None or not blocked:
            finish(exc)
            return
        rounds[0] += 1
        if rounds[0] > _MAX_RESUMES:
            with state.lock:
                state.finished = True
            finish(RuntimeError(f"distributed backward in context {ctx.id} did not settle: "
                                f"workers {sorted(blocked)} still wait for gradients"))
            return
        # Someone waits for a gradient that may never come: find what is reachable
        # (not on the I/O thread: it walks graphs and waits for replies).
        _agent().callbacks.submit(discover, blocked)

    def discover(blocked: set) -> None:
        if rounds[0] == 1:
            with ENGINE.lock:
                ENGINE.stats["passes_discovered"] += 1
            with state.lock:
                recvs = state.walk_reach([r.grad_fn for r in roots])
            disc = _discover_remote(state, recvs)
        else:
            disc = _done([])
        disc.add_done_callback(lambda f: after_discovery(f, blocked))

    def after_discovery(f: torch.futures.Future, blocked: set) -> None:
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001
            with state.lock:
                if state.finished:
                    return
                state.finished = True
            finish(e)
            return
        _resume_all(state, blocked)

    state.on_round = on_round
    _run(state, 0, state.run_entry, "root", list(roots), grads)


def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                   grad_tensors: Sequence[torch.Tensor] | None = None) -> torch.futures.Future:
    """Start a distributed backward pass; returns a Future done when every worker is done."""
    result = torch.futures.Future()
    agent = _agent()

    def complete(exc: BaseException | None) -> None:
        if exc is None:
            result.set_result(None)
        else:
            result.set_exception(exc)

    def deliver(exc: BaseException | None) -> None:
        # never run the caller's callbacks on the I/O thread
        if agent.transport.on_io_thread():
            agent.callbacks.submit(complete, exc)
        else:
            complete(exc)

    start_backward(context_id, roots, retain_graph, grad_tensors, deliver)
    return result


def backward_sync(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                  grad_tensors: Sequence[torch.Tensor] | None = None) -> None:
    """:func:`backward_async` + wait, woken straight from the thread that sees the end."""
    lock, box = threading.Lock(), []
    lock.acquire()

    def deliver(exc: BaseException | None) -> None:
        box.append(exc)
        lock.release()

    start_backward(context_id, roots, retain_graph, grad_tensors, deliver)
    lock.acquire()
    if box[0] is not None:
        raise box[0]
