"""One worker's share of a distributed backward pass (:class:`PassState`).

A share (kept in the context) has *entries*: the roots (initiator only) and
every send function of the context, whose gradients arrive over the network in
any order. On first contact a worker walks its local graph from all its entries
(:mod:`.walk`), noting each entry's leaves and whether two entries' regions share
nodes.

* **Disjoint regions** (the common case): each entry runs as soon as its
  gradient arrives, as one native engine call that captures the region's
  leaves' gradients (``inputs=``), as torch's distributed engine captures
  them: ``.grad`` is never read or written, so a plain ``backward()`` on
  another thread, a hook reading ``.grad`` or ``clip_grad_norm_`` meanwhile
  see exactly what they would without distgrad; the recv functions run and
  ship their gradients. Nothing ever waits, so an RPC whose result never reaches the loss
  costs nothing (torch's FAST mode hangs there).
* **Shared regions**: the node-by-node executor (:mod:`.executor`) runs each
  node once, when all its counted inputs arrived. A shared node may then wait
  for a send function that will never receive a gradient (an unused RPC);
  :mod:`.engine` resolves that at quiescence (discovery, then
  :meth:`PassState.resume`).

How gradients travel between shares is :mod:`.gradients`' (sending) and
:mod:`.engine`'s (receiving); how a pass ends is :mod:`.engine`'s.
"""
from __future__ import annotations

import collections
import gc
import itertools
import sys
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .. import observe as _observe
from ..observe import local_ns
from . import ddp, native_pass, node_hooks
from .context import CONTAINER, DistAutogradContext
from .executor import Executor
from .gradients import fed_slots, ship_absent, ship_gradients
from .nodes import UNREACHED, grad_call, validate
from .rpc_functions import _ANCHOR, _node_types
from .walk import Region, fed_slots_below, recv_slot, walk_reach, walk_region

# A pass's flags (they travel with its gradients): keep the graph; record the backward;
# check every node's outputs for NaN/Inf (detect_anomaly)
RETAIN, CREATE_GRAPH, ANOMALY = 1, 2, 4


def _leaf_hooks(leaves: list, grads: Sequence, variables: Sequence | None = None) -> list:
    """(index, pre-hooks, post-hooks) of each leaf with a
    gradient whose AccumulateGrad node has hooks (:func:`.node_hooks.leaf_hooks`: a
    dictionary look-up a leaf, once its node was probed); usually empty."""
    if variables is None:
        variables = [n.variable for n in leaves]
    out = []
    for i, node in enumerate(leaves):
        if grads[i] is not None:
            pre, post = node_hooks.leaf_hooks(node, variables[i])
            if pre or post:
                out.append((i, pre, post))
    return out


