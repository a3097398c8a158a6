"""One worker's share of a distributed backward pass: the walk and the executor.

A share (a :class:`PassState`, kept in the context) has *entries*: the roots
(initiator only) and every send function of the context, whose gradients
arrive over the network in any order. On first contact a worker walks its
local graph from all its entries, noting each entry's leaves and whether two
entries' regions share nodes.

* **Disjoint regions** (the common case): each entry runs as soon as its
  gradient arrives, as one native ``torch.autograd.grad`` call capturing the
  region's leaves (hooks run) and the recv anchor (so recv functions run and
  ship their gradients). Nothing ever waits, so an RPC whose result never
  reaches the loss costs nothing (torch's FAST mode hangs there).
* **Shared regions**: a node-by-node executor runs each node once, when all
  its counted inputs arrived. A shared node may then wait for a send function
  that will never receive a gradient (an unused RPC); :mod:`.engine` resolves
  that at quiescence (discovery, then :meth:`PassState.resume`).

How gradients travel between shares and how a pass ends is :mod:`.engine`'s.
"""
from __future__ import annotations

import collections
import gc
import itertools
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from . import anomaly, ddp, node_hooks
from . import checkpoint as _checkpoint  # noqa: F401  (reentrant checkpointing in a pass)
from .context import CONTAINER, DistAutogradContext
from .nodes import UNREACHED, accumulate, run_node, validate
from .recording import _ANCHOR, _node_types

_ACCUMULATE = None
_GRAD_LOCK = threading.Lock()   # one pass at a time runs its region through .grad
node_hooks.install()  # any `import distgrad...` gets here (distgrad/__init__ imports autograd)

# A pass's flags (they travel with its gradients): keep the graph; record the backward;
# check every node's outputs for NaN/Inf (detect_anomaly)
RETAIN, CREATE_GRAPH, ANOMALY = 1, 2, 4


def _grad(outputs: tuple, grads: tuple, inputs: tuple, retain_graph: bool,
          create_graph: bool = False) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)`` minus its per-input Python checks
    (we built every argument ourselves); falls back to the public call."""
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grads, retain_graph=retain_graph,
                                   create_graph=create_graph, allow_unused=True)
    return _engine_run_backward(outputs, grads, retain_graph, create_graph, inputs, True,
                                accumulate_grad=False)


try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # older torch
    _engine_run_backward = None


def _leaf_hooks(leaves: list, grads: Sequence, variables: Sequence | None = None) -> list:
    """(index, pre-hooks, post-hooks, post-accumulate-grad?) of each leaf with a
    gradient whose AccumulateGrad node has hooks (:func:`.node_hooks.leaf_hooks`);
    usually empty, and then found without a call per leaf: a leaf's node is made
    anew for every forward, so its hooks were registered through the wrapper
    (counted) unless they came before ``import distgrad``, on a node still alive;
    only tensors' post-accumulate-grad hooks are looked for on every leaf."""
    if not (node_hooks.registered[0] or node_hooks.post_acc_registered[0]):
        if variables is None:
            variables = [n.variable for n in leaves]
        if not any([v._post_accumulate_grad_hooks for v in variables]):
            return []
    out = []
    for i, node in enumerate(leaves):
        if grads[i] is not None:
            pre, post, post_acc = node_hooks.leaf_hooks(node)
            if pre or post or post_acc:
                out.append((i, pre, post, post_acc))
    return out


def _accumulate_type() -> type:
    global _ACCUMULATE
    if _ACCUMULATE is None:
        a = torch.zeros(1, requires_grad=True)
        _ACCUMULATE = type((a * 1).grad_fn.next_functions[0][0])
    return _ACCUMULATE


def _below(starts: Sequence[Any]) -> set:
    """The nodes reachable from ``starts``, without going past recv functions and
    leaves (they are included)."""
    _, recv_t = _node_types()
    acc_t = _accumulate_type()
    nodes, stack = set(starts), list(starts)
    while stack:
        n = stack.pop()
        if type(n) is recv_t or type(n) is acc_t:
            continue
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in nodes:
                nodes.add(nxt)
                stack.append(nxt)
    return nodes


class _Region:
    __slots__ = ("leaves", "recvs")

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.recvs: list = []  # recv functions met (the walk stops there)


