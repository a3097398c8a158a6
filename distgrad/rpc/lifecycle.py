"""Starting and stopping this process's agent (the parts of init_rpc and
shutdown below torch's API; see :mod:`.api`). A static group's worker is in
the store's ledger of static members while it runs (:mod:`.mixing`).

Example::

    >>> lifecycle.start_agent(store, "worker0", 0, 2, opts, "127.0.0.1")
    >>> agent = current_agent()
    >>> lifecycle.join(agent, time.monotonic() + 60)
    >>> lifecycle.finalize_shutdown(agent, graceful=True)
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

from ..errors import DistgradError
from ..launch import keeper, rendezvous
from ..transport import SocketTransport, netaddr
from ..transport.auth import secret_from_env
from ..transport.faults import FaultyTransport, config_from
from ..wire.messages import Kind, peek_header
from . import c10d_order, collective, devices, dynamic, extensions, membership, mixing, remote_profiling
from .agent import RpcAgent, _holder, _qualname
from .options import RpcBackendOptions
from .worker_info import WorkerInfo

log = logging.getLogger(__name__)


def _peek_kind(frames: Any) -> int:
    """A message's kind, read from its header frame (fault injection's view of it)."""
    return peek_header(frames)[0]


#: the longest DISTGRAD_RENDEZVOUS_TIMEOUT taken (about 31 years): the store's and the
#: threads' waits cannot hold much more (1e300 overflowed a C int)
MAX_RDV_TIMEOUT = 1e9


def _detector_options(opts: Any) -> dict:
    """The failure detector's options (an options object made before they existed,
    or by a subclass that skipped them, gets the defaults)."""
    out = {}
    for name in ("heartbeat_limit", "heartbeat_phi"):
        value = getattr(opts, name, None)
        if value is not None:
            out[name] = value
    return out


def rdv_timeout(opts: RpcBackendOptions) -> float:
    """How long init_rpc waits for the other workers: ``DISTGRAD_RENDEZVOUS_TIMEOUT``
    (seconds, finite, above 0 and at most :data:`MAX_RDV_TIMEOUT`; anything else
    raises ValueError naming the variable and the value) where set, else the call
    timeout, but at least a minute (workers start at different times; a loaded
    machine is slow).

    Example::

        >>> rdv_timeout(rpc.TensorPipeRpcBackendOptions(rpc_timeout=20))
        60.0
    """
    env = os.environ.get("DISTGRAD_RENDEZVOUS_TIMEOUT")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not 0 < value <= MAX_RDV_TIMEOUT:   # (nan, inf and 1e400 too)
            raise ValueError(f"DISTGRAD_RENDEZVOUS_TIMEOUT must be a finite number of seconds above 0 "
                             f"(at most {MAX_RDV_TIMEOUT:.0e}), not {env!r}")
        return value
    return max(opts.rpc_timeout, 60.0) if opts.rpc_timeout > 0 else 300.0


def start_agent(store: Any, name: str, rank: int | None, world_size: int | None,
                opts: RpcBackendOptions, default_host: str | None, hosts_store: bool = False) -> None:
    """Listen, meet the other workers through ``store``, install the agent (so
    that it is current before anything can reach it), then start the transport.
    ``world_size`` None joins a dynamic group (see :mod:`.dynamic`)."""
    timeout = rdv_timeout(opts)
    try:  # an address the other hosts reach: see transport/netaddr.py
        host = netaddr.listen_address(opts.listen_addr, default_host or os.environ.get("MASTER_ADDR"))
    except DistgradError as e:
        raise DistgradError(f"worker {name}: cannot choose an address to listen on: {e}", name) from None
    from_env = secret_from_env()  # read (and taken out of os.environ) in any case
    secret = opts.secret or from_env
    if secret is None:
        # once per cluster (rank 0 speaks for it), not once per worker: the others log it at INFO
        log.log(logging.WARNING if rank == 0 else logging.INFO,
                "worker %s: no cluster secret (DISTGRAD_SECRET): messages between the %s (and "
                "their entries in the rendezvous store) are not authenticated and anyone who can "
                "connect can run code on them", name,
                f"{world_size} workers" if world_size else "dynamic group's members")

    def make_transport(rank: int):
        faults = config_from(opts)
        encrypt = getattr(opts, "encrypt", False)
        if faults is not None:  # tests only: see distgrad/transport/faults.py
            return FaultyTransport(rank, opts.heartbeat_interval, opts.heartbeat_deadline,
                                   opts.max_message_size, secret=secret, faults=faults, encrypt=encrypt,
                                   num_threads=opts.num_worker_threads, kinds=Kind, peek_kind=_peek_kind,
                                   **_detector_options(opts))
        return SocketTransport(rank, opts.heartbeat_interval, opts.heartbeat_deadline,
                               opts.max_message_size, secret=secret, encrypt=encrypt,
                               num_threads=opts.num_worker_threads, **_detector_options(opts))

    # nothing read from the store is unpickled; with a secret nothing unsealed is believed
    seal = rendezvous.store_seal(store, secret, name)
    if world_size is None:
        try:
            agent = dynamic.start(store, name, rank, make_transport, host, opts, timeout, hosts_store,
                                  seal)
        except BaseException:
            remote_profiling.detach()
            raise
        remote_profiling.attach(agent.rank)
        c10d_order.attach()
        return
    transport = make_transport(rank)
    raw, slot = store, None
    try:
        address = transport.listen(host)
        # in the ledger first, then the check: a dynamic joiner that starts at the same
        # time checks the ledger once in its table, so one of the two sees the other
        slot = mixing.count_in(store, name, address, seal)
        membership.check_static_join(store, name, seal)
        store, prefix = rendezvous.session(store, rank)  # this init_rpc's keys only
        # the device maps travel with the addresses, and are checked by every worker
        peers, bound = rendezvous.exchange(store, rank, world_size, name, address, timeout, seal,
                                           prefix, devices=devices.local_entry(opts))
        maps, reverse, devs = devices.exchanged(name, [p[0] for p in peers], [p[2] for p in peers],
                                                opts)
        workers = [WorkerInfo(n, r) for r, (n, *_) in enumerate(peers)]
        agent = RpcAgent(name, rank, world_size, workers, transport, opts)
        devices.install(agent, maps, reverse, devs)
        # the shutdown barrier's flags are sealed for this rendezvous, under this prefix
        agent.store, agent.session_seal, agent.session_prefix = store, bound, prefix
        agent.static_store, agent.static_slot, agent.static_seal = raw, slot, seal
        agent.shutdown_arrivals = set()  # ranks that announced their shutdown (see shutdown)
        agent.control_handlers["shutdown_arrived"] = lambda peer: agent.shutdown_arrivals.add(peer)
        # Installed before the transport accepts anything: a request that arrives
        # at once must find this worker ready (current_agent() works in it).
        _holder["agent"] = agent
        collective.set_members({w.name for w in workers})
        remote_profiling.attach(rank)
        c10d_order.attach()
        agent.start({r: a for r, (_, a, *_) in enumerate(peers) if r != rank})
    except BaseException:
        _holder.pop("agent", None)
        remote_profiling.detach()
        c10d_order.detach()
        transport.close(0)
        if slot is not None:
            _uncount(raw, slot, seal)
        raise


def _uncount(store: Any, slot: int, seal: Any) -> None:
    try:
        mixing.count_out(store, slot, seal)
    except Exception:  # noqa: BLE001 - the store's host may be gone
        pass


def _leave_ledger(agent: RpcAgent) -> None:
    """Mark this static member's ledger entry out (:mod:`.mixing`), once."""
    static_store = getattr(agent, "static_store", None)
    if static_store is not None:
        agent.static_store = None
        _uncount(static_store, agent.static_slot, agent.static_seal)