class PassState(Executor):
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
        self.nodes: set = set()         # every node some entry reaches (shared passes)
        self.regions: dict[Any, Region] = {}
        # recv message id -> its input slots some walked node feeds (the others are
        # unreached: the sender must not run what lies behind them)
        self.recv_slots: dict[int, set] = {}
        self.shared = False
        self.init_executor()
        self.reach: set | None = None   # discovery's reachable nodes (fallback only)
        self.discovered: set[int] = set()
        self.running = 0
        self.ddp_held: dict = {}        # AccumulateGrad node of a DDP parameter -> gradient
        # initiator only: termination (see "execution and termination" in .engine),
        # under a lock of its own that no node, hook or user code ever holds: a report
        # read on a reading thread must never wait for a pass (the reading, and with it
        # the heartbeats, would stop while a slow hook runs under ``lock``)
        self.term_lock = threading.Lock()
        self.weight = Fraction(0)       # returned in this round
        self.round_blocked: set = set()  # workers that reported waiting nodes in it
        self.ddp_holders: set = set()   # workers that reported holding DDP gradients
        self.participants: set = {CONTAINER.worker_id}
        self.finished = False
        self.on_round: Callable[[BaseException | None, set], None] | None = None
        self.inline: Any = None         # initiator: a queue its own thread runs work from
        self._prepare()
        # reentrant checkpoints' nodes the walk met: theirs while a run is on (.checkpoint)
        self.checkpoints = list(dict.fromkeys(
            n for r in self.regions.values() for n in r.checkpoints))

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
                    recv_slot(self.recv_slots, r.grad_fn, r.output_nr)
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

    def _walk(self, key: Any, starts: Sequence[Any]) -> int:
        """Collect ``key``'s region; returns how many nodes it has."""
        seen = walk_region(starts, self.regions.setdefault(key, Region()), self.recv_slots)
        self.nodes |= seen
        return len(seen)

    def walk_reach(self, starts: Sequence[Any]) -> list:
        """Discovery: mark what ``starts`` reach; returns the recv functions met."""
        if self.reach is None:
            self.reach = set()
        return walk_reach(self.reach, starts)

    def alone(self) -> bool:
        """Whether this pass (its initiator's share) is local: no RPC in the context,
        no recv function in the roots' region, nothing shared, no DDP, no graph
        recorded, no anomaly check."""
        region = self.regions.get("root")
        return (not self.shared and not self.create_graph and not ddp.active[0]
                and not self.ctx.send_functions and region is not None and not region.recvs)

    def trace_key(self) -> str:
        """This pass's name in traces: its initiator's rank and number there (``"0.3"``)."""
        return f"{self.pass_id[0]}.{self.pass_id[1]}"

    # -- execution ----------------------------------------------------------------
    def run_entry(self, key: Any, outputs: list, grads: list) -> None:
        """Run ``key``'s region with gradients for ``outputs`` (tensors or edges)."""
        if self.aborted:
            return
        tr = _observe.ACTIVE
        if tr is None:
            self._run_entry(key, outputs, grads)
            return
        t0 = local_ns()
        try:
            self._run_entry(key, outputs, grads)
        finally:
            where = "roots" if key == "root" else f"send function {key}"
            how = "executor" if self.shared else "native"
            tr.span(f"backward region from {where} ({how})", "backward.region", t0,
                    {"pass": self.trace_key(), "entry": str(key), "mode": how})

    def _run_entry(self, key: Any, outputs: list, grads: list) -> None:
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
            fed = fed_slots_below([o for o, _ in pairs])  # the walk's slots are too many now
        else:
            fed = None
        if pairs and (region.leaves or region.recvs):
            # the leaf tensors, not GradientEdges: the same edges to the engine, ~8x cheaper
            variables = [n.variable for n in region.leaves]
            outs, given = tuple(o for o, _ in pairs), tuple(g for _, g in pairs)
            # distgrad's own references to the received gradients, counted before the
            # engine runs: one it hands back unchanged is held by nobody else unless a
            # hook kept it since (DistAutogradContext.accumulate_fresh)
            before = list(map(sys.getrefcount, given)) if key != "root" else None
            with fed_slots(fed):
                native_recvs = region.recvs and native_pass.is_native_node(region.recvs[0])
                if native_recvs:
                    # native recv functions have no anchor: the call captures what reaches
                    # their inputs, and they ship it from here
                    recv_edges = [GradientEdge(r, i) for r in region.recvs
                                  for i in range(len(r._input_metadata))]
                    inputs = variables + recv_edges
                else:
                    inputs = variables + [_ANCHOR] if region.recvs else variables
                res = grad_call(outs, given, tuple(inputs), self.retain_graph, self.create_graph)
                if native_recvs and res is not None:
                    got, res = res[len(variables):], res[:len(variables)]
                    k = 0
                    for r in region.recvs:
                        n = len(r._input_metadata)
                        ship_gradients(r.dg_info, list(got[k:k + n]))
                        k += n
            if res is not None:
                # gradients that came over the network belong to this pass: no defensive copy
                self.take_leaves(region.leaves, res, given, owned=key != "root",
                                 variables=variables, given_refs=before)
        if len(pairs) < len(outputs) and region.recvs:
            # torch's engine runs a node even when all its gradients are absent, so a
            # recv function behind an absent gradient still sends (absent gradients):
            # the sender may be counting on that message
            ship_absent(region.recvs)

    def take_leaves(self, leaves: list, res: Sequence, given: Sequence, owned: bool,
                    variables: Sequence | None = None, lazy: bool = True,
                    given_refs: list | None = None) -> None:
        """An engine call's gradients ``res`` for ``leaves`` (AccumulateGrad nodes) into the
        context, doing what their AccumulateGrad nodes would: DDP's held for the flush,
        the nodes' pre-hooks, accumulation, post-hooks (post-accumulate-grad hooks
        do not run: torch's distributed engine never runs AccumulateGrad).
        ``given``: the gradients the call started from (:meth:`.DistAutogradContext.accumulate_fresh`);
        ``variables``: the leaves' tensors, where the caller has them; ``lazy``: the results
        and ``given`` are the pass's alone once the call returned (so the context may take
        them in later: :meth:`.DistAutogradContext.accumulate_fresh`); ``given_refs``: the
        reference counts of ``given``, read just before the call."""
        if ddp.active[0]:
            res = self._hold_ddp(leaves, res)
        hooked = _leaf_hooks(leaves, res, variables)
        if hooked:
            res = list(res)
            for i, pre, _ in hooked:
                if pre:
                    res[i] = node_hooks.run_pre(pre, res[i])
        if self.create_graph:
            self.ctx.accumulate_graph(leaves, res)
        else:
            # not lazily when the caller's grad_tensors are among ``given``
            self.ctx.accumulate_fresh(leaves, res, given, owned=owned,
                                      lazy=lazy and (owned or not self.user_grads),
                                      given_refs=given_refs if not hooked else None)
        for i, _, post in hooked:
            node_hooks.run_post(post, res[i])

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
        if not self.create_graph and ddp.in_torch_context():
            # as torch's engine: the pass's gradient is added into what the context holds
            # before DDP's hook reads it, and DDP's result is what the context then holds
            # (gradient accumulation over passes; a pass under no_sync() then a synced one)
            before = [self.ctx.gradient_of(n) for n in leaves]
            feed = [held[n] if b is None else b + held[n] for n, b in zip(leaves, before)]
            for node, g in zip(leaves, ddp.synced(leaves, feed)):
                if g is not None:
                    self.ctx.replace(node, g)
            return
        res = ddp.synced(leaves, [held[n] for n in leaves])
        if self.create_graph:
            self.ctx.accumulate_graph(leaves, res)
        else:
            for node, g in zip(leaves, res):
                if g is not None:  # copied: with gradient_as_bucket_view it is DDP's bucket
                    self.ctx.accumulate(node, g)


