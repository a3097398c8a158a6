"""Remote references and their reference counting across workers.

The owner keeps a value in a table entry for as long as some other worker
holds a *fork* of it. Every RRef held on a non-owner is one fork. Sending an
RRef anywhere creates a new fork for the receiver: the owner registers it
directly when it is the sender, otherwise the sender tells the owner with a
``fork_add`` control message that goes out *before* the message carrying the
RRef. Control messages are handled in arrival order on the owner's reading thread,
and a sender's own ``fork_del`` always follows its ``fork_add``, so the owner
never sees zero forks while a fork is in flight. A fork deleted before its
``fork_add`` arrives leaves a count of -1 that the late ``fork_add`` cancels.
An RRef sent to its owner comes back as the owner's local RRef and drops the
fork that carried it; inside a request (rpc_sync/rpc_async/remote, e.g. every
``DistributedOptimizer.step`` and every call on a model stage held by an RRef)
no fork is made at all: the request names the RRef in its meta and the owner's
reading thread, handling it in arrival order (so before any later ``fork_del`` of
the sender), pins the value for the request, which saves a control message per
call. Forks held by a lost worker are dropped. A message from a third worker
about an RRef (a fork, a call on it) can reach the owner before the remote()
that creates it there (that one comes from the creator): the owner then holds a
pending value, which the creating request fills in, as torch's owner does.

A fork passed on by a worker that is not its owner is unconfirmed on arrival:
the owner confirms it (``fork_confirm``) when the sender's ``fork_add``
reaches it. As torch's callee does, a request (call or remote) whose arguments
carry such a fork runs its function only once the owner confirmed it, so
``confirmed_by_owner()`` is True inside the function. The wait costs the
difference between the paths sender -> owner -> callee and sender -> callee
(the owner confirms on its reading thread); it ends early if the owner is lost,
and after the RPC timeout at most (the fork is safe either way: the sender's
``fork_del`` never overtakes its ``fork_add``). Replies and RRefs unpickled
outside a request do not wait.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Generic, TypeVar

import torch

from ..errors import RPCTimeoutError, WorkerLostError
from ..wire import Kind
from ..wire.pickler import current_destination, current_pins
from . import extensions, profiling
from .agent import AsyncResult, agent_or_none, current_agent
from .devices import completed_future
from .future_errors import fail
from .internal import RPCExecMode
from .rref_context import RRefContext, _Entry  # noqa: F401 - RRefContext's old home
from .worker_info import WorkerInfo

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value that lives on one worker, its *owner*.

    ``RRef(value)`` makes a local value remotely referable; ``rpc.remote``
    returns an RRef to a value created on another worker. Passing an RRef in
    a call's arguments or result shares it; the owner keeps the value until no
    worker holds a reference any more.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.to_here()
        tensor([2., 2.])
        >>> rref.rpc_sync().sum()     # runs value.sum() on worker1
        tensor(4.)
    """

    def __init__(self, value: T = None, type_hint: Any = None) -> None:
        agent = agent_or_none()
        if agent is None:
            raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework "
                               "(e.g. by calling `rpc.init_rpc`)?")
        fut = completed_future(agent, value)
        self._init(agent, agent.rank, agent.rrefs.new_id(), None, fut, type_hint)

    def _init(self, agent, owner: int, rref_id: tuple, fork_id, future, type_hint) -> None:
        self._agent = agent
        self._owner = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._future = future      # owner: the value; user: the creation confirmation
        self._type_hint = type_hint
        if fork_id is not None:
            agent.rrefs.user_forks[(rref_id, fork_id)] = owner
        else:
            with agent.rrefs.lock:
                slot = agent.rrefs.local_owned.setdefault(rref_id, [future, 0])
                slot[1] += 1

    @classmethod
    def _user(cls, agent, owner: int, rref_id: tuple, fork_id: tuple, future, type_hint=None,
              confirmed: bool = True) -> RRef:
        self = cls.__new__(cls)
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        self._init(agent, owner, rref_id, fork_id, future, type_hint)
        if not confirmed:
            agent.rrefs.add_unconfirmed((rref_id, fork_id))
        return self

    @classmethod
    def _owner_side(cls, agent, rref_id: tuple, future, type_hint=None) -> RRef:
        self = cls.__new__(cls)
        self._init(agent, agent.rank, rref_id, None, future, type_hint)
        return self

    # -- identity -------------------------------------------------------------
    def is_owner(self) -> bool:
        """True on the worker that holds the value."""
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        """WorkerInfo of the owner."""
        return self._agent.workers[self._owner]

    def _live_owner(self) -> WorkerInfo:
        """The owner, to send it a request about this RRef: WorkerLostError when the
        owner was lost since this reference was made (a process that took its rank
        since does not hold the value)."""
        why = self._agent.rrefs.orphaned.get((self._rref_id, self._fork_id))
        if why is not None:
            raise WorkerLostError(why, self.owner_name())
        return self.owner()

    def owner_name(self) -> str:
        """Name of the owner."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows of this reference (always True on the owner)."""
        if self.is_owner():
            return True
        if (self._rref_id, self._fork_id) in self._agent.rrefs.unconfirmed:
            return False
        return self._future.done()

    def local_value(self) -> T:
        """The value itself; only on the owner. Waits for a value still being created."""
        if not self.is_owner():
            raise RuntimeError(
                f"For UserRRef(rref_id={_gid(self._rref_id)}, fork_id={_gid(self._fork_id)}), can't "
                f"call localValue() on user {self._agent.info}. Call it on owner {self.owner()}")
        return self._future.wait()

    def to_here(self, timeout: float = -1) -> T:
        """The value, copied to this worker (on the owner: the value itself).

        ``timeout`` in seconds; -1 uses the default RPC timeout, 0 waits forever.
        """
        if self.is_owner():
            return self._future.wait()
        self._check_alive("to_here()")
        self._check_created()
        agent = self._agent
        p = agent.send_request(self._live_owner(), Kind.CALL, (_rref_fetch, (), {}), "RRef.to_here",
                               timeout, sync=True, extra={"rref": self._rref_id})
        return agent.wait(p)

    # -- proxies --------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1) -> _Proxy:
        """Proxy whose method calls run ``rpc_sync`` on the owner's value."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1) -> _Proxy:
        """Proxy whose method calls run ``rpc_async`` on the owner's value."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1) -> _Proxy:
        """Proxy whose method calls run ``remote`` on the owner's value."""
        return _Proxy(self, "remote", timeout)

    def _call_method(self, mode: str, method: str, args: tuple, kwargs: dict, timeout: float):
        from . import api
        payload = (_rref_invoke, (method, args, kwargs), {})
        if mode == "remote":
            self._await_creation(timeout)
            value_type = self._get_type(timeout)  # as torch: the method must exist (cached after once)
            if not hasattr(value_type, method):
                raise AttributeError(f"type object '{value_type.__name__}' has no attribute '{method}'")
            return api._remote_with(self.owner(), payload, f"RRef.{method}", timeout,
                                    {"rref": self._rref_id})
        p = self._agent.send_request(self._live_owner(), Kind.CALL, payload, f"RRef.{method}", timeout,
                                     sync=(mode == "rpc_sync"), extra={"rref": self._rref_id})
        return self._agent.wait(p) if mode == "rpc_sync" else p.future

    def _await_creation(self, timeout: float) -> None:
        """As torch's proxies do before a remote(): wait (up to ``timeout``) until
        the owner created the value; RPCTimeoutError when it takes longer."""
        if self.is_owner() or self._future.done():
            return
        timeout = self._agent.effective_timeout(timeout)
        done = threading.Event()
        self._future.add_done_callback(lambda f: done.set())
        if not done.wait(timeout if timeout > 0 else None):
            raise RPCTimeoutError(f"RPC ran for more than set timeout ({timeout * 1000:.0f} ms) and will "
                                  f"now be marked with an error: RRef {_gid(self._rref_id)} was not "
                                  f"created by its owner {self.owner_name()} within {timeout:g} s",
                                  self.owner_name())

    # -- pickling and lifetime ---------------------------------------------------
    def _check_alive(self, what: str) -> None:
        """A user RRef released by shutdown (or never registered) cannot be used."""
        if (self._rref_id, self._fork_id) not in self._agent.rrefs.user_forks:
            raise RuntimeError(f"User RRef with RRefId={_gid(self._rref_id)} and "
                               f"ForkId={_gid(self._fork_id)} has been deleted. Cannot call {what} "
                               "on it after deletion.")

    def _check_created(self) -> None:
        """A remote() whose creation timed out: say so, as torch does."""
        if self._future.done():
            try:
                self._future.wait()
            except RPCTimeoutError as e:
                raise RPCTimeoutError("RRef creation via rpc.remote() timed out, and it is possible that "
                                      f"the RRef on the owner node does not exist. ({e})",
                                      e.worker_name) from e
            except BaseException:  # noqa: BLE001 - the owner's value carries the error
                pass

    def _get_future(self) -> torch.futures.Future:
        """The future of this RRef's creation (of the owner's value, on the owner)."""
        return getattr(self, "_creation", None) or self._future

    def __reduce__(self):
        dest = current_destination()
        if dest is None and sys._getframe(1).f_code is _EXTRACT_TENSORS:
            # torch's Future(devices=...) looks for tensors in a value by pickling it
            # (torch._jit_internal._extract_tensors), and skips its own RRefs: an RRef
            # holds no tensor, so a value holding one is skipped too, not refused
            return (_no_rref, ())
        agent = self._agent
        if not self.is_owner() and (self._rref_id, self._fork_id) not in agent.rrefs.user_forks:
            raise RuntimeError(f"User RRef with RRefId={_gid(self._rref_id)} and "
                               f"ForkId={_gid(self._fork_id)} has been deleted. Cannot call fork an "
                               "UserRRef after deletion.")
        if dest is None or agent_or_none() is not agent:
            raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled "
                               "inside an RPC call (rpc_sync, rpc_async, remote) while RPC is running")
        pins = current_pins()
        if pins is not None and dest.id == self._owner and not self.is_owner():
            pins.append(self._rref_id)  # the request pins it on the owner: no fork
            return (_unpickle_rref, (self._owner, self._rref_id, None, agent.rank, self._type_hint))
        fork_id = agent.rrefs.new_id()
        if self.is_owner():
            agent.rrefs.add_fork(self._rref_id, fork_id, dest.id, self._future)
        else:
            agent.send_control(self._owner, "fork_add", self._rref_id, fork_id, dest.id)
        return (_unpickle_rref, (self._owner, self._rref_id, fork_id, agent.rank, self._type_hint))

    def __del__(self):
        try:
            if self._fork_id is None:
                ctx = self._agent.rrefs
                with ctx.lock:
                    slot = ctx.local_owned.get(self._rref_id)
                    if slot is not None:
                        slot[1] -= 1
                        if slot[1] <= 0:
                            del ctx.local_owned[self._rref_id]
                return
            agent = self._agent
            if agent.rrefs.user_forks.pop((self._rref_id, self._fork_id), None) is not None:
                agent.rrefs.unconfirmed.discard((self._rref_id, self._fork_id))
                if agent.rrefs.orphaned.pop((self._rref_id, self._fork_id), None) is not None:
                    return  # its owner is gone: nobody to tell
                if agent_or_none() is agent:
                    agent.send_control(self._owner, "fork_del", self._rref_id, self._fork_id)
        except Exception:
            pass

    def __repr__(self) -> str:
        if self.is_owner():
            return f"OwnerRRef({_gid(self._rref_id)})"
        return f"UserRRef(RRefId = {_gid(self._rref_id)}, ForkId = {_gid(self._fork_id)})"

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from this RRef's value (a scalar) on its owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward in that
        context; with -1 a local ``torch.autograd.backward`` on the owner.

        Example::

            >>> with dist_autograd.context() as cid:
            ...     loss_rref = rpc.remote("worker1", compute_loss, args=(x,))
            ...     loss_rref.backward(cid)
        """
        args = (self._rref_id, dist_autograd_ctx_id, retain_graph)
        if self.is_owner():
            _rref_backward_local(self._future.wait(), *args[1:]).wait()
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        agent = self._agent
        p = agent.send_request(self._live_owner(), Kind.CALL, (_rref_backward, args[1:], {}),
                               "RRef.backward", -1, sync=True, extra={"rref": self._rref_id})
        agent.wait(p)

    def _get_type(self, timeout: float = -1, blocking: bool = True):
        """The type of the value (asked of the owner once, then cached); with
        ``blocking=False`` a Future of it, the same one every time (as torch)."""
        fut = getattr(self, "_type_future", None)
        if fut is None:
            if self._type_hint is not None:
                fut = torch.futures.Future()
                fut.set_result(self._type_hint)
            elif self.is_owner():
                fut = _map_value(self._future, type)
            else:
                self._check_alive("_get_type()")
                fut = self._ask_type(timeout)
            self._type_future = fut  # cached at once: a second call never asks again

            def settle(f: torch.futures.Future) -> None:
                try:
                    self._type_hint = f.value()
                except BaseException:  # noqa: BLE001 - the caller sees the error; ask again next time
                    self._type_future = None
            fut.add_done_callback(settle)
        return fut.wait() if blocking else fut

    def _ask_type(self, timeout: float) -> torch.futures.Future:
        """The owner's answer to "what type is the value" (an RPC, profiled as
        torch's ``_rref_typeof_on_owner``)."""
        def send() -> torch.futures.Future:
            return self._agent.send_request(self._live_owner(), Kind.CALL, (_rref_type, (), {}),
                                            "RRef._get_type", timeout, extra={"rref": self._rref_id}).future
        if not profiling.legacy_profiler_on():
            return send()
        with profiling.rpc_scope(RPCExecMode.ASYNC, _rref_typeof_on_owner, self._agent.name,
                                 self.owner_name()) as rf:
            return rf._call_end_callbacks_on_future(send())

    def _get_profiling_future(self) -> torch.futures.Future:
        """torch's hook for profiled remote() calls: done once the creation is
        and its profiling scope ended."""
        return getattr(self, "_profiling_future", None) or self._get_future()


