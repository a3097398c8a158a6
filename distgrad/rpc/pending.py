"""The caller's side of a call in flight: the pending entry and the future of
an ``rpc_async`` whose ``wait()`` reads its own reply, and the holder of the
running agent (:func:`current_agent`).

Example::

    >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    >>> fut.wait()            # reads the reply on this thread when nobody else does
    tensor([2., 2.])
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..intra_op import follow_intra_op_threads
from .future_errors import fail

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


# Guards the choice between a callback registered on an RpcFuture and the reading
# thread that completes it (see RpcFuture.then and RpcAgent._finish_async).
_SEAL = threading.Lock()


class RpcFuture(torch.futures.Future):
    """The future of an ``rpc_async``: ``wait()`` reads the reply on the waiting
    thread when nobody else is reading that connection (no wake-up of a reading
    thread), and the future is then completed on a pool thread, which wakes the
    waiter and runs the callbacks there, as torch completes every reply on its RPC
    threads: no callback runs inside ``wait()`` on the waiting thread, whoever
    registered it (``then``, ``add_done_callback``, ``torch.futures.collect_all``
    and ``wait_all`` in C++), since the waiter may hold what a callback needs.

    A reply read by a reading thread (not the waiter) is completed there, in turn
    with the others of its read, while its future has no callback seen here
    (``then``, ``add_done_callback`` mark it); one with callbacks is completed on a
    thread of its own: a callback is user code and may wait, for instance for
    another reply read in the same read, which a thread completing replies in turn
    would never reach (issue 34)."""

    def then(self, callback):  # noqa: D102 - torch.futures.Future.then
        self._dg_mark_user()
        return super().then(callback)

    def add_done_callback(self, callback):  # noqa: D102 - torch.futures.Future.add_done_callback
        self._dg_mark_user()
        super().add_done_callback(callback)

    def _dg_mark_user(self) -> None:
        d = self.__dict__
        with _SEAL:
            sealed = d.get("_dg_sealed", False)
            if not sealed:
                d["_dg_user"] = True
        if sealed:
            # a thread that runs several completions in turn has chosen to complete
            # this one (it had no callback then): let it, so that this callback runs
            # here, on a completed future, as torch runs it, never on that thread
            while not self.done():
                time.sleep(0)

    def wait(self):  # noqa: D102 - torch.futures.Future.wait
        p = self.__dict__.get("_dg_pending")
        if p is not None and not self.done():
            agent = _holder.get("agent")
            if agent is not None:
                agent.read_reply(p)
        return super().wait()


def _settle(fut: torch.futures.Future, value: Any, exc: BaseException | None) -> None:
    """Complete ``fut`` with ``value`` or ``exc`` (running its callbacks here)."""
    follow_intra_op_threads()  # callbacks are user code (distgrad/intra_op.py)
    if exc is not None:
        fail(fut, exc)
    else:
        fut.set_result(value)


class _Pending:
    __slots__ = ("future", "peer", "what", "timeout", "timer", "lock", "result", "ctx", "reader",
                 "claimed", "deadline")

    def __init__(self, peer: int, what: str, timeout: float, sync: bool, ctx: Any,
                 devices: list | None = None) -> None:
        self.peer, self.what, self.timeout, self.ctx = peer, what, timeout, ctx
        self.timer = None
        self.deadline = 0.0  # monotonic time past which the periodic sweep fails it
        self.result: Any = None
        self.reader = None  # the thread that reads this reply while it waits for it
        self.claimed = False  # this caller took its connection's reading role
        # with the agent's devices (device maps set): waiters are ordered after the reply's copies
        self.future = None if sync else (RpcFuture(devices=devices) if devices else RpcFuture())
        if not sync:
            self.future._dg_pending = self
        self.lock = threading.Lock() if sync else None
        if sync:
            self.lock.acquire()
