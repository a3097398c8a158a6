"""The hot path of a message's frames on the agent (a mixin of
:class:`~.agent.RpcAgent`): a request or reply with no autograd context and no
RRef bookkeeping goes out in the fast layout (:mod:`distgrad.wire.fast_header`:
a fixed binary header, no meta pickle); anything else in the general one, with
the extensions' meta. The extensions that can put a thread in a context are
found once, when the agent is built (``_ctx_exts``), not asked per message.
Both layouts decode to the same message and the same objects.

Example::

    >>> agent._request_frames(dest, Kind.CALL, 7, (torch.add, (x, 1), {}), "torch.add",
    ...                       None, None)[0][:2]
    b'DF'
"""
from __future__ import annotations

from typing import Any

from ..wire import Kind, dumps, encode, encode_fast, loads
from ..wire.devices import parse_target, place
from ..wire.fast_header import encode_grads
from ..wire.messages import decode
from .devices import reply_route
from .extensions import NULL_SCOPE
from .remote_exc import unpack_exception
from .script import BUILTINS, builtin_table

# The receiver's gradient function (distributed autograd's ``engine._propagate``, set
# when it is imported): a NOTIFY of it goes out as a gradient message (Kind.GRADS)
# where its arguments fit that layout, and a gradient message received runs it.
GRADIENT_RECEIVER: list = [None]


class FastPath:
    """Frames of requests and replies, both ways; state lives on the agent."""

    def _request_frames(self, dest: Any, kind: Kind, rid: int, payload_obj: Any, what: str,
                        extra: Any, ctx: Any, reverse: bool = False) -> list:
        """Pickle a request (recording autograd functions in ``ctx``) into frames
        (``reverse``: its tensors go through the reverse map to ``dest``, as a reply's)."""
        pins: list = []
        if reverse:
            route = reply_route(self, dest.name)
        else:
            routes = self.request_routes  # device maps to ``dest`` (rpc/devices.py): where its tensors go
            route = routes.get(dest.name) if routes else None
        payload, tensors = dumps(payload_obj, dest=dest, pins=pins, route=route)
        if pins:  # RRefs going back to their owner: this request keeps their values alive
            extra = {**(extra or {}), "pins": pins}
        elif ctx is None and extra is None and self.fast and kind != Kind.REMOTE \
                and type(tensors) is list:  # (a DeviceTable's tensors move: the general layout)
            frames = encode_fast(kind, rid, what, payload, tensors)
            if frames is not None:
                return frames
        # torch records a Python function's call under a context always, a builtin
        # operator's only when a tensor requires grad (else the callee never hears of it)
        ag_meta = self._outgoing(dest.id, tensors, ctx, ctx is not None
                                 and (kind == Kind.CALL or kind == Kind.REMOTE)
                                 and (BUILTINS or builtin_table()).get(id(payload_obj[0])) is not None)
        return encode(kind, rid, (what, ag_meta, extra), payload, tensors)

    def _gradient_frames(self, dest: Any, rid: int, args: tuple, reverse: bool) -> list | None:
        """Frames of a NOTIFY of the gradient function in the gradient layout, or None
        where the general one must carry it (a device map that moves CPU tensors)."""
        if reverse:
            route = reply_route(self, dest.name)
        else:
            routes = self.request_routes
            route = routes.get(dest.name) if routes else None
        if route is not None and route.cpu_target is not None:
            return None
        return encode_grads(rid, args)

    def _reply_frames(self, peer: int, rid: int, value: Any, ctx: Any) -> list:
        """Pickle a reply (recording autograd functions in ``ctx``) into frames."""
        dest = self.workers[peer]
        route = self.reply_routes.get(dest.name)   # the reverse map to the caller (rpc/devices.py)
        if route is None:
            route = reply_route(self, dest.name)
        payload, tensors = dumps(value, dest=dest, route=route)
        if ctx is None and self.fast and type(tensors) is list:
            frames = encode_fast(Kind.REPLY, rid, "", payload, tensors)
            if frames is not None:
                return frames
        ag_meta = self._outgoing(peer, tensors, ctx, True)
        return encode(Kind.REPLY, rid, ag_meta, payload, tensors)

    def _decode_reply(self, p: Any, kind: int, frames: list) -> Any:
        msg = decode(frames, p.peer)
        if kind == Kind.ERROR:
            raise unpack_exception(msg.payload)
        hook = self._incoming(p.peer, msg.meta, True) if msg.meta is not None else None
        return loads(msg.payload, msg.specs, msg.buffers, tensor_hook=hook, tensors=msg.tensors,
                     place=self._place)

    def _place(self, t: Any, target: str) -> Any:
        """A received tensor onto ``target``, one of this worker's devices (ProtocolError
        for any other), on the current stream there."""
        return place(t, parse_target(target, self.device_targets))

    def _current_ctx(self) -> Any:
        for ext in self._ctx_exts:
            c = ext.current()
            if c is not None:
                return c
        return None

    def _outgoing(self, dest: int, tensors: list, ctx: Any, only_grad: bool = False) -> Any:
        if ctx is None:
            return None
        for ext in self.extensions:
            fn = getattr(ext, "outgoing_if_grad", ext.outgoing) if only_grad else ext.outgoing
            meta = fn(dest, tensors, ctx)
            if meta is not None:
                return meta
        return None

    def _incoming(self, sender: int, meta: Any, reply: bool = False):
        if meta is None:
            return None
        for ext in self.extensions:
            hook = ext.incoming(sender, meta, reply)
            if hook is not None:
                return hook
        return None

    def _scope(self, meta: Any):
        if meta is None:
            return NULL_SCOPE
        for ext in self.extensions:
            scope = ext.request_scope(meta)
            if scope is not NULL_SCOPE:
                return scope
        return NULL_SCOPE
