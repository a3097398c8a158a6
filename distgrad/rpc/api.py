"""The public RPC API, with torch.distributed.rpc's names and signatures.

Also torch's private helpers that code and tests written for torch use:
``_all_gather``/``_barrier``/``_wait_all_workers`` (an RPC all-gather through
the worker with the smallest name), ``_wait_all`` (collect the futures of
``rpc_async``), ``_use_rpc_pickler``, ``_get_current_rpc_agent``. Graceful
shutdown calls them through this module's globals, as torch's does, so that
patching ``api._wait_all_workers`` etc. takes effect.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import WorkerLostError
from ..launch import keeper, rendezvous
from ..transport.descriptors import raise_open_file_limit
from ..wire import Kind
from . import backend_registry, collective, devices, dynamic, extensions, lifecycle, profiling, script
from .agent import RpcAgent, _holder, _qualname, agent_or_none, current_agent
from .debug import _get_debug_info, _rref_context_get_debug_info, enable_gil_profiling  # noqa: F401
from .future_errors import fail
from .internal import PythonUDF, RPCExecMode, _internal_rpc_pickler, _run_serialized
from .options import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .rref import RRef
from .worker_info import WorkerInfo

log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")
_init_lock = threading.Lock()
# torch's default: a worker whose peers are still training waits for them; a lost
# peer (crash, silence) does not hold the barrier, so the wait is bounded by failure
# detection, not by this number.
_DEFAULT_SHUTDOWN_TIMEOUT = 100000.0
# As in torch: True ignores RRefs still referenced elsewhere at shutdown; False
# makes a graceful shutdown raise "Leaking RRef" (torch's tests set it).
_ignore_rref_leak = True
_default_pickler = _internal_rpc_pickler
_thread_local_var = threading.local()


def init_rpc(name: str, backend: Any = None, rank: int | None = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Start this process's RPC agent and meet the other workers.

    Workers rendezvous through a torch.distributed store named by
    ``rpc_backend_options.init_method`` (``env://`` by default, reading
    MASTER_ADDR, MASTER_PORT and, when not given, RANK and WORLD_SIZE).

    Without ``world_size`` (and no WORLD_SIZE for ``env://``) the worker joins
    a dynamic group, as in torch: members join and leave (``shutdown()``) at any
    time, one that crashes is taken out, and a new process may take its name
    and rank. ``rank=None`` there asks for the smallest free rank. See
    :mod:`distgrad.rpc.membership`.

    Example (in each of two processes, rank 0 and 1)::

        >>> import distgrad.rpc as rpc
        >>> opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:29500")
        >>> rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rpc.shutdown()
    """
    opts = _check_init_args(name, backend, rpc_backend_options)
    with _init_lock:
        if agent_or_none() is not None:
            raise RuntimeError("RPC is already initialized")
        _check_rank(opts.init_method, rank, world_size)
        init_method, rank, world_size = rendezvous.resolve(opts.init_method, rank, world_size)
        raise_open_file_limit()   # before anything listens: a crowd has more to exhaust
        if not backend_registry.is_builtin(backend):
            # as torch does for any backend: a store every worker reached
            store, _, _ = next(torch.distributed.rendezvous(init_method, rank=rank, world_size=world_size))
            _set_and_start_rpc_agent(backend_registry.init_backend(
                backend, store=store, name=name, rank=rank, world_size=world_size,
                rpc_backend_options=opts))
            return
        store = rendezvous.make_store(init_method, rank, world_size, lifecycle.rdv_timeout(opts), name)
        try:
            lifecycle.start_agent(store, name, rank, world_size, opts,
                                  rendezvous.master_host(init_method),
                                  hosts_store=rendezvous.hosts_store(init_method, rank, world_size))
        except BaseException:
            keeper.let_go(store)   # rank 0's store process, if any, goes with this attempt
            raise


def _set_and_start_rpc_agent(agent: Any) -> None:
    """Make ``agent`` (built by a registered backend) this process's agent."""
    _holder["agent"] = agent
    if hasattr(agent, "get_worker_infos"):
        collective.set_members({w.name for w in agent.get_worker_infos()})
    if hasattr(agent, "start"):
        agent.start()