class PassState:
    """One worker's share of one backward pass."""

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, initiator: int,
                 flags: int, roots: Sequence[torch.Tensor] = ()) -> None:
        self.ctx, self.pass_id, self.initiator = ctx, pass_id, initiator
        self.flags = flags
        self.retain_graph = bool(flags & (RETAIN | CREATE_GRAPH))
        self.create_graph = bool(flags & CREATE_GRAPH)
        self.anomaly = bool(flags & ANOMALY)
        self.aborted = False            # the pass failed elsewhere: run nothing more
        self.roots = list(roots)
        self.user_grads = False         # the roots' gradients are the caller's grad_tensors
        self.lock = threading.RLock()
        self.nodes: set = set()         # every node some entry reaches
        self.deps: collections.Counter = collections.Counter()
        self.regions: dict[Any, _Region] = {}
        # recv message id -> its input slots some walked node feeds (the others are
        # unreached: the sender must not run what lies behind them)
        self.recv_slots: dict[int, set] = {}
        self.shared = False
        self.buffers: dict[Any, list] = {}
        self.waiting: set = set()       # nodes holding some but not all inputs
        self.received: collections.Counter = collections.Counter()  # inputs arrived per node
        self.done: set = set()          # nodes the executor ran
        self.reach: set | None = None   # discovery's reachable nodes (fallback only)
        self.discovered: set[int] = set()
        self.nodes_run = 0
        self.running = 0
        self.ddp_held: dict = {}        # AccumulateGrad node of a DDP parameter -> gradient
        # initiator only: termination (see "execution and termination" below)
        self.weight = Fraction(0)       # returned in this round
        self.round_blocked: set = set()  # workers that reported waiting nodes in it
        self.ddp_holders: set = set()   # workers that reported holding DDP gradients
        self.participants: set = {CONTAINER.worker_id}
        self.finished = False
        self.on_round: Callable[[BaseException | None, set], None] | None = None
        self.inline: Any = None         # initiator: a queue its own thread runs work from
        self._prepare()

    # -- the walk ---------------------------------------------------------------
    def _prepare(self) -> None:
        # The walk makes a few Python objects a node (torch's node objects, edge tuples),
        # all alive until it ends: a collection in the middle only scans them again and
        # again (at 150 nodes it doubled the walk). The collector waits till it is done.
        collect = gc.isenabled()
        if collect:
            gc.disable()
        try:
            self._walk_all()
        finally:
            if collect:
                gc.enable()

    def _walk_all(self) -> None:
        with self.ctx.lock:
            sends = dict(self.ctx.send_functions)
        seen = 0
        if self.roots:
            _, recv_t = _node_types()
            for r in self.roots:
                if type(r.grad_fn) is recv_t:
                    self._recv_slot(r.grad_fn, r.output_nr)
            seen += self._walk("root", [r.grad_fn for r in self.roots])
        for msg_id, node in sends.items():
            seen += self._walk(msg_id, [node])
        # some node was reached from two entries; or anomaly mode, where the executor
        # runs every node so that it can check each one's outputs
        self.shared = seen > len(self.nodes) or self.anomaly
        if self.shared:  # the executor needs every node's count of inputs
            self.count_inputs([r.grad_fn for r in self.roots] + list(sends.values()), self.nodes)
        else:  # nothing needs them again: their Python objects go before a collection sees them
            self.nodes = set()

    def count_inputs(self, entries: Sequence[Any], nodes: set) -> None:
        """The executor's dependency counts: one per entry (a root's node, a send
        function: its gradient comes over the network) and per edge between ``nodes``."""
        _, recv_t = _node_types()
        acc_t = _accumulate_type()
        deps = self.deps
        for node in entries:
            deps[node] += 1
        for n in nodes:
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
                region.recvs.append(n)
                continue
            for nxt, slot in n.next_functions:
                if nxt is not None:
                    if type(nxt) is recv_t:
                        self._recv_slot(nxt, slot)
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
        self.nodes |= seen
        return len(seen)

    def _recv_slot(self, recv: Any, slot: int) -> None:
        slots = self.recv_slots.get(recv.dg_info[1])
        if slots is None:
            slots = self.recv_slots[recv.dg_info[1]] = set()
        slots.add(slot)

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

    def alone(self) -> bool:
        """Whether this pass (its initiator's share) is local: no RPC in the context,
        no recv function in the roots' region, nothing shared, no DDP, no graph
        recorded, no anomaly check."""
        region = self.regions.get("root")
        return (not self.shared and not self.create_graph and not ddp.active[0]
                and not self.ctx.send_functions and region is not None and not region.recvs)

    def blocked(self) -> bool:
        return bool(self.waiting)

    # -- execution ----------------------------------------------------------------
    def run_entry(self, key: Any, outputs: list, grads: list) -> None:
        """Run ``key``'s region with gradients for ``outputs`` (tensors or edges)."""
        if self.aborted:
            return
        if self.shared:
            with self.lock:
                self._feed(outputs, grads)
            return
        region = self.regions.get(key) if key != "root" else self.regions.pop(key, None)
        if region is None:
            return
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(g, torch.Tensor)]
        if key != "root" and any(g is None for g in grads) and (
                not pairs or any(g is UNREACHED for g in grads)):
            # A slot reached without a gradient: the engine can start at a send function
            # (then slots without a gradient get none, but what lies behind every slot
            # runs, unreached ones too) or past it (then only behind slots with one).
            # Neither is exact here; the executor is.
            self._run_by_hand(outputs, grads)
            return
        if pairs and key != "root" and any(g is UNREACHED for g in grads):
            # Some slots of a send function were not reached: start past the send
            # function, at the edges that got a gradient. Started at the send function,
            # the engine would run what lies behind every slot, unreached ones included.
            node = outputs[0].node
            fit = validate(node, [g if isinstance(g, torch.Tensor) else None for g in grads])
            pairs = [(GradientEdge(*node.next_functions[i]), fit[i])
                     for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            fed = self._fed_slots([o for o, _ in pairs])  # the walk's slots are too many now
        else:
            fed = None
        if pairs and (region.leaves or region.recvs):
            # the leaf tensors, not GradientEdges: the same edges to the engine, ~8x cheaper
            variables = [n.variable for n in region.leaves]
            outs, given = tuple(o for o, _ in pairs), tuple(g for _, g in pairs)
            from .engine import fed_slots  # (engine imports this module)
            with fed_slots(fed):
                res = self._through_grad(variables, outs, given, region)
                if res is not None:  # the leaves' nodes ran, hooks and all
                    self.ctx.accumulate_fresh(region.leaves, res, given, owned=key != "root",
                                              lazy=key != "root" or not self.user_grads)
                    res = None
                else:
                    inputs = variables + [_ANCHOR] if region.recvs else variables
                    res = _grad(outs, given, tuple(inputs), self.retain_graph, self.create_graph)
            if res is not None:
                # gradients that came over the network belong to this pass: no defensive copy
                self.take_leaves(region.leaves, res, given, owned=key != "root",
                                 variables=variables)
        if len(pairs) < len(outputs) and region.recvs:
            # torch's engine runs a node even when all its gradients are absent, so a
            # recv function behind an absent gradient still sends (absent gradients):
            # the sender may be counting on that message
            from .engine import ship_absent  # (engine imports this module)
            ship_absent(region.recvs)

    def _through_grad(self, variables: list, outs: tuple, given: tuple,
                      region: _Region) -> list | None:
        """A native region as the plain ``backward()`` torch's users time: every
        AccumulateGrad node runs and writes ``.grad``, which is read and put back
        at once. An engine call that captures its inputs instead (``inputs=``)
        costs torch 7 % more at 150 nodes and 28 % more at 9,000. The gradients
        are the ones torch's context would store (its AccumulateGrad rule is the
        one the context applies); the leaves' nodes run their own hooks.

        Only where nothing can tell: no graph recorded, no DDP (its hooks are on
        those nodes), no post-accumulate-grad hook (it would see this pass's
        gradient, not the context's sum), and one such call at a time in this
        process (others capture; they never touch ``.grad``). Returns None where
        it does not apply."""
        if (self.create_graph or ddp.active[0] or _engine_run_backward is None
                or node_hooks.post_acc_registered[0]
                or any([v._post_accumulate_grad_hooks for v in variables])
                or not _GRAD_LOCK.acquire(blocking=False)):
            return None
        try:
            saved = [v.grad for v in variables]
            kept = [(v, g) for v, g in zip(variables, saved) if g is not None]
            for v, _ in kept:
                v.grad = None
            res = None
            try:
                _engine_run_backward(outs, given, self.retain_graph, False, (), True,
                                     accumulate_grad=True)
                res = [v.grad for v in variables]
            finally:
                for v, g in zip(variables, res if res is not None else variables):
                    if g is not None:
                        v.grad = None
                for v, g in kept:
                    v.grad = g
                if region.recvs:
                    _ANCHOR.grad = None
            return res
        finally:
            _GRAD_LOCK.release()

    def take_leaves(self, leaves: list, res: Sequence, given: Sequence, owned: bool,
                    variables: Sequence | None = None, lazy: bool = True) -> None:
        """An engine call's gradients ``res`` for ``leaves`` (AccumulateGrad nodes) into the
        context, doing what their AccumulateGrad nodes would: DDP's held for the flush,
        the nodes' pre-hooks, accumulation, post-accumulate-grad hooks, post-hooks.
        ``given``: the gradients the call started from (:meth:`.DistAutogradContext.accumulate_fresh`);
        ``variables``: the leaves' tensors, where the caller has them; ``lazy``: the results
        and ``given`` are the pass's alone once the call returned (so the context may take
        them in later: :meth:`.DistAutogradContext.accumulate_fresh`)."""
        if ddp.active[0]:
            res = self._hold_ddp(leaves, res)
        hooked = _leaf_hooks(leaves, res, variables)
        if hooked:
            res = list(res)
            for i, pre, _, _ in hooked:
                if pre:
                    res[i] = node_hooks.run_pre(pre, res[i])
        if self.create_graph:
            self.ctx.accumulate_graph(leaves, res)
        else:
            # not lazily when the caller's grad_tensors are among ``given``
            self.ctx.accumulate_fresh(leaves, res, given, owned=owned,
                                      lazy=lazy and (owned or not self.user_grads))
        for i, _, post, post_acc in hooked:
            if post_acc:
                node_hooks.run_post_accumulate(leaves[i].variable, self.ctx.gradient_of(leaves[i]))
            node_hooks.run_post(post, res[i])

    def _fed_slots(self, starts: list) -> dict[int, set]:
        """Recv message id -> the slots fed by nodes reachable from edges ``starts``."""
        _, recv_t = _node_types()
        fed: dict[int, set] = {}
        edges = [(e.node, e.output_nr) for e in starts]
        for n in _below([e.node for e in starts]):
            if type(n) is not recv_t:
                edges.extend(n.next_functions)
        for nxt, slot in edges:
            if type(nxt) is recv_t:
                fed.setdefault(nxt.dg_info[1], set()).add(slot)
        return fed

    def _run_by_hand(self, outputs: list, grads: list) -> None:
        """Run a send function's (disjoint) region with the node-by-node executor."""
        start = outputs[0].node
        with self.lock:
            self.count_inputs([start], _below([start]))
            self._feed(outputs, grads)

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
        while ready and not self.aborted:
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
        if g is not UNREACHED:
            buf = self.buffers.get(node)
            if buf is None:
                buf = self.buffers[node] = [UNREACHED] * len(node._input_metadata)
            buf[slot] = accumulate(buf[slot], g)
        self._arrived(node, ready)

    def _execute(self, node: Any, ready: list) -> None:
        """Run ``node`` once, all its counted inputs in (absent ones stay ``None``,
        as in torch's engine), and route its outputs to the next nodes."""
        send_t, recv_t = _node_types()
        grads = self.buffers.pop(node, None) or [UNREACHED] * len(node._input_metadata)
        self.done.add(node)
        t = type(node)
        reached = [g is not UNREACHED for g in grads]
        if not any(reached):
            # no path from the roots reached it: local autograd would not run it
            if t is recv_t:
                from .engine import ship_gradients  # (engine imports this module)
                ship_gradients(node.dg_info, [None] * len(grads), reached)
            elif t is not _accumulate_type():
                for nxt, slot in node.next_functions:
                    if nxt is not None:
                        self._add(nxt, slot, UNREACHED, ready)
            return
        self.nodes_run += 1
        grads = [g if r else None for g, r in zip(grads, reached)]
        if t is _accumulate_type():
            self._accumulate_leaf(node, grads[0])
            return
        if t is send_t:  # distgrad's own node: no user hooks; an identity per slot
            outs = [g if r else UNREACHED for g, r in zip(validate(node, grads), reached)]
            for (nxt, slot), g in zip(node.next_functions, outs):
                if nxt is not None:
                    self._add(nxt, slot, g, ready)
            return
        # what torch's engine does around a node (call_function): its tensors' hooks,
        # its pre-hooks, the node, its post-hooks
        noted = node_hooks.tensor_pre_hooks(node)
        if noted:
            grads = node_hooks.run_tensor_pre_hooks(noted, grads)
        pre, post = node_hooks.hooks_of(node, always=True)
        if pre:
            grads = node_hooks.run_node_pre(pre, grads)
        if t is recv_t:
            from .engine import ship_gradients  # (engine imports this module)
            ship_gradients(node.dg_info, grads, reached)
            if post:
                node_hooks.run_node_post(post, [None] * len(node.next_functions), grads)
            return
        try:
            outs = run_node(node, grads, self.create_graph, self.retain_graph)
            if post:
                outs = node_hooks.run_node_post(post, outs, grads)
        except Exception as e:  # noqa: BLE001 - name the node, as torch's engine does
            from .engine import backward_error
            raise backward_error(e, node) from e
        if self.anomaly:
            from .engine import _agent
            anomaly.check(node, outs, CONTAINER.worker_id, _agent().name)
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is not None:
                self._add(nxt, slot, g, ready)


    def _accumulate_leaf(self, node: Any, g: Any) -> None:
        """What AccumulateGrad does, into the context: the leaf's tensor hooks, the
        node's pre-hooks, accumulation, post-accumulate-grad hooks, post-hooks."""
        if g is None:
            return
        variable = node.variable
        for hook in list((getattr(variable, "_backward_hooks", None) or {}).values()):
            out = hook(g)
            if out is not None:
                g = out
        if ddp.active[0] and self._hold_ddp([node], [g])[0] is None:
            return  # its node's hooks run at the flush, natively
        pre, post, post_acc = node_hooks.leaf_hooks(node)
        if pre:
            g = node_hooks.run_pre(pre, g)
        if self.create_graph:
            self.ctx.accumulate_graph([node], [g])
        else:
            self.ctx.accumulate(node, g)
        if post_acc:
            node_hooks.run_post_accumulate(variable, self.ctx.gradient_of(node))
        node_hooks.run_post(post, g)


    # -- DDP: gradients held until the pass is quiet, then flushed together -----------
    def _hold_ddp(self, leaves: list, grads: Sequence) -> Sequence:
        """``grads`` without those of DDP's parameters, which are kept for the flush."""
        idx = ddp.held(leaves, grads)
        if not idx:
            return grads
        grads = list(grads)
        with self.lock:
            for i in idx:
                old = self.ddp_held.get(leaves[i])
                self.ddp_held[leaves[i]] = grads[i] if old is None else old + grads[i]
                grads[i] = None
        return grads

    def holds_ddp(self) -> bool:
        return bool(self.ddp_held)

    def flush_ddp(self) -> None:
        """The pass is quiet everywhere: DDP's parameters' gradients through their
        AccumulateGrad nodes in one engine call (:func:`.ddp.synced`), into the context."""
        with self.lock:
            held, self.ddp_held = self.ddp_held, {}
        if not held or self.aborted:
            return
        leaves = list(held)
        res = ddp.synced(leaves, [held[n] for n in leaves])
        if self.create_graph:
            self.ctx.accumulate_graph(leaves, res)
        else:
            for node, g in zip(leaves, res):
                if g is not None:  # copied: with gradient_as_bucket_view it is DDP's bucket
                    self.ctx.accumulate(node, g)


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

    def new_pass(self, ctx: DistAutogradContext, flags: int, roots: list) -> PassState:
        pass_id = (CONTAINER.worker_id, next(self._ids))
        state = self._register(PassState(ctx, pass_id, CONTAINER.worker_id, flags, roots))
        self.initiated[pass_id] = state
        return state

    def get_or_create(self, context_id: int, pass_id: tuple, initiator: int,
                      flags: int) -> PassState:
        ctx = CONTAINER.retrieve(context_id)
        with ctx.lock:
            state = ctx.passes.get(pass_id)
            if state is None:
                state = PassState(ctx, pass_id, initiator, flags)
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
