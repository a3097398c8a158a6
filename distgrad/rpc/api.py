"""The public RPC API, with torch.distributed.rpc's names and signatures."""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..errors import DistgradError
from ..launch import rendezvous
from ..transport import ZmqTransport
from ..transport.auth import secret_from_env
from ..transport.faults import FaultyTransport, config_from
from ..wire import Kind
from .agent import RpcAgent, _holder, _qualname, agent_or_none, current_agent
from .options import BackendType, RpcBackendOptions
from .rref import RRef
from .worker_info import WorkerInfo

log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]{1,128}$")
_init_lock = threading.Lock()
# torch's default: a worker whose peers are still training waits for them; a lost
# peer (crash, silence) does not hold the barrier, so the wait is bounded by failure
# detection, not by this number.
_DEFAULT_SHUTDOWN_TIMEOUT = 100000.0


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Start this process's RPC agent and meet the other workers.

    Workers rendezvous through a torch.distributed store named by
    ``rpc_backend_options.init_method`` (``env://`` by default, reading
    MASTER_ADDR, MASTER_PORT and, when not given, RANK and WORLD_SIZE).

    Example (in each of two processes, rank 0 and 1)::

        >>> import distgrad.rpc as rpc
        >>> opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:29500")
        >>> rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rpc.shutdown()
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"Worker name must match ^[A-Za-z0-9_:-]{{1,128}}$, got {name!r}")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}")
    opts = rpc_backend_options or RpcBackendOptions()
    if not isinstance(opts, RpcBackendOptions):
        raise TypeError(f"rpc_backend_options must be TensorPipeRpcBackendOptions, got {type(opts).__name__}")
    with _init_lock:
        if agent_or_none() is not None:
            raise RuntimeError("RPC is already initialized")
        init_method, rank, world_size = rendezvous.resolve(opts.init_method, rank, world_size)
        rdv_timeout = opts.rpc_timeout if opts.rpc_timeout > 0 else 300.0
        host = opts.listen_addr or rendezvous.master_host(init_method) or "127.0.0.1"
        store = rendezvous.make_store(init_method, rank, world_size, rdv_timeout)
        secret = opts.secret or secret_from_env()
        if secret is None:
            log.warning("worker %s: no cluster secret (DISTGRAD_SECRET): messages are not "
                        "authenticated and anyone who can connect can run code here", name)
        faults = config_from(opts)
        if faults is not None:  # tests only: see distgrad/transport/faults.py
            transport = FaultyTransport(rank, opts.heartbeat_interval, opts.heartbeat_deadline,
                                        opts.max_message_size, secret=secret, faults=faults,
                                        encrypt=getattr(opts, "encrypt", False))
        else:
            transport = ZmqTransport(rank, opts.heartbeat_interval, opts.heartbeat_deadline,
                                     opts.max_message_size, secret=secret,
                                     encrypt=getattr(opts, "encrypt", False))
        try:
            address = transport.listen(host)
            peers = rendezvous.exchange(store, rank, world_size, name, address, rdv_timeout)
            workers = [WorkerInfo(n, r) for r, (n, _) in enumerate(peers)]
            agent = RpcAgent(name, rank, world_size, workers, transport, opts)
            agent.store = store
            agent.shutdown_arrivals = set()  # ranks that announced their shutdown (see shutdown)
            agent.control_handlers["shutdown_arrived"] = lambda peer: agent.shutdown_arrivals.add(peer)
            agent.start({r: a for r, (_, a) in enumerate(peers) if r != rank})
        except BaseException:
            transport.close(0)
            raise
        _holder["agent"] = agent


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop RPC on this worker.

    With ``graceful=True`` (default) it waits until every worker has finished
    its outstanding work (all call it). Workers found lost are not waited for;
    ``timeout`` (seconds; 0 means torch's default of 100000) bounds the rest.
    Returns quietly when RPC was never initialized (e.g. after a failed init).

    Example::

        >>> rpc.shutdown()
    """
    agent = agent_or_none()
    if agent is None:
        return
    timeout = timeout if timeout and timeout > 0 else _DEFAULT_SHUTDOWN_TIMEOUT
    deadline = time.monotonic() + timeout
    try:
        if graceful:
            agent.rrefs.delete_all_user_rrefs()
            while not agent.idle() and time.monotonic() < deadline:
                time.sleep(0.002)
            if not agent.idle():
                log.warning("worker %s: shutdown timed out with %d calls pending", agent.name,
                            len(agent.pending))
            # The barrier: every worker not lost must arrive. Arrivals are announced
            # to the peers too, so that the survivors still meet when the store's
            # host (rank 0) is gone.
            for peer in range(agent.world_size):
                if peer != agent.rank:
                    agent.send_control(peer, "shutdown_arrived")
            try:
                # Bound every store operation too: the store's host (rank 0) may be
                # gone or stopped, and a store call would then wait for its timeout.
                agent.store.set_timeout(timedelta(seconds=max(0.1, deadline - time.monotonic())))
                rendezvous.barrier(agent.store, "shutdown", agent.rank, agent.world_size,
                                   max(0.1, deadline - time.monotonic()),
                                   lost=lambda: set(agent.lost))
            except Exception as e:  # a lost peer must not make shutdown hang or fail
                log.info("worker %s: shutdown barrier on the store failed (%s); waiting for the "
                         "survivors' announcements", agent.name, e)
                if not _await_arrivals(agent, deadline):
                    log.warning("worker %s: shutdown barrier incomplete: %s", agent.name, e)
    finally:
        agent.shutting_down = True
        for ext in agent.extensions:
            try:
                ext.on_shutdown()
            except Exception:
                log.exception("extension failed at shutdown")
        agent.transport.close(0.5 if graceful else 0)
        for rid, p in list(agent.pending.items()):
            if agent.pending.pop(rid, None) is not None:
                agent._fail(p, DistgradError(f"RPC shut down on worker {agent.name} before "
                                             f"{p.what} completed", agent.name))
        agent.pool.shutdown(wait=graceful, cancel_futures=not graceful)
        agent.callbacks.shutdown(wait=graceful)
        _holder.pop("agent", None)


def _await_arrivals(agent: RpcAgent, deadline: float) -> bool:
    """Wait until every peer not lost announced its shutdown; False on the deadline."""
    while True:
        lost, arrived = set(agent.lost), agent.shutdown_arrivals
        if all(p in lost or p in arrived for p in range(agent.world_size) if p != agent.rank):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def rpc_sync(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float = -1) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` (name, rank or WorkerInfo) and
    return its result. ``timeout`` in seconds: -1 uses the default, 0 means none.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    return current_agent().call(to, func, args, kwargs, timeout, sync=True)


def rpc_async(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float = -1) -> torch.futures.Future:
    """Like :func:`rpc_sync` but returns a ``torch.futures.Future`` at once.

    Example::

        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut.wait()
        tensor([4., 4.])
    """
    return current_agent().call(to, func, args, kwargs, timeout, sync=False)


def remote(to: Any, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = -1) -> RRef:
    """Run ``func`` on ``to`` and return an :class:`RRef` to its result, kept there.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    agent = current_agent()
    dest = agent.resolve(to)
    return _remote_with(dest, (func, tuple(args or ()), kwargs or {}), _qualname(func), timeout, {})


def _remote_with(dest: WorkerInfo, payload: tuple, what: str, timeout: float, extra: dict) -> RRef:
    agent = current_agent()
    rref_id = agent.rrefs.new_id()
    extra = dict(extra, new=(rref_id, rref_id))
    p = agent.send_request(dest, Kind.REMOTE, payload, what, timeout, extra=extra)
    return RRef._user(agent, dest.id, rref_id, rref_id, p.future, confirmed=True)


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
    """The default timeout of calls, in seconds."""
    return current_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout of calls, in seconds (0: no timeout)."""
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0, got {rpc_timeout}")
    current_agent().rpc_timeout = float(rpc_timeout)


def is_available() -> bool:
    """True: distgrad's RPC is always built."""
    return True


def _get_debug_info() -> dict[str, Any]:
    """Agent statistics: pending calls, pool usage, messages and bytes per peer,
    the RRef context's counters, and (as torch merges them in) distributed
    autograd's ``num_autograd_contexts`` and ``num_current_backward_passes``.

    Example::

        >>> rpc._get_debug_info()["peer.worker1"]["messages_sent"]
        12
    """
    agent = current_agent()
    info = agent.debug_info()
    info.update({f"rref.{k}": v for k, v in agent.rrefs.debug_info().items()})
    for ext in agent.extensions:
        if ext is not agent.rrefs:
            info.update(ext.debug_info())
    return info


def _rref_context_get_debug_info() -> dict[str, str]:
    """torch's RRef counters, as strings like torch gives them: num_owner_rrefs,
    num_forks, num_pending_futures, num_pending_users."""
    return {k: str(v) for k, v in current_agent().rrefs.debug_info().items()}
