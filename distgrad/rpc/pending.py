"""The caller's side of a call in flight: the pending entry and the future of
an ``rpc_async`` whose ``wait()`` reads its own reply (no thread hand-off), and
the holder of the running agent (:func:`current_agent`).

Example::

    >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    >>> fut.wait()            # reads the reply on this thread when nobody else does
    tensor([2., 2.])
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .agent import RpcAgent

_holder: dict[str, RpcAgent] = {}


def current_agent() -> RpcAgent:
    """The running agent; raises RuntimeError when RPC is not initialized."""
    agent = _holder.get("agent")
    if agent is None:
        raise RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")
    return agent


def agent_or_none() -> RpcAgent | None:
    return _holder.get("agent")


class RpcFuture(torch.futures.Future):
    """The future of an ``rpc_async``: ``wait()`` reads the reply on the waiting
    thread when nobody else is reading that connection (no thread hand-off)."""

    def wait(self):  # noqa: D102 - torch.futures.Future.wait
        p = self.__dict__.get("_dg_pending")
        if p is not None and not self.done():
            agent = _holder.get("agent")
            if agent is not None:
                agent.read_reply(p)
        return super().wait()


class _Pending:
    __slots__ = ("future", "peer", "what", "timeout", "timer", "lock", "result", "ctx", "reader",
                 "claimed", "deadline")

    def __init__(self, peer: int, what: str, timeout: float, sync: bool, ctx: Any) -> None:
        self.peer, self.what, self.timeout, self.ctx = peer, what, timeout, ctx
        self.timer = None
        self.deadline = 0.0  # monotonic time past which the periodic sweep fails it
        self.result: Any = None
        self.reader = None  # the thread that reads this reply while it waits for it
        self.claimed = False  # this caller took its connection's reading role
        self.future = None if sync else RpcFuture()
        if not sync:
            self.future._dg_pending = self
        self.lock = threading.Lock() if sync else None
        if sync:
            self.lock.acquire()