def native_ok(flags: int) -> bool:
    """Whether this worker's share of a pass with ``flags`` runs on the native engine:
    the module is built, and the pass needs nothing only the Python engine does yet
    (``create_graph``, anomaly mode's per-node checks and reports, DDP's flush)."""
    return (native_pass.M is not None and not flags & (CREATE_GRAPH | ANOMALY)
            and ddp.native_ok())


class Engine:
    """Creates and finds passes (kept in their contexts) and counts them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ids = itertools.count()
        self.initiated: dict[tuple, PassState] = {}  # passes started here, until they end
        # how this worker's shares ran: native calls or the executor; executor node count
        self.stats: collections.Counter = collections.Counter()

    def _register(self, state: Any) -> Any:
        with self.lock:
            kind = ("passes_graph_task" if getattr(state, "native", False)
                    else "passes_shared" if state.shared else "passes_native")
            self.stats[kind] += 1
        with state.ctx.lock:
            state.ctx.passes[state.pass_id] = state
        return state

    def new_pass(self, ctx: DistAutogradContext, flags: int, roots: list,
                 grads: list | None = None) -> Any:
        """A pass started here: on the native engine where it can run there
        (``grads`` given: the roots' gradients), else on the Python engine."""
        pass_id = (CONTAINER.worker_id, next(self._ids))
        state = None
        if grads is not None and native_ok(flags):
            state = native_pass.NativePass.create(ctx, pass_id, CONTAINER.worker_id, flags, roots, grads)
        if state is None:
            state = PassState(ctx, pass_id, CONTAINER.worker_id, flags, roots)
        self._register(state)
        self.initiated[pass_id] = state
        return state

    def get_or_create(self, context_id: int, pass_id: tuple, initiator: int,
                      flags: int) -> Any:
        ctx = CONTAINER.retrieve(context_id)
        with ctx.lock:
            state = ctx.passes.get(pass_id)
            if state is None and pass_id in ctx.ended_passes:
                return native_pass.EndedShare(ctx, pass_id, initiator, flags)
            if state is None:
                if native_ok(flags):
                    state = native_pass.NativePass.create(ctx, pass_id, initiator, flags)
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