_EXTRACT_TENSORS = torch._jit_internal._extract_tensors.__code__


def _no_rref() -> None:
    """What an RRef becomes in the pickle torch's futures only search for tensors."""


def _gid(ident: tuple) -> str:
    return f"GloballyUniqueId(created_on={ident[0]}, local_id={ident[1]})"


def _unpickle_rref(owner: int, rref_id: tuple, fork_id: tuple, sender: int, type_hint) -> RRef:
    agent = current_agent()
    if fork_id is None:  # carried to its owner by a request that pinned it
        msg = agent.current_request()
        fut = ((msg.local or {}).get("pins") or {}).get(rref_id) if msg is not None else None
        if owner != agent.rank or fut is None:
            raise RuntimeError(f"RRef {rref_id} arrived at {agent.name} without its owner's pin")
        return RRef._owner_side(agent, rref_id, fut, type_hint)
    if owner == agent.rank:
        ctx = agent.rrefs
        with ctx.lock:
            entry = ctx.owned.get(rref_id)
            if entry is None:
                raise RuntimeError(f"RRef {rref_id} arrived at its owner {agent.name} after it was freed")
            rref = RRef._owner_side(agent, rref_id, entry.future, type_hint)
            ctx.del_fork(rref_id, fork_id, agent.rank)  # the fork that carried it here
        return rref
    confirmed = sender == owner
    rref = RRef._user(agent, owner, rref_id, fork_id, None, type_hint, confirmed=confirmed)
    if not confirmed and agent.current_request() is not None:
        # as torch's callee, run the request once the owner knows of this fork
        agent.rrefs.wait_confirmed((rref_id, fork_id), owner)
    return rref


