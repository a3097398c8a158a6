"""The node-by-node executor, for shared regions (two entries reach one node) and
anomaly mode: each node runs once, when all its counted inputs arrived, as torch's
engine runs it (absent gradients stay absent; its tensors' hooks, its pre-hooks,
the node, its post-hooks), and routes its outputs on. A node may then wait for a
send function that will never get a gradient (an unused RPC): the engine resolves
that at quiescence (discovery, then :meth:`Executor.resume`).

:class:`Executor` is the part of a pass's share (:class:`.share.PassState`) that
does this; the share's other parts (its walk, its native runs, DDP's hold) are
the share's own.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from torch.autograd.graph import GradientEdge

from . import anomaly, ddp, node_hooks
from .context import CONTAINER
from .gradients import _agent, backward_error, ship_gradients
from .nodes import UNREACHED, accumulate, run_in_engine, run_node, validate
from .rpc_functions import _node_types
from .walk import accumulate_type, below


class Executor:
    """The executor's state and steps, for a share that needs them."""

    def init_executor(self) -> None:
        self.deps: collections.Counter = collections.Counter()
        self.buffers: dict[Any, list] = {}
        self.waiting: set = set()       # nodes holding some but not all inputs
        self.received: collections.Counter = collections.Counter()  # inputs arrived per node
        self.done: set = set()          # nodes the executor ran
        self.nodes_run = 0

    def blocked(self) -> bool:
        return bool(self.waiting)

    def count_inputs(self, entries: Sequence[Any], nodes: set) -> None:
        """The executor's dependency counts: one per entry (a root's node, a send
        function: its gradient comes over the network) and per edge between ``nodes``."""
        _, recv_t = _node_types()
        acc_t = accumulate_type()
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

    def _run_by_hand(self, outputs: list, grads: list) -> None:
        """Run a send function's (disjoint) region with the node-by-node executor."""
        start = outputs[0].node
        with self.lock:
            self.count_inputs([start], below([start]))
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
                ship_gradients(node.dg_info, [None] * len(grads), reached)
            elif t is not accumulate_type():
                for nxt, slot in node.next_functions:
                    if nxt is not None:
                        self._add(nxt, slot, UNREACHED, ready)
            return
        self.nodes_run += 1
        grads = [g if r else None for g, r in zip(grads, reached)]
        if t is accumulate_type():
            self._accumulate_leaf(node, grads[0])
            return
        if t is send_t:  # distgrad's own node: no user hooks; an identity per slot
            outs = [g if r else UNREACHED for g, r in zip(validate(node, grads), reached)]
            for (nxt, slot), g in zip(node.next_functions, outs):
                if nxt is not None:
                    self._add(nxt, slot, g, ready)
            return
        try:
            if t is not recv_t and hasattr(node, "_forward_cls"):
                # a Python Function: torch's engine runs it, hooks and all (nodes.run_in_engine)
                outs = run_in_engine(node, grads, self.retain_graph, self.create_graph)
            else:
                outs = self._by_hand(node, t is recv_t, grads, reached)
                if outs is None:
                    return
        except Exception as e:  # noqa: BLE001 - name the node, as torch's engine does
            raise backward_error(e, node) from e
        if self.anomaly:
            anomaly.check(node, outs, CONTAINER.worker_id, _agent().name)
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is not None:
                self._add(nxt, slot, g, ready)

    def _by_hand(self, node: Any, recv: bool, grads: list, reached: list) -> list | None:
        """What torch's engine does around a C++ node (``call_function``): its tensors'
        hooks (run by the engine: :func:`.node_hooks.run_tensor_hooks`), its pre-hooks,
        the node, its post-hooks. A recv function ships its gradients instead (None)."""
        grads = node_hooks.run_tensor_hooks(node, grads, self.create_graph)
        pre, post = node_hooks.hooks_of(node)
        if pre:
            grads = node_hooks.run_node_pre(pre, grads)
        if recv:
            ship_gradients(node.dg_info, grads, reached)
            if post:
                node_hooks.run_node_post(post, [None] * len(node.next_functions), grads)
            return None
        outs = run_node(node, grads, self.create_graph)
        return node_hooks.run_node_post(post, outs, grads) if post else outs

    def _accumulate_leaf(self, node: Any, g: Any) -> None:
        """What AccumulateGrad does, into the context: the leaf's tensor hooks, the
        node's pre-hooks, accumulation, post-hooks (no post-accumulate-grad hooks, as
        torch's distributed engine)."""
        if g is None:
            return
        variable = node.variable
        for hook in list((getattr(variable, "_backward_hooks", None) or {}).values()):
            out = hook(g)
            if out is not None:
                g = out
        if ddp.active[0] and self._hold_ddp([node], [g])[0] is None:
            return  # its node's hooks run at the flush, natively
        pre, post = node_hooks.leaf_hooks(node)
        if pre:
            g = node_hooks.run_pre(pre, g)
        if self.create_graph:
            self.ctx.accumulate_graph([node], [g])
        else:
            self.ctx.accumulate(node, g)
        node_hooks.run_post(post, g)
