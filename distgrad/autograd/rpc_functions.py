"""The autograd Functions that record an RPC in the graph: ``SendRpc`` on the
sender, ``RecvRpc`` on the receiver, and the anchor every recv function hangs from.

``SendRpc``'s node has the sent tensors' gradient edges as its next edges
(torch's graph shape); the distributed engine starts local backward there
when gradients for the sent tensors come back. ``RecvRpc``'s node is the
``grad_fn`` of the received tensors; when the engine reaches it, it ships the
incoming gradients to the sender (:func:`.gradients.ship_gradients`).
"""
from __future__ import annotations

import torch

from .gradients import ship_gradients

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


def use_native_types(send_t: type, recv_t: type) -> None:
    """From now on this process records native send and recv nodes (:mod:`.native_pass`)."""
    global SEND_NODE_TYPE, RECV_NODE_TYPE
    SEND_NODE_TYPE, RECV_NODE_TYPE = send_t, recv_t


def _node_types() -> tuple[type, type]:
    global SEND_NODE_TYPE, RECV_NODE_TYPE
    if SEND_NODE_TYPE is None:
        a = torch.zeros(1, requires_grad=True)
        with torch.enable_grad():   # (may first be asked under no_grad())
            SEND_NODE_TYPE = type(SendRpc.apply(a)[0].grad_fn)
            RECV_NODE_TYPE = type(RecvRpc.apply(_ANCHOR, 0, 0, 0, [torch.zeros(1)])[0].grad_fn)
    return SEND_NODE_TYPE, RECV_NODE_TYPE
