"""Recording RPCs in the autograd graph: a send function on the sender, a recv
function on the receiver, paired by one globally unique autograd message id.

``SendRpc``'s node has the sent tensors' gradient edges as its next edges
(torch's graph shape); the distributed engine starts local backward there
when gradients for the sent tensors come back. ``RecvRpc``'s node is the
``grad_fn`` of the received tensors; when the engine reaches it, it ships the
incoming gradients to the sender.
"""
from __future__ import annotations

from typing import Any

import torch

from ..rpc.extensions import AgentExtension, register_extension
from . import anomaly as anomaly_mode
from .context import CONTAINER, DistAutogradContext

# One leaf that every recv function hangs from, so that received tensors
# require grad and native engine calls can capture "recv nodes ran" (see engine).
_ANCHOR = torch.zeros((), requires_grad=True)


def _send_forward(ctx, *tensors):
    ctx.set_materialize_grads(False)
    # Outputs are placeholders with the sent tensors' metadata (never read): one
    # element each, zero strides; a single op per tensor (this runs on every call).
    return tuple(torch.empty_strided(t.shape, (0,) * t.dim(), dtype=t.dtype) for t in tensors)


def _send_backward(ctx, *grads):
    return grads


def _recv_forward(ctx, anchor, context_id, message_id, sender, received):
    ctx.set_materialize_grads(False)
    ctx.dg_info = (context_id, message_id, sender)
    # The received tensors come in a list, not as inputs: an input returned (or a view
    # of one) would be a view made in a custom Function, which torch forbids to modify
    # in place. detach() gives a fresh alias (no copy, sparse too) that takes this node
    # as its grad_fn and, like torch's received tensors, can be changed in place.
    return tuple(t.detach() for t in received)


def _recv_backward(ctx, *grads):
    from .engine import ship_gradients
    ship_gradients(ctx.dg_info, grads)
    return None, None, None, None, None


def _function(name: str, forward, backward, doc: str) -> type:
    # The class name makes the node's name(): torch's C++ nodes are named
    # "torch::distributed::autograd::SendRpcBackward" / "...RecvRpcBackward", and
    # code (torch's own tests, graph printers, the profiler) matches on it.
    return type(f"torch::distributed::autograd::{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "__doc__": doc, "__module__": __name__})


SendRpc = _function("SendRpc", _send_forward, _send_backward,
                    "Autograd node for tensors sent in an RPC "
                    "(``grad_fn.name()``: ``torch::distributed::autograd::SendRpcBackward``).")
RecvRpc = _function("RecvRpc", _recv_forward, _recv_backward,
                    "Autograd node of tensors received in an RPC "
                    "(``grad_fn.name()``: ``torch::distributed::autograd::RecvRpcBackward``).")


SEND_NODE_TYPE = None
RECV_NODE_TYPE = None


def _node_types() -> tuple[type, type]:
    global SEND_NODE_TYPE, RECV_NODE_TYPE
    if SEND_NODE_TYPE is None:
        a = torch.zeros(1, requires_grad=True)
        SEND_NODE_TYPE = type(SendRpc.apply(a)[0].grad_fn)
        RECV_NODE_TYPE = type(RecvRpc.apply(_ANCHOR, 0, 0, 0, [torch.zeros(1)])[0].grad_fn)
    return SEND_NODE_TYPE, RECV_NODE_TYPE


class _Scope:
    """Runs a request's user function inside the caller's autograd context (and in
    anomaly mode when the caller was in ``detect_anomaly()``)."""

    __slots__ = ("ctx", "prev", "anomaly")

    def __init__(self, ctx: DistAutogradContext, anomaly: bool = False) -> None:
        self.ctx = ctx
        self.anomaly = anomaly_mode.scope() if anomaly else None

    def __enter__(self) -> DistAutogradContext:
        self.prev = CONTAINER.set_current(self.ctx)
        if self.anomaly is not None:
            self.anomaly.__enter__()
        return self.ctx

    def __exit__(self, *exc) -> bool:
        if self.anomaly is not None:
            self.anomaly.__exit__(*exc)
        CONTAINER.set_current(self.prev)
        return False


class AutogradExtension(AgentExtension):
    """Plugs recording into the RPC agent (see :class:`~distgrad.rpc.extensions.AgentExtension`)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        CONTAINER.init(agent.rank)
        _node_types()
        from . import _release_remote
        from .engine import on_abort, on_report
        agent.control_handlers["ag_release"] = _release_remote
        agent.control_handlers["ag_report"] = on_report
        agent.control_handlers["ag_abort"] = on_abort

    def current(self) -> Any:
        return CONTAINER.current()

    def outgoing(self, dest: int, tensors: list, ctx: DistAutogradContext) -> Any:
        with ctx.lock:
            ctx.known_workers.add(dest)
        if ctx.released:
            return None
        rg = [t for t in tensors if t.requires_grad]
        if not rg or not torch.is_grad_enabled():
            msg_id = None
        else:
            msg_id = CONTAINER.new_message_id()
            outs = SendRpc.apply(*rg)
            with ctx.lock:
                ctx.send_functions[msg_id] = outs[0].grad_fn
                ctx.send_outputs[msg_id] = outs
        return (ctx.id, msg_id, True) if anomaly_mode.enabled() else (ctx.id, msg_id)

    def incoming(self, sender: int, meta: Any):
        context_id, msg_id = meta[0], meta[1]
        ctx = CONTAINER.get_or_create(context_id)
        with ctx.lock:
            ctx.known_workers.add(sender)
        if msg_id is None:
            return None

        def attach(tensors: list) -> list:
            idx = [i for i, t in enumerate(tensors) if t.requires_grad]
            if not idx:
                return tensors
            plain = [tensors[i].detach() for i in idx]
            with torch.enable_grad():
                outs = RecvRpc.apply(_ANCHOR, context_id, msg_id, sender, plain)
            with ctx.lock:
                ctx.recv_functions[msg_id] = outs[0].grad_fn
            out = list(tensors)
            for i, t in zip(idx, outs):
                out[i] = t
            return out
        return attach

    def request_scope(self, meta: Any):
        return _Scope(CONTAINER.get_or_create(meta[0]), len(meta) > 2 and meta[2])

    def on_peer_lost(self, peer: int, reason: str) -> None:
        """Release every context that involved ``peer`` and was created elsewhere
        (its creator's user code may still be inside ``context()``; the
        creator's own copy goes when that block ends), so nothing lingers when a
        worker in the middle of a chain dies (pytorch issue 26379); and fail the
        backward passes started here that ``peer`` took part in."""
        from .engine import fail_passes
        fail_passes(peer, self.agent._lost_error)
        with CONTAINER.lock:
            doomed = [c for c in CONTAINER.contexts.values()
                      if peer in c.known_workers and (c.id >> 48) != CONTAINER.worker_id]
        for ctx in doomed:
            CONTAINER.release(ctx.id)

    def debug_info(self) -> dict[str, int]:
        from . import _get_debug_info
        return _get_debug_info()

    def on_shutdown(self) -> None:
        CONTAINER.clear()


register_extension(AutogradExtension)
