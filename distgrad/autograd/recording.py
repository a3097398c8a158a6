"""Recording RPCs in the autograd graph, as the agent extension: a send function
on the sender, a recv function on the receiver (:mod:`.rpc_functions`), paired by
one globally unique autograd message id; requests run inside the caller's
context; contexts released everywhere they reached; the engine's control
messages and a lost peer's passes and contexts.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ContextReleasedError
from ..ids import agent_range
from ..rpc.agent import agent_or_none
from ..rpc.extensions import AgentExtension, register_extension
from . import anomaly as anomaly_mode
from . import ddp, native_pass
from .context import CONTAINER, DistAutogradContext
from .engine import debug_info, fail_passes, on_abort, on_pass_end, on_report
from .rpc_functions import _ANCHOR, RecvRpc, SendRpc, _node_types

_Parameter = torch.nn.Parameter


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
        CONTAINER.init(agent.rank, *agent_range(agent))  # its incarnation's ids (distgrad/ids.py)
        native_pass.module()   # the native engine where it can be had (built once, cached)
        _node_types()
        agent.control_handlers["ag_release"] = _release_remote
        agent.control_handlers["ag_report"] = on_report
        agent.control_handlers["ag_abort"] = on_abort
        agent.control_handlers["ag_pass_end"] = on_pass_end
        ddp.attach()

    def current(self) -> Any:
        return CONTAINER.current()

    def outgoing(self, dest: int, tensors: list, ctx: DistAutogradContext, only_grad: bool = False) -> Any:
        if not only_grad:  # a call under a context makes its receiver known (torch's rule)
            with ctx.lock:
                ctx.known_workers.add(dest)
        # an nn.Parameter travels as a new leaf (torch pickles its .data and rebuilds a
        # Parameter): no gradient flows back through it, in torch as here
        rg = [t for t in tensors if t.requires_grad and type(t) is not _Parameter]
        if ctx.released:
            if rg and torch.is_grad_enabled():   # torch: the context's data is gone
                raise ContextReleasedError(
                    "Couldn't find autograd context data for current autograd context id "
                    f"{ctx.id}: it was released while this call ran", self.agent.name)
            return None
        if not rg or not torch.is_grad_enabled():
            if only_grad:  # torch sends no autograd information with it
                return None
            msg_id = None
        else:
            msg_id = CONTAINER.new_message_id()
            native = native_pass.M
            if native is not None:
                # a C++ node recorded without the GIL (torch's addSendRpcBackward)
                node = native.record_send(rg)
                with ctx.lock:
                    ctx.send_functions[msg_id] = node
                    ctx.known_workers.add(dest)
            else:
                outs = SendRpc.apply(*rg)
                with ctx.lock:
                    ctx.send_functions[msg_id] = outs[0].grad_fn
                    ctx.send_outputs[msg_id] = outs
                    ctx.known_workers.add(dest)  # (with only_grad: only with a send function)
        return (ctx.id, msg_id, True) if anomaly_mode.enabled() else (ctx.id, msg_id)

    def outgoing_if_grad(self, dest: int, tensors: list, ctx: DistAutogradContext) -> Any:
        return self.outgoing(dest, tensors, ctx, only_grad=True)

    def incoming(self, sender: int, meta: Any, reply: bool = False):
        context_id, msg_id = meta[0], meta[1]
        ctx = CONTAINER.get_or_create(context_id)
        with ctx.lock:  # torch learns of known workers only by sending to them
            ctx.heard_from.add(sender)
        if msg_id is None:
            return None

        def attach(tensors: list) -> list:
            idx = [i for i, t in enumerate(tensors)
                   if t.requires_grad and type(t) is not _Parameter]  # (see outgoing)
            if not idx:
                return tensors
            plain = [tensors[i].detach() for i in idx]
            native = native_pass.M
            if native is not None:
                # torch's addRecvRpcBackward: the node becomes the received tensors' grad_fn
                node = native.record_recv(context_id, msg_id, sender, plain)
                outs = plain
            else:
                with torch.enable_grad():
                    outs = RecvRpc.apply(_ANCHOR, context_id, msg_id, sender, plain)
                node = outs[0].grad_fn
            with ctx.lock:
                ctx.recv_functions[msg_id] = node
                if reply:
                    ctx.recv_of_reply.add(msg_id)
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
        fail_passes(peer, self.agent._lost_error)
        with CONTAINER.lock:
            involved = [c for c in CONTAINER.contexts.values()
                        if peer in c.known_workers or peer in c.heard_from]
        for ctx in involved:
            if (ctx.id >> 48) != CONTAINER.worker_id:
                CONTAINER.release(ctx.id, stop=True)
            else:
                ctx.lost_peers[peer] = self.agent._lost_error(peer)

    def debug_info(self) -> dict[str, int]:
        return debug_info()

    def on_shutdown(self) -> None:
        # torch's container outlives the agent: a context this worker opened stays
        # until its block ends (get_gradients works after shutdown); contexts of
        # other workers' passes go, since no release can reach them any more
        CONTAINER.clear(keep_own=True)
        for st in list(native_pass.PASSES.values()):
            if st.initiator != CONTAINER.worker_id:
                st.abort()   # no initiator can end them any more
        ddp.detach()


def spread_release(ctx: DistAutogradContext, exclude: int | None) -> None:
    """Tell every worker this context reached to release it (one-way control
    messages; each receiver passes it on to the workers it reached). As torch's,
    nobody waits for them; each goes with the next message to its worker (a training
    loop's next call), at the latest at the transport's next tick (a quarter second
    by default): the context's exit sends nothing itself."""
    agent = agent_or_none()
    if agent is None:
        return
    for w in ctx._known_worker_ids():
        if w != exclude and w != agent.rank:
            agent.send_control(w, "ag_release", ctx.id, soon=True)


def _release_remote(sender: int, context_id: int) -> None:
    """Control handler (reading thread): release a context another worker left."""
    ctx = CONTAINER.release(context_id)
    if ctx is not None:
        spread_release(ctx, exclude=sender)


register_extension(AutogradExtension)