def _rref_fetch():
    """Runs on the owner: reply with the value once it exists."""
    return AsyncResult(current_agent().current_request().local["source"])


def _rref_typeof_on_owner():
    """torch's name for the call that asks an owner for its value's type (profiles)."""


def _rref_type():
    """Runs on the owner: the type of the value, once it exists."""
    source = current_agent().current_request().local["source"]
    return AsyncResult(_map_value(source, type))


def _map_value(source: torch.futures.Future, fn) -> torch.futures.Future:
    """A future of ``fn(value)``; an error of ``source`` passes unchanged (Future.then
    would wrap it in a RuntimeError)."""
    out = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        try:
            out.set_result(fn(f.value()))
        except BaseException as e:  # noqa: BLE001 - the future carries it
            fail(out, e)
    source.add_done_callback(done)
    return out


def _rref_backward_local(value: Any, ctx_id: int, retain_graph: bool) -> torch.futures.Future:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"RRef should contain a tensor for .backward(), got {type(value).__name__}")
    if ctx_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut
    backward_async = extensions.DIST_BACKWARD   # distgrad.autograd's, put there at its import
    if backward_async is None:
        raise RuntimeError("RRef.backward with a distributed autograd context needs distgrad.autograd "
                           "(import it)")
    return backward_async(ctx_id, [value], retain_graph)


def _rref_backward(ctx_id: int, retain_graph: bool):
    """Runs on the owner: backward from the value, replying when the pass is done."""
    value = current_agent().current_request().local["source"].wait()
    return AsyncResult(_rref_backward_local(value, ctx_id, retain_graph))


def _rref_invoke(method: str, args: tuple, kwargs: dict):
    """Runs on the owner: call ``value.method(*args, **kwargs)``."""
    source = current_agent().current_request().local["source"]
    value = source.wait()
    fn = getattr(value, method)
    target = getattr(type(value), method, None)
    result = fn(*args, **kwargs)
    if getattr(target, "_wrapped_async_rpc_function", None) or \
            getattr(fn, "_wrapped_async_rpc_function", None):
        return AsyncResult(result)
    return result


class _Proxy:
    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            return self._rref._call_method(self._mode, method, args, kwargs, self._timeout)
        return call
