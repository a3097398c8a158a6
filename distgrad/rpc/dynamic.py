"""Joining and leaving a dynamic group (``init_rpc`` without ``world_size``);
the table in the store is :mod:`.membership`'s.

Joining: take a rank in the table, listen and publish the address (a lease in
the store says the joiner lives meanwhile), connect to every member listed (each admits
the connection after reading the joiner's entry, so it knows the joiner's name
before anything the joiner sends), then one call to each member: when
``init_rpc`` returns, every member lists the joiner in ``get_worker_infos()``.

Leaving (``shutdown()``): tell every member ("leaving"); each stops sending it
new calls (they fail at once with WorkerLostError) and answers; every call
sent before the answer has arrived by then. Wait for the calls to and from
this worker to finish, release the RRefs held here, leave the table, say
goodbye: the members take it out of the group. A member that crashes is taken
out by the survivors (see ``RpcAgent.on_peer_lost``).

Example::

    >>> dynamic.start(store, "trainer3", None, make_transport, "10.0.0.5", opts, timeout=60)
    >>> dynamic.leave(current_agent(), time.monotonic() + 60)
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import DistgradError, WorkerLostError
from ..launch import keeper
from . import collective, devices
from .agent import RpcAgent, _holder
from .membership import Group, Lease
from .worker_info import WorkerInfo

log = logging.getLogger(__name__)
# Stores this process hosts for dynamic groups it left: kept until the process exits
# (as torch's rank 0 keeps its store), since a member may still be on its way in
_kept_stores: list = []


def hello(entry: dict | None = None) -> Any:
    """What a joiner calls on every member once connected (see the module docstring):
    with the joiner's device entry, the member answers with its own (its device maps,
    :mod:`.devices`)."""
    if entry is None:
        return True
    from .pending import current_agent
    return devices.local_entry(current_agent().options)


def start(store: Any, name: str, rank: int | None, make_transport: Any, host: str, opts: Any,
          timeout: float, hosts_store: bool = False, seal: Any = None) -> RpcAgent:
    """Join the dynamic group on ``store``; install and start this process's agent
    (``make_transport(rank)`` builds its transport once the rank is known; ``seal``
    checks the table's entries, see :mod:`distgrad.launch.sealed`)."""
    group = Group(store, timeout, seal)
    # a crashed member is out of the table within its heartbeat limit (at once when
    # its connections closed): a replacement that starts sooner waits that long
    limit = getattr(opts, "heartbeat_limit", None) or opts.heartbeat_deadline
    rank, incarnation, others = group.join(name, rank, wait=2 * limit + 2)
    transport = None
    try:
        with Lease(group, rank, time.monotonic() + timeout):  # alive while it gets ready
            transport = make_transport(rank)
            group.publish(rank, incarnation, transport.listen(host))
        others = group.addresses(others, time.monotonic() + timeout)
        workers = [WorkerInfo(n, r) for r, (n, _, _) in sorted(others.items())]
        workers.append(WorkerInfo(name, rank))
        agent = RpcAgent(name, rank, None, sorted(workers, key=lambda w: w.id), transport, opts,
                         incarnation=incarnation)
        devices.install(agent, *devices.own_maps(opts))   # until the members' maps are known
        agent.incarnations = {r: i for r, (_, _, i) in others.items()}
        agent.incarnations[rank] = incarnation
        agent.group, agent.store, agent.hosts_store = group, store, hosts_store
        agent.leave_acks = set()
        agent.control_handlers["leaving"] = lambda peer: _on_leaving(agent, peer)
        agent.control_handlers["leave_ack"] = lambda peer: agent.leave_acks.add(peer)
        agent.members_changed = lambda: collective.set_members(set(agent.by_name))

        def admit(peer: int) -> str | None:  # a handshake thread: the store may be read
            entry = group.entry(peer)
            if entry is None:
                return None
            n, addr, inc = entry
            if inc <= agent.incarnations.get(peer, 0) and (peer in agent.lost or peer in agent.workers):
                return None  # listed still, but that process is the one that was lost
            agent.admitted[peer] = (WorkerInfo(n, peer), inc)
            return addr

        def listed(peer: int) -> bool:
            entry = group.entry(peer)
            return entry is not None and entry[2] == others[peer][2]

        _holder["agent"] = agent
        collective.set_members(set(agent.by_name))
        agent.start({r: a for r, (_, a, _) in others.items()}, admit=admit, listed=listed)
        connected = getattr(transport, "_peers", set(others))
        for r in others:
            if r not in connected:  # it left while this worker joined
                agent.remove_member(r)
        # each member answers with its device maps: the joiner checks them all with its own
        entry = devices.local_entry(opts)
        futures = {r: agent.call(r, hello, (entry,), {}, timeout, sync=False)
                   for r in others if r in connected}
        entries = {}
        for r, fut in futures.items():
            try:
                entries[agent.workers[r].name] = fut.wait()
            except WorkerLostError:
                pass  # it left or crashed meanwhile: the loss took it out
        devices.join_dynamic(agent, opts, entries, timeout)
        log.info("worker %s joined the dynamic group as rank %d (incarnation %d) with %d members",
                 name, rank, incarnation, len(agent.by_name))
        return agent
    except BaseException:
        _holder.pop("agent", None)
        if transport is not None:
            transport.close(0)
        try:
            group.timeout = min(group.timeout, 2.0)  # best effort: the table may be what failed
            group.leave(rank, incarnation)
        except Exception:  # noqa: BLE001 - the join's error is the one to raise
            pass
        raise


def _on_leaving(agent: RpcAgent, peer: int) -> None:
    """Control handler (reading thread): ``peer`` leaves; send it nothing new. It is
    no longer listed from here on, so that when its ``shutdown()`` returns (it waits
    for every member's answer) no member lists it."""
    agent.leaving.add(peer)
    agent.remove_member(peer, "left")
    agent.send_control(peer, "leave_ack")


def leave(agent: RpcAgent, deadline: float, release_rrefs: Any, check_leak: bool = False) -> None:
    """The graceful part of a dynamic member's shutdown (see the module docstring)."""
    peers = [w.id for w in agent.get_worker_infos() if w.id != agent.rank]
    for peer in peers:
        agent.send_control(peer, "leaving")
    while not all(p in agent.leave_acks or p in agent.lost for p in peers):
        if time.monotonic() >= deadline:
            log.warning("worker %s: members %s did not answer its leaving", agent.name,
                        [p for p in peers if p not in agent.leave_acks and p not in agent.lost])
            break
        time.sleep(0.001)
    while not agent.idle() and time.monotonic() < deadline:
        time.sleep(0.002)
    if not agent.idle():
        log.warning("worker %s: left with %d calls pending", agent.name, len(agent.pending))
    release_rrefs()
    owned = agent.rrefs.debug_info()
    leak = None
    if owned["num_owner_rrefs"]:
        leak = (f"Leaking RRef on worker {agent.name}: it leaves the group owning "
                f"{owned['num_owner_rrefs']} RRefs other members still hold (their uses will raise "
                "WorkerLostError)")
        log.log(logging.ERROR if check_leak else logging.INFO, "%s", leak)
    try:
        agent.group.leave(agent.rank, agent.incarnation)
        if agent.hosts_store:
            _kept_stores.append(agent.store)
            keeper.pin(agent.store)   # its process too, if it has one (launch/keeper.py)
            # the store lives in this process: the others must be out of the table first
            if not agent.group.wait_empty(agent.rank, deadline, lost=agent.lost):
                log.warning("worker %s hosts the group's store and leaves before members %s",
                            agent.name, sorted(set(agent.group.members()) - {agent.rank}))
    except Exception as e:  # noqa: BLE001 - a store that is gone must not make shutdown hang
        log.warning("worker %s: could not leave the group's table: %s", agent.name, e)
    if leak is not None and check_leak:
        raise DistgradError(leak, agent.name)


def untable(agent: RpcAgent) -> None:
    """A non-graceful shutdown: leave the table at least (best effort)."""
    try:
        agent.group.leave(agent.rank, agent.incarnation)
    except Exception as e:  # noqa: BLE001
        log.info("worker %s: could not leave the group's table: %s", agent.name, e)
