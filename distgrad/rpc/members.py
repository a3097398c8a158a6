"""A dynamic group's members, as the agent keeps them (an agent mixin; the
state lives on the agent: ``workers`` every rank ever seen, ``by_name`` the
members now, ``departed``, ``incarnations``, ``events``). Joining and leaving
themselves are :mod:`.dynamic`'s; the table in the store :mod:`.membership`'s.

Example::

    >>> agent.add_member(WorkerInfo("trainer2", 2), incarnation=2)
    >>> agent.remove_member(2, "lost")
"""
from __future__ import annotations

import logging
import time

from ..errors import WorkerLostError
from . import devices
from .worker_info import WorkerInfo

log = logging.getLogger("distgrad.rpc.agent")


class Members:
    """Adding and removing members; the WorkerLostError for a name that left."""

    def add_member(self, info: WorkerInfo, incarnation: int = 1) -> None:
        """A member joined (a new process, perhaps under a former member's name and
        rank): nothing of an earlier incarnation under this rank applies to it."""
        old = self.workers.get(info.id)
        if old is not None and self.by_name.get(old.name) is old and old.name != info.name:
            del self.by_name[old.name]
        self.workers[info.id] = info
        self.incarnations[info.id] = incarnation
        self.by_name[info.name] = info
        self.departed.pop(info.name, None)
        self.lost.pop(info.id, None)
        self.left.discard(info.id)
        self.leaving.discard(info.id)
        self._seen_rids.pop(info.id, None)  # its request ids start over
        self.world_size = len(self.by_name)
        self.events.append((time.time(), "joined", info.name, info.id, incarnation))
        self.members_changed()

    def remove_member(self, rank: int, how: str = "left") -> None:
        """A member left or was lost: it is no longer one (get_worker_infos, names)."""
        info = self.workers.get(rank)
        if info is not None and self.by_name.get(info.name) is info:
            del self.by_name[info.name]
            self.departed[info.name] = rank
            devices.forget(self, info.name)
            self.events.append((time.time(), how, info.name, rank, self.incarnations.get(rank, 1)))
        self.world_size = len(self.by_name)
        self.members_changed()

    def members_changed(self) -> None:
        """Called when a member joined or left (a dynamic group's lifecycle sets it)."""

    def _check_departed(self, name: str) -> None:
        """A name of a member that left or was lost: WorkerLostError naming it."""
        rank = self.departed.get(name)
        if rank is not None:
            raise WorkerLostError(f"worker {name} (rank {rank}) is no longer a member of the group: "
                                  f"{self.lost.get(rank, 'it left')}", name)

    def on_peer_joined(self, peer: int) -> None:
        """The transport accepted a member that joins (dynamic groups): the
        admission looked its entry up in the table (see dynamic.start)."""
        entry = self.admitted.pop(peer, None)
        if entry is not None:
            self.add_member(*entry)

    def _untable(self, peer: int, incarnation: int | None) -> None:
        try:
            if incarnation is not None and self.group.leave(peer, incarnation):
                log.info("worker %s: took lost worker %s out of the group", self.name,
                         self.workers[peer].name)
        except Exception as e:  # noqa: BLE001 - the store may be gone too
            log.warning("worker %s: could not take lost worker %d out of the group's table: %s",
                        self.name, peer, e)