def join(agent: RpcAgent, deadline: float, check_leak: bool = False) -> None:
    """Wait for outstanding work, then for every worker not lost (the barrier).

    With ``check_leak``, raise "Leaking RRef" (after the barrier) when values
    owned here are still referenced once every peer's releases were handled:
    checked before the barrier, since peers leave (and their forks are dropped
    as lost) once it completes.
    """
    while not agent.idle() and time.monotonic() < deadline:
        time.sleep(0.002)
    if not agent.idle():
        log.warning("worker %s: shutdown timed out with %d calls pending", agent.name, len(agent.pending))
    # Arrivals are announced to the peers too (after this worker's RRef releases, on
    # the same connections), so that the survivors still meet when the store's host
    # (rank 0) is gone, and so that a worker that heard every arrival has also
    # handled every release sent to it.
    for peer in range(agent.world_size):
        if peer != agent.rank:
            agent.send_control(peer, "shutdown_arrived")
    leak = rref_leak(agent, deadline) if check_leak else None
    # Out of the static ledger before the barrier: after it, rank 0 (the store's
    # host) may exit at once, and a store call then fails loudly (TCPStore prints a
    # C++ stack trace, issue 34). Nobody needs the entry once this worker leaves.
    _leave_ledger(agent)
    store_timeout = agent.store.timeout
    try:
        # Bound every store operation too: the store's host (rank 0) may be gone or
        # stopped, and a store call would then wait for its timeout.
        agent.store.set_timeout(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        rendezvous.barrier(agent.store, "shutdown", agent.rank, agent.world_size,
                           max(0.1, deadline - time.monotonic()), lost=lambda: set(agent.lost),
                           seal=agent.session_seal, prefix=agent.session_prefix)
    except Exception as e:  # a lost peer must not make shutdown hang or fail
        log.info("worker %s: shutdown barrier on the store failed (%s); waiting for the "
                 "survivors' announcements", agent.name, e)
        if not await_arrivals(agent, deadline):
            log.warning("worker %s: shutdown barrier incomplete: %s", agent.name, e)
    finally:
        # The store may be a process group's too (_init_rpc_backend): leave it as found.
        agent.store.set_timeout(store_timeout)
    if leak is not None:
        raise DistgradError(leak, agent.name)


def rref_leak(agent: RpcAgent, deadline: float) -> str | None:
    """What this worker still owns for others once every peer's releases arrived."""
    await_arrivals(agent, min(deadline, time.monotonic() + 30))
    owned = agent.rrefs.debug_info()
    if owned["num_owner_rrefs"] or owned["num_pending_users"]:
        return (f"Leaking RRef on worker {agent.name}: {owned['num_owner_rrefs']} owner RRefs still "
                f"forked, {owned['num_pending_users']} user RRefs unconfirmed at shutdown")
    return None


def finalize_shutdown(agent: RpcAgent, graceful: bool) -> None:
    try:
        agent.shutting_down = True
        for end in extensions.SHUTDOWN_END:  # e.g. a trace still recorded here stops: nobody can close it now
            try:
                end()
            except Exception:
                log.exception("worker %s: a shutdown hook (%s) failed", agent.name, _qualname(end))
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
    finally:
        # (graceful=False leaves the ledger entry as a crash does: rank 0, the store's
        # host, may be gone already, and a store call would fail loudly; a dynamic
        # joiner finds nobody listening at the entry's address and marks it out)
        store = agent.store   # (prefixed, or a dynamic group's own)
        agent.static_store = None
        # Let go of the store: on rank 0 its server closes once nothing else in this
        # process (a process group on the same port) holds it; its own process (see
        # launch/keeper.py) exits unless a process group shares it.
        agent.store = None
        if store is not None:
            keeper.let_go(store)
        _holder.pop("agent", None)
        remote_profiling.detach()
        c10d_order.detach()


def await_arrivals(agent: RpcAgent, deadline: float) -> bool:
    """Wait until every peer not lost announced its shutdown; False on the deadline."""
    while True:
        lost, arrived = set(agent.lost), agent.shutdown_arrivals
        if all(p in lost or p in arrived for p in range(agent.world_size) if p != agent.rank):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
