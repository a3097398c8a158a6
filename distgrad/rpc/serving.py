"""The serving half of the agent (a mixin of :class:`~.agent.RpcAgent`): run a
request on the thread that read it, inside the caller's autograd context when
it carries one, and send its reply (or error) from that thread.

Example::

    >>> # worker1 serves worker0's rpc_sync("worker1", torch.add, (ones(2), 1)):
    >>> # on_message (in order) -> _serve (this module) -> the reply leaves from here
"""
from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import Any

import torch

from ..errors import DistgradError
from ..intra_op import follow_intra_op_threads
from ..wire import Kind, encode, loads
from . import profiling, script
from .remote_exc import pack_exception

log = logging.getLogger("distgrad.rpc.agent")


class Serving:
    """Serving requests; the state it uses lives on the agent."""

    def _serve(self, peer: int, msg) -> None:
        with self._count_lock:
            self.busy_threads += 1
            started = msg.handed_off
            if started is not None and self.gil_wait is not None:
                self.gil_wait[0] += time.perf_counter() - started
                self.gil_wait[1] += 1
        try:
            self._serve_inner(peer, msg)
        finally:
            with self._count_lock:
                self.busy_threads -= 1

    def _serve_inner(self, peer: int, msg) -> None:
        what, ag_meta, extra = msg.meta
        try:
            follow_intra_op_threads()  # the global torch.set_num_threads (distgrad/intra_op.py)
            hook = self._incoming(peer, ag_meta)
            self._tls.msg = msg
            call = msg.call   # a gradient message's, decoded without a pickle
            func, args, kwargs = _load_call(msg, hook, self._place) if call is None else call
            with self._scope(ag_meta) as ctx:
                if profiling.active:  # a server-side profile is open
                    result = profiling.run(func, args, kwargs)
                else:
                    result = script.call(func, args, kwargs)  # torch's errors for builtins
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            if msg.kind != Kind.NOTIFY:  # as torch does, the callee reports it too
                print(f"On {self.info}:\n{e!r}\n{traceback.format_exc()}", file=sys.stderr)
            self._finish_request(peer, msg, None, e, None)
            return
        finally:
            self._tls.msg = None
        if isinstance(result, AsyncResult):
            result = result.future
            is_async = True
        else:
            is_async = bool(getattr(func, "_wrapped_async_rpc_function", None))
        if is_async:
            if not isinstance(result, torch._C.Future):
                err = AsyncReturnTypeError("Functions decorated with @rpc.async_function must return a "
                                    f"torch.futures.Future object, but got {type(result).__name__} "
                                    f"from {what}", self.name)
                self._finish_request(peer, msg, None, err, ctx)
                return
            result.add_done_callback(lambda f: self._finish_from_future(peer, msg, f, ctx))
            return
        self._finish_request(peer, msg, result, None, ctx)

    def _finish_from_future(self, peer: int, msg, fut: torch.futures.Future, ctx: Any) -> None:
        try:
            value = fut.wait()
        except BaseException as e:  # noqa: BLE001
            self._finish_request(peer, msg, None, e, ctx)
            return
        self._finish_request(peer, msg, value, None, ctx)

    def _finish_request(self, peer: int, msg, value: Any, exc: BaseException | None, ctx: Any) -> None:
        try:
            if msg.kind == Kind.NOTIFY:
                if exc is not None:
                    log.error("worker %s: one-way call %s from worker %s failed: %s: %s", self.name,
                              msg.meta[0], self.workers[peer].name, type(exc).__name__, exc)
                return
            if msg.kind == Kind.REMOTE:
                value, exc = self.remote_done(peer, msg, value, exc)
            if exc is None:
                try:
                    self._send_reply(peer, msg.rid, value, ctx)
                except Exception as e:  # noqa: BLE001 - the reply could not be made: the caller
                    # gets the error (as torch's callee sends it), never a silent timeout. Frames
                    # are sent whole or not at all, so nothing of the reply went out.
                    self._send_error(peer, msg.rid, e, ctx)
            else:
                self._send_error(peer, msg.rid, exc, ctx)
        finally:
            with self._count_lock:
                self.inflight -= 1

    def remote_done(self, peer: int, msg, value: Any, exc: BaseException | None):
        """Overridden by the RRef layer: store the value, reply with a confirmation."""
        return value, exc

    def _send_reply(self, peer: int, rid: int, value: Any, ctx: Any) -> None:
        self.transport.send(peer, self._reply_frames(peer, rid, value, ctx))

    def _send_error(self, peer: int, rid: int, exc: BaseException, ctx: Any) -> None:
        blob = pack_exception(exc, self.name, self.rank)
        self.transport.send(peer, encode(Kind.ERROR, rid, None, blob))


class AsyncReturnTypeError(DistgradError, TypeError):
    """An async_execution function returned something other than a Future."""


class UnknownFunctionError(DistgradError, AttributeError):
    """The callee lacks the function (or class) a call names: code is never sent."""


def _load_call(msg, hook, place=None) -> tuple:
    try:
        return loads(msg.payload, msg.specs, msg.buffers, tensor_hook=hook, tensors=msg.tensors,
                     place=place)
    except AttributeError as e:
        raise UnknownFunctionError(f"{e}. Default RPC pickler does not serialize function code. Ensure "
                                   "that UDFs are defined on both caller and callee modules.") from e


class AsyncResult:
    """Returned by internal functions whose reply must wait on ``future``."""

    __slots__ = ("future",)

    def __init__(self, future: torch.futures.Future) -> None:
        self.future = future