def _init_rpc_backend(backend: Any = None, store: Any = None, name: str | None = None, rank: int = -1,
                      world_size: int = -1, rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """torch's lower half of init_rpc: start the agent on an existing store.

    Example::

        >>> store, _, _ = next(torch.distributed.rendezvous("tcp://127.0.0.1:29500", rank=0, world_size=2))
        >>> rpc._init_rpc_backend(store=store, name="worker0", rank=0, world_size=2)
    """
    opts = _check_init_args(name, backend, rpc_backend_options)
    with _init_lock:
        if agent_or_none() is not None:
            raise RuntimeError("RPC is already initialized")
        raise_open_file_limit()
        lifecycle.start_agent(store, name, rank, world_size, opts, None)


def _check_init_args(name: Any, backend: Any, opts: Any) -> TensorPipeRpcBackendOptions:
    if backend is not None and not backend_registry.is_backend(backend):
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}")
    if opts is not None and not isinstance(opts, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions, "
                        f"got {type(opts).__name__}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"Worker name must match ^[A-Za-z0-9_:-]{{1,127}}$ (shorter than 128), got {name!r}")
    if not backend_registry.is_builtin(backend):
        return opts
    if opts is None:
        return TensorPipeRpcBackendOptions()
    if not isinstance(opts, TensorPipeRpcBackendOptions):
        if backend is None:
            raise TypeError(f"Could not infer backend for options {opts}")
        raise TypeError("`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`, got "
                        f"{type(opts).__name__}")
    return opts


def _check_rank(init_method: str, rank: Any, world_size: Any) -> None:
    """torch's messages for a missing rank (before any rendezvous). ``rank=None``
    in a dynamic group (no ``world_size``) asks for the smallest free rank."""
    if rank is None and world_size is None or rank is not None and rank >= 0:
        return
    if str(init_method).startswith("env://"):
        if "RANK" not in os.environ:
            raise ValueError("environment variable RANK expected, but not set (or pass rank= to init_rpc)")
    else:
        raise ValueError(f"rank parameter missing: init_method {init_method!r} needs rank= (>= 0)")


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC on this worker.

    With ``graceful=True`` (default) it waits until every worker has reached
    shutdown and finished its outstanding work, releases this worker's RRefs,
    then stops. Workers found lost are not waited for; ``timeout`` (seconds;
    0 means torch's default of no limit) bounds the rest. Returns quietly when
    RPC was never initialized (e.g. after a failed init). An error of the
    graceful part is raised after the local shutdown completed.

    Example::

        >>> rpc.shutdown()
    """
    agent = agent_or_none()
    if agent is None:
        return
    try:
        # the layers above first (a trace left open: written now, while the members serve)
        for start in extensions.SHUTDOWN_START:
            start(graceful)
        if agent.dynamic:  # leave the group; the others go on (see rpc/dynamic.py)
            if graceful:
                limit = timeout if timeout and timeout > 0 else _DEFAULT_SHUTDOWN_TIMEOUT
                dynamic.leave(agent, time.monotonic() + limit, _delete_all_user_and_unforked_owner_rrefs,
                              check_leak=not _ignore_rref_leak)
            else:
                dynamic.untable(agent)
        elif graceful:
            limit = timeout if timeout and timeout > 0 else _DEFAULT_SHUTDOWN_TIMEOUT
            deadline = time.monotonic() + limit
            _wait_all_workers(timeout)
            _delete_all_user_and_unforked_owner_rrefs()
            lifecycle.join(agent, deadline, check_leak=not _ignore_rref_leak)
    finally:
        lifecycle.finalize_shutdown(agent, graceful)


def _wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker not lost reached this point (an RPC all-gather).

    A worker lost meanwhile does not fail it: the lost-aware barrier of
    shutdown follows. Other errors (e.g. a timeout) raise.

    Example::

        >>> rpc.api._wait_all_workers()
    """
    agent = current_agent()
    try:
        _all_gather(None, timeout=timeout)
    except WorkerLostError as e:
        log.info("worker %s: shutdown all-gather incomplete (%s); lost: %s", agent.name, e,
                 sorted(agent.lost))
    except RuntimeError as e:
        log.error("worker %s: failed to respond to 'Shutdown Proceed' in time: %s", agent.name, e)
        raise


def _all_gather(obj: Any, worker_names: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> dict:
    """Every worker's ``obj``, as ``{name: obj}``, on every worker of ``worker_names``
    (default: all). Followers send to the leader (the smallest name), which
    sends the result back; blocks until this worker has it.

    Example::

        >>> rpc.api._all_gather(rpc.get_worker_info().id)
        {'worker0': 0, 'worker1': 1}
    """
    return collective.all_gather(current_agent(), obj, worker_names, timeout, rpc_sync, rpc_async,
                                 _gather_to_leader, _broadcast_to_followers)


def _gather_to_leader(sequence_id: str, worker_name: str, obj: Any, worker_names: Any = None) -> None:
    """Runs on the leader of an all-gather (see :mod:`.collective`)."""
    collective.gather(sequence_id, worker_name, obj, worker_names)


def _broadcast_to_followers(sequence_id: str, objects_map: dict) -> None:
    """Runs on a follower of an all-gather: the leader's complete map."""
    collective.broadcast(sequence_id, objects_map)


def _barrier(worker_names: Any) -> None:
    """Block until every worker of ``worker_names`` calls it (errors are logged).

    Example::

        >>> rpc.api._barrier(["worker0", "worker1"])
    """
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError:
        log.exception("Failed to complete barrier")


def _delete_all_user_and_unforked_owner_rrefs(timeout: Any = None) -> None:
    """Release every RRef this worker holds of other owners (graceful shutdown).

    Example::

        >>> rpc.api._delete_all_user_and_unforked_owner_rrefs()
    """
    current_agent().rrefs.delete_all_user_rrefs()


def membership_events() -> list[tuple[float, str, str, int, int]]:
    """What this worker saw of its dynamic group's membership, oldest first:
    ``(time.time(), "joined" | "left" | "lost", name, rank, incarnation)``
    ("lost": it crashed or went silent and was taken out). Empty in a static group.

    Example::

        >>> rpc.membership_events()
        [(1764633600.1, 'joined', 'trainer3', 3, 1), (1764633612.4, 'lost', 'trainer2', 2, 1),
         (1764633613.0, 'joined', 'trainer2', 2, 2)]
    """
    return list(current_agent().events)


def _get_current_rpc_agent() -> RpcAgent:
    """The running agent (torch's accessor); RuntimeError when RPC is not initialized.

    Example::

        >>> [w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()]
        ['worker0', 'worker1']
    """
    return current_agent()


def _is_current_rpc_agent_set() -> bool:
    """Whether RPC is initialized in this process."""
    return agent_or_none() is not None


@contextlib.contextmanager
def _use_rpc_pickler(rpc_pickler: Any) -> Iterator[None]:
    """Within the block, Python calls are serialized by ``rpc_pickler.serialize``
    (a subclass of ``internal._InternalRPCPickler``, e.g. one with extra reducers).

    Example::

        >>> with rpc.api._use_rpc_pickler(my_pickler):
        ...     rpc.rpc_sync("worker1", f)
    """
    global _default_pickler
    _default_pickler = rpc_pickler
    try:
        yield
    finally:
        _default_pickler = _internal_rpc_pickler


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Collect the futures of every ``rpc_async`` made in the block (this thread)
    and wait for all of them when it ends.

    Example::

        >>> with rpc.api._wait_all():
        ...     rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    """
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def _payload(func: Callable, args: Any, kwargs: Any) -> tuple[tuple, str]:
    """What a call carries for ``func`` and its name in errors and profiles."""
    if not callable(func):
        raise TypeError("function should be callable.")
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if script.is_script_function(func):
        name = script.qualified_name(func)
        return (script.ScriptFunctionRef(name), args, kwargs), name
    if (script.BUILTINS or script.builtin_table()).get(id(func)) is not None:
        # as torch sends a builtin operator's call (a ScriptCall of tensors, never
        # through a pickler): an nn.Parameter argument is a tensor like any other,
        # linked into the graph (a view carries the link; a Parameter would arrive as a
        # new leaf), and a custom RPC pickler is not used
        for a in args:  # (a loop, not a call: this runs on every builtin's call)
            if type(a) is _PARAMETER or type(a) is list or type(a) is tuple:
                args = _unparam(args)
                break
        if kwargs:
            kwargs = {k: _unparam1(v) for k, v in kwargs.items()}
        return (func, args, kwargs), _qualname(func)
    if _default_pickler is not _internal_rpc_pickler:
        data, tensors = _default_pickler.serialize(PythonUDF(func, args, kwargs))
        return (_run_serialized, (data, tensors), {}), _qualname(func)
    return (func, args, kwargs), _qualname(func)


_PARAMETER = torch.nn.Parameter


def _unparam1(v: Any) -> Any:
    if type(v) is torch.nn.Parameter and v.requires_grad and torch.is_grad_enabled():
        return v.view_as(v)
    if type(v) in (list, tuple):
        return type(v)(_unparam1(x) for x in v)
    return v


def _unparam(args: tuple) -> tuple:
    return tuple(_unparam1(a) for a in args)


def rpc_sync(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` (name, rank or WorkerInfo) and
    return its result. ``timeout`` in seconds: -1 uses the default, 0 means none.
    ``func`` may be a Python callable, a torch operator or a TorchScript function.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    agent = current_agent()
    payload, what = _payload(func, args, kwargs)
    dest = agent.resolve(to)
    if profiling.legacy_profiler_on():
        prof = profiling.rpc_profile(RPCExecMode.SYNC, func, agent.name, dest.name)
        with prof.scope:
            p = agent.send_request(dest, Kind.CALL, prof.payload(payload), what, timeout, sync=True)
            return prof.result(agent.wait(p))
    return agent.wait(agent.send_request(dest, Kind.CALL, payload, what, timeout, sync=True))


def rpc_async(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Like :func:`rpc_sync` but returns a ``torch.futures.Future`` at once.

    Example::

        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut.wait()
        tensor([4., 4.])
    """
    agent = current_agent()
    payload, what = _payload(func, args, kwargs)
    dest = agent.resolve(to)
    if profiling.legacy_profiler_on():
        prof = profiling.rpc_profile(RPCExecMode.ASYNC, func, agent.name, dest.name)
        with prof.scope as rf:
            p = agent.send_request(dest, Kind.CALL, prof.payload(payload), what, timeout)
            fut = rf._call_end_callbacks_on_future(prof.future(p.future))
    else:
        fut = agent.send_request(dest, Kind.CALL, payload, what, timeout).future
    if hasattr(_thread_local_var, "future_list"):
        _thread_local_var.future_list.append(fut)
    return fut


def remote(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func`` on ``to`` and return an :class:`RRef` to its result, kept there.
    Called with this worker as ``to``, it returns the owner RRef itself.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    agent = current_agent()
    dest = agent.resolve(to)
    payload, what = _payload(func, args, kwargs)
    if profiling.legacy_profiler_on():
        prof = profiling.rpc_profile(RPCExecMode.REMOTE, func, agent.name, dest.name)
        with prof.scope as rf:
            rref = _remote_with(dest, prof.payload(payload), what, timeout, {}, prof.future)
            rref._profiling_future = rf._call_end_callbacks_on_future(rref._get_future())
            return rref
    return _remote_with(dest, payload, what, timeout, {})


def _remote_with(dest: WorkerInfo, payload: tuple, what: str, timeout: float, extra: dict,
                 confirmation: Callable = lambda fut: fut) -> RRef:
    """remote(): ``confirmation`` maps the future of the owner's confirmation
    (what the RRef waits on)."""
    agent = current_agent()
    rref_id = agent.rrefs.new_id()
    if dest.id == agent.rank:
        # The owner RRef, whose value the request (sent to ourselves) sets.
        fut = devices.new_future(agent)
        rref = RRef._owner_side(agent, rref_id, fut)
        agent.rrefs.local_targets[rref_id] = fut
        try:
            p = agent.send_request(dest, Kind.REMOTE, payload, what, timeout, extra=dict(extra, own=rref_id))
        except BaseException:
            agent.rrefs.local_targets.pop(rref_id, None)
            raise
        created = confirmation(p.future)
        created.add_done_callback(lambda f: _fail_unset(fut, f))
        rref._creation = created
        return rref
    fork_id = agent.rrefs.new_id()
    extra = dict(extra, new=(rref_id, fork_id))
    p = agent.send_request(dest, Kind.REMOTE, payload, what, timeout, extra=extra)
    return RRef._user(agent, dest.id, rref_id, fork_id, confirmation(p.future), confirmed=True)


def _fail_unset(value: torch.futures.Future, creation: torch.futures.Future) -> None:
    """A remote call to ourselves that failed before running (timeout, shutdown)
    fails the owner RRef's value too."""
    if not value.done():
        try:
            creation.wait()
        except BaseException as e:  # noqa: BLE001
            if not value.done():
                fail(value, e)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """WorkerInfo of ``worker_name``, or of this worker when omitted.

    Example::

        >>> rpc.get_worker_info("worker1").id
        1
    """
    agent = current_agent()
    if worker_name is None:
        return agent.info
    return agent.resolve(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds.

    Example::

        >>> rpc.get_rpc_timeout()
        60.0
    """
    return current_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout of calls, in seconds (0: no timeout).

    Example::

        >>> rpc._set_rpc_timeout(5)
    """
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0, got {rpc_timeout}")
    current_agent().rpc_timeout = float(rpc_timeout)


def is_available() -> bool:
    """True: distgrad's RPC is always built."""
    return True
