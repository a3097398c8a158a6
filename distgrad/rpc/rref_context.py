"""The owner's and the user's bookkeeping of RRefs on one worker (an agent
extension): owned values and the forks counted on them, forks held here and
awaiting their owner's confirmation, and the control messages of the protocol
(``fork_add``, ``fork_del``, ``fork_confirm``). The protocol itself is in
:mod:`.rref`'s docstring; the RRef class lives there too.

Example::

    >>> ctx = current_agent().rrefs          # the RRefContext of this worker
    >>> ctx.debug_info()["num_owner_rrefs"]
    0
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from .. import observe as _observe
from ..errors import DistgradError, WorkerLostError
from ..ids import agent_range
from . import remote_profiling
from .devices import new_future
from .extensions import AgentExtension, register_extension
from .future_errors import fail

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .agent import RpcAgent


class _Entry:
    __slots__ = ("future", "forks")

    def __init__(self, future: torch.futures.Future) -> None:
        self.future = future
        self.forks: collections.Counter = collections.Counter()  # (fork_id, child) -> count


class RRefContext(AgentExtension):
    """Per-agent RRef state: owned values, live user forks, id generation."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.owned: dict[tuple, _Entry] = {}
        self.user_forks: dict[tuple, int] = {}       # (rref_id, fork_id) -> owner, live here
        # user forks whose owner was lost -> why: never sent to a process that took its rank
        self.orphaned: dict[tuple, str] = {}
        self.unconfirmed: set[tuple] = set()          # (rref_id, fork_id) awaiting the owner
        # confirmations that overtook the message carrying their fork (a fork_confirm
        # travels sender -> owner -> here and can win): applied when the fork arrives
        self.early_confirmed: collections.OrderedDict = collections.OrderedDict()
        self.confirmed_cv = threading.Condition(threading.Lock())
        # rref_id -> [future, count of live owner-side RRef objects]: lets proxies and
        # calls reach a value owned here that no other worker holds (RRef(value)).
        self.local_owned: dict[tuple, list] = {}
        # rref_id -> value future of an owner RRef whose remote() to this worker is in flight
        self.local_targets: dict[tuple, torch.futures.Future] = {}
        # each incarnation of a rank (dynamic groups) numbers in its own slice (distgrad/ids.py)
        self._first, self._end = agent_range(agent)
        self._ids = itertools.count(self._first)
        self.lock = threading.RLock()
        agent.control_handlers.update(fork_add=self._on_fork_add, fork_del=self._on_fork_del,
                                      fork_confirm=self._on_fork_confirm)
        agent.pre_dispatch = self._pre_dispatch
        agent.remote_done = self._remote_done
        agent.rrefs = self

    def new_id(self) -> tuple:
        """A new RRef or fork id, ``(rank, counter)``: never one of another incarnation's."""
        n = next(self._ids)
        if n >= self._end:
            raise DistgradError(f"RRef ids exhausted on worker {self.agent.name} (rank "
                                f"{self.agent.rank})", self.agent.name)
        return (self.agent.rank, n)

    # -- owner side -----------------------------------------------------------
    def _entry(self, rref_id: tuple, future: torch.futures.Future | None = None) -> _Entry:
        """The owned entry of ``rref_id``, pending when unknown: a third worker's
        message about an RRef (a fork, a call on it) can overtake the remote() that
        creates it here, which comes from another worker. As torch's owner does, hold
        an unset value that the creating request fills in. Caller holds the lock."""
        entry = self.owned.get(rref_id)
        if entry is None and self._earlier(rref_id):
            raise WorkerLostError(f"RRef {rref_id} was owned by an earlier process under rank "
                                  f"{rref_id[0]} (worker {self.agent.name} now), which left or was "
                                  "lost: its value is gone", self.agent.name)
        if entry is None:
            entry = self.owned[rref_id] = _Entry(future if future is not None else new_future(self.agent))
        return entry

    def add_fork(self, rref_id: tuple, fork_id: tuple, child: int,
                 future: torch.futures.Future | None = None) -> torch.futures.Future:
        """Count a fork of ``rref_id`` held by ``child``; returns the value's future
        (``future``: the value of an RRef owned here, when it is not in the table yet)."""
        with self.lock:
            entry = self._entry(rref_id, future)
            entry.forks[(fork_id, child)] += 1
            self._gc(rref_id, entry, (fork_id, child))
        tr = _observe.ACTIVE
        if tr is not None:
            tr.instant("rref fork", "rref", self._fork_args(rref_id, fork_id, child))
        return entry.future

    def del_fork(self, rref_id: tuple, fork_id: tuple, child: int) -> None:
        with self.lock:
            entry = self._entry(rref_id)
            entry.forks[(fork_id, child)] -= 1
            self._gc(rref_id, entry, (fork_id, child))
            left = sum(entry.forks.values())
        tr = _observe.ACTIVE
        if tr is not None:
            tr.instant("rref delete", "rref", dict(self._fork_args(rref_id, fork_id, child), forks_left=left))

    def _fork_args(self, rref_id: tuple, fork_id: tuple, child: int) -> dict:
        w = self.agent.workers.get(child)
        return {"rref": f"{rref_id[0]}:{rref_id[1]}", "fork": f"{fork_id[0]}:{fork_id[1]}",
                "holder": w.name if w is not None else f"rank {child}"}

    def _gc(self, rref_id: tuple, entry: _Entry, key: tuple) -> None:
        if entry.forks[key] == 0:
            del entry.forks[key]
        if not entry.forks:
            del self.owned[rref_id]

    def _earlier(self, rref_id) -> bool:
        """An RRef of another process under this rank (an earlier one left or was
        lost, or this one is the stale one): a late fork_add/fork_del about it is
        not about anything this process owns."""
        if rref_id[0] == self.agent.rank and not self._first <= rref_id[1] < self._end:
            log.info("worker %s: ignored a message about RRef %s of another incarnation",
                     self.agent.name, rref_id)
            return True
        return False

    def _on_fork_add(self, sender: int, rref_id, fork_id, child: int) -> None:
        if self._earlier(rref_id):
            return
        self.add_fork(rref_id, fork_id, child)
        if child != self.agent.rank:
            self.agent.send_control(child, "fork_confirm", rref_id, fork_id)

    def _on_fork_del(self, sender: int, rref_id, fork_id) -> None:
        if self._earlier(rref_id):
            return
        self.del_fork(rref_id, fork_id, sender)

    def _pre_dispatch(self, peer: int, msg) -> bool:
        extra = msg.meta[2]
        local = {}
        src = extra.get("rref")
        if src is not None:
            entry = self.owned.get(src)
            if entry is None and peer == self.agent.rank:
                entry = self.local_owned.get(src)
                entry = _Entry(entry[0]) if entry is not None else None
            if entry is None:
                if src[0] == self.agent.rank:  # created here: no request can still create it
                    raise RuntimeError(f"RRef {src} is not known to its owner {self.agent.name} "
                                       "(deleted or never created)")
                with self.lock:  # its creating remote() is still on its way
                    entry = self._entry(src)
            local["source"] = entry.future
        pins = extra.get("pins")
        if pins is not None:
            local["pins"] = {}
            for rref_id in pins:
                with self.lock:  # pending if its creating remote() is still on its way
                    local["pins"][tuple(rref_id)] = self._entry(tuple(rref_id)).future
        own = extra.get("own")
        if own is not None:
            if peer != self.agent.rank or tuple(own) not in self.local_targets:
                raise RuntimeError(f"unexpected remote() target {own} from worker {peer}")
            local["target"] = self.local_targets.pop(tuple(own))
        new = extra.get("new")
        if new is not None:
            rref_id, fork_id = new
            local["target"] = self.add_fork(rref_id, fork_id, peer)
        msg.local = local
        return True

    def _remote_done(self, peer: int, msg, value: Any, exc: BaseException | None):
        fut = msg.local["target"]
        if exc is None:
            value, confirmation = remote_profiling.split_remote(value)  # a profiled remote()
            fut.set_result(value)
            return confirmation, None
        fail(fut, exc)
        return None, exc

    # -- user side ------------------------------------------------------------
    def _on_fork_confirm(self, sender: int, rref_id, fork_id) -> None:
        key = (tuple(rref_id), tuple(fork_id))
        with self.confirmed_cv:
            if key in self.unconfirmed:
                self.unconfirmed.discard(key)
                self.confirmed_cv.notify_all()
            else:  # its fork has not arrived (or not been recorded) yet, or was dropped already
                self.early_confirmed[key] = None
                while len(self.early_confirmed) > _EARLY_CONFIRMED_MAX:  # forks that never came
                    self.early_confirmed.popitem(last=False)

    def add_unconfirmed(self, key: tuple) -> None:
        """A fork that arrived from a worker other than its owner (unless the
        owner's confirmation came first)."""
        with self.confirmed_cv:
            if key in self.early_confirmed:
                del self.early_confirmed[key]
            else:
                self.unconfirmed.add(key)

    def wait_confirmed(self, key: tuple, owner: int) -> None:
        """Block until the owner confirmed fork ``key``, the owner is lost, this
        agent shuts down or the RPC timeout passed (0: no limit)."""
        agent = self.agent
        timeout = agent.rpc_timeout
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        with self.confirmed_cv:
            while key in self.unconfirmed and owner not in agent.lost and not agent.shutting_down:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return
                self.confirmed_cv.wait(left)

    def on_peer_lost(self, peer: int, reason: str) -> None:
        name = self.agent.workers[peer].name if peer in self.agent.workers else str(peer)
        for key, owner in list(self.user_forks.items()) if self.agent.dynamic else ():
            if owner == peer:  # (a static group never takes the rank again)
                self.orphaned[key] = (f"worker {name} (rank {peer}) is lost: {reason} (it owned RRef "
                                      f"{key[0]}, whose value is gone; a process that joins under its "
                                      "rank is another one)")
        with self.confirmed_cv:
            self.confirmed_cv.notify_all()  # requests waiting for that owner's confirmation
        with self.lock:
            for rref_id, entry in list(self.owned.items()):
                for key in [k for k in entry.forks if k[1] == peer]:
                    del entry.forks[key]
                if not entry.forks:
                    del self.owned[rref_id]

    def delete_all_user_rrefs(self) -> None:
        """Release every fork this worker holds (graceful shutdown)."""
        for (rref_id, fork_id), owner in list(self.user_forks.items()):
            if self.user_forks.pop((rref_id, fork_id), None) is not None:
                self.unconfirmed.discard((rref_id, fork_id))
                if self.orphaned.pop((rref_id, fork_id), None) is not None:
                    continue
                self.agent.send_control(owner, "fork_del", rref_id, fork_id)

    def debug_info(self) -> dict[str, int]:
        with self.lock:
            return {
                "num_owner_rrefs": len(self.owned),
                "num_forks": sum(sum(e.forks.values()) for e in self.owned.values()),
                "num_pending_futures": sum(1 for e in self.owned.values() if not e.future.done()),
                "num_pending_users": len(self.unconfirmed),
            }


_EARLY_CONFIRMED_MAX = 4096

register_extension(RRefContext)
