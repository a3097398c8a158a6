"""The layout of ids that must be unique across a cluster without talking.

torch's layout: an autograd context id or message id is the creating worker's
id in the top 16 bits and a counter in the low 48; an RRef id (and a fork id)
is ``(worker id, counter)`` with the same 48-bit counter.

In a dynamic group one rank is held by many processes one after another (its
incarnations, counted by the member table: see :mod:`distgrad.rpc.membership`).
Each incarnation numbers in its own slice of the 48-bit counter: the top
``INCARNATION_BITS`` of it are the incarnation (less one), the low
``SLICE_BITS`` count, so no id of incarnation k is ever one of incarnation j's.
A rank has ``MAX_INCARNATIONS`` incarnations; the table refuses a join past
them (:class:`~distgrad.errors.IncarnationsExhaustedError`). A static group's
worker is the only process under its rank: it numbers over the whole counter.

Example::

    >>> counter_range(1), counter_range(2)[0] == 1 << SLICE_BITS
    ((0, 1099511627776), True)
    >>> counter_range(None) == (0, 1 << COUNTER_BITS)
    True
"""
from __future__ import annotations

from typing import Any

WORKER_BITS = 16
COUNTER_BITS = 48
COUNTER_MASK = (1 << COUNTER_BITS) - 1
INCARNATION_BITS = 8
SLICE_BITS = COUNTER_BITS - INCARNATION_BITS
MAX_INCARNATIONS = 1 << INCARNATION_BITS


def counter_range(incarnation: int | None) -> tuple[int, int]:
    """``(first, end)`` of the counters incarnation ``incarnation`` (1-based) of a
    dynamic group's rank numbers from; None (a static group's worker): all of them.

    Raises ValueError for an incarnation outside ``1..MAX_INCARNATIONS``."""
    if incarnation is None:
        return 0, 1 << COUNTER_BITS
    if not 1 <= incarnation <= MAX_INCARNATIONS:
        raise ValueError(f"incarnation {incarnation} is outside 1..{MAX_INCARNATIONS} "
                         f"({INCARNATION_BITS} bits of the {COUNTER_BITS}-bit id counter)")
    first = (incarnation - 1) << SLICE_BITS
    return first, first + (1 << SLICE_BITS)


def agent_range(agent: Any) -> tuple[int, int]:
    """The counter range of this process's ids: its incarnation's slice in a
    dynamic group, the whole counter in a static one."""
    return counter_range(getattr(agent, "incarnation", 1) if getattr(agent, "dynamic", False) else None)
