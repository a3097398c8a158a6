"""An all-gather over RPC, as torch's ``rpc.api._all_gather`` does it.

The leader is the smallest worker name of the group. Followers send their
object to it (``gather``), it waits until it holds every member's, then sends
the whole map to each follower (``broadcast``). The RPC targets are passed in
by :mod:`.api`, whose module-level names travel in the calls, so that code
patching ``rpc.api._broadcast_to_followers`` (as torch's tests do) is obeyed.

Unlike torch, a member found lost does not make the others wait forever: the
leader goes on with the members still alive and a follower whose leader is
lost stops waiting; both then raise :class:`WorkerLostError`.

Example::

    >>> rpc.api._all_gather(rpc.get_worker_info().id)   # on every worker
    {'worker0': 0, 'worker1': 1}
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import WorkerLostError
from .options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

_POLL = 0.05  # s: how often a waiting member looks for lost workers


class _States:
    def __init__(self) -> None:
        self.gathered_objects: dict[str, Any] = {}
        self.proceed_signal = threading.Event()


_lock = threading.RLock()
_sequence: dict[str, int] = {}
_states: collections.defaultdict = collections.defaultdict(_States)
_all_names: set[str] = set()


def set_members(names: set[str]) -> None:
    """The names of every worker (the default group); set at init."""
    global _all_names
    _all_names = set(names)


def gather(sequence_id: str, worker_name: str, obj: Any, worker_names: Any = None) -> None:
    """Runs on the leader: record ``worker_name``'s object for ``sequence_id``."""
    with _lock:
        if not worker_names:
            worker_names = _all_names
            if worker_name not in worker_names:
                raise AssertionError(f"{worker_name} is not expected by leader.")
        states = _states[sequence_id]
        if worker_name in states.gathered_objects:
            raise AssertionError(f"{worker_name} reported intent sequence id {sequence_id} twice. ")
        states.gathered_objects[worker_name] = obj
        if set(worker_names) == set(states.gathered_objects):
            states.proceed_signal.set()


def broadcast(sequence_id: str, objects_map: dict) -> None:
    """Runs on a follower: the leader's complete map for ``sequence_id``."""
    with _lock:
        states = _states[sequence_id]
    if states.proceed_signal.is_set():
        raise AssertionError(f"Termination signal sequence id {sequence_id} got set twice.")
    states.gathered_objects = objects_map
    states.proceed_signal.set()


def all_gather(agent: Any, obj: Any, worker_names: Any, timeout: float, rpc_sync: Callable,
               rpc_async: Callable, gather_fn: Callable, broadcast_fn: Callable) -> dict:
    """See :func:`distgrad.rpc.api._all_gather`; ``gather_fn``/``broadcast_fn``
    are what the calls run on the leader and on the followers."""
    names = set(worker_names) if worker_names else {w.name for w in agent.get_worker_infos()}
    leader = min(names)
    me = agent.name
    with _lock:
        key = "".join(sorted(names))
        n = _sequence.get(key, 0)
        _sequence[key] = n + 1
        sequence_id = key + str(n)
    if timeout == UNSET_RPC_TIMEOUT:
        rpc_timeout, signal_timeout = agent.rpc_timeout, None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, signal_timeout = timeout, None
    else:
        rpc_timeout = signal_timeout = timeout
    try:
        sent = None
        if leader == me:
            gather(sequence_id, me, obj, names)
        else:
            # The leader's broadcast proves it got our object: its reply to this call
            # is not needed (only its error is), so a lost reply cannot hang us.
            sent = rpc_async(leader, gather_fn, args=(sequence_id, me, obj, names), timeout=rpc_timeout)
        with _lock:
            states = _states[sequence_id]
        missing = _wait(agent, states, names, leader, signal_timeout, sent)
        if sent is not None and not sent.done() and hasattr(agent, "abandon"):
            agent.abandon(sent, f"the leader {leader} sent the all-gather's result before its reply")
        if leader == me:
            _send_to_followers(agent, states, names - {leader} - missing, sequence_id, rpc_timeout,
                               rpc_async, broadcast_fn)
            if missing:
                raise WorkerLostError(f"_all_gather on {me}: workers {sorted(missing)} are lost")
    finally:
        with _lock:
            states = _states.pop(sequence_id, None)
    return states.gathered_objects if states is not None else {}


def _wait(agent: Any, states: _States, names: set, leader: str, timeout: float | None,
          sent: Any = None) -> set:
    """Wait for the signal; returns the members given up on as lost (leader only).
    ``sent``: a follower's call to the leader, whose error ends the wait."""
    # As torch, the signal's timeout runs once the leader answered the call.
    deadline = None if timeout is None or sent is not None else time.monotonic() + timeout
    while True:
        step = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
        if states.proceed_signal.wait(step):
            return set()
        if sent is not None and sent.done():
            sent.wait()  # raises the call's error; a success just means "wait on"
            sent = None
            deadline = None if timeout is None else time.monotonic() + timeout
        if deadline is not None and time.monotonic() >= deadline:
            return set()  # as torch: go on with what arrived
        lost = {agent.workers[r].name for r in list(agent.lost) if r in agent.workers}
        if leader == agent.name:
            with _lock:
                missing = names - set(states.gathered_objects)
            if missing and missing <= lost:
                return missing
        elif leader in lost:
            raise WorkerLostError(f"_all_gather on {agent.name}: the leader {leader} is lost", leader)


def _send_to_followers(agent: Any, states: _States, followers: set, sequence_id: str,
                       rpc_timeout: float, rpc_async: Callable, broadcast_fn: Callable) -> None:
    futs = {name: rpc_async(name, broadcast_fn, args=(sequence_id, states.gathered_objects),
                            timeout=rpc_timeout)
            for name in followers}
    errors, crashed = [], []
    for name, fut in futs.items():
        if not _await_reply(agent, name, fut):
            if hasattr(agent, "abandon"):
                agent.abandon(fut, f"{name} went on to shut down before its reply to the "
                                   "all-gather arrived")
            continue
        try:
            fut.wait()
        except WorkerLostError as e:
            # a follower that crashed is given up on (the caller decides); one that
            # left on purpose without answering failed the all-gather, as in torch
            rank = agent.by_name[name].id if name in getattr(agent, "by_name", ()) else None
            if rank in getattr(agent, "shutdown_arrivals", ()):
                continue  # it had the result and went on to shut down
            (errors if rank in getattr(agent, "left", ()) else crashed).append((name, e))
        except RuntimeError as e:
            errors.append((name, e))
    if crashed and not errors:
        raise WorkerLostError(f"_all_gather: followers {[c[0] for c in crashed]} are lost")
    errors += crashed
    if errors:
        raise RuntimeError(f"Followers {[e[0] for e in errors]} timed out in _all_gather after "
                           f"{rpc_timeout:.2f} seconds. The first exception is {errors[0][1]}")


def _await_reply(agent: Any, name: str, fut: Any) -> bool:
    """Wait for a follower's reply to the broadcast; False when, instead, the
    follower announced that it went on to shut down (it had the broadcast, and
    its reply may be lost or still on its way)."""
    done = threading.Event()
    fut.add_done_callback(lambda f: done.set())
    rank = agent.by_name[name].id if name in getattr(agent, "by_name", ()) else None
    while not done.wait(_POLL):
        if rank is not None and rank in getattr(agent, "shutdown_arrivals", ()):
            return False
    return True
