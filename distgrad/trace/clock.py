"""The clock every trace event is stamped with, and the offsets between workers'.

Every worker stamps events with :func:`local_ns` (``time.perf_counter_ns``, the
kernel's monotonic clock on Linux). The tracing worker puts the others' events on
its own clock with an offset per worker estimated the NTP way: several pings over
RPC, each giving ``remote - (sent + received) / 2``; the ping with the least
round trip wins, and half its round trip bounds the error (the remote read its
clock somewhere inside that round trip). On one host (or two network namespaces
of one host) all workers read the same kernel clock, so the estimate is near zero.

:func:`keep_causal` then moves offsets, where needed, so that no message arrives
before it was sent on the merged clock (each traced message bounds the offset
between its two workers from one side).

``DISTGRAD_TRACE_SKEW_NS`` (or :func:`_set_skew_ns`) shifts this process's clock by
a known amount: the tests' way to check that the estimate recovers a skew.

Example::

    >>> est = estimate(lambda: rpc.rpc_sync("worker1", local_ns), pings=16)
    >>> abs(est.offset_ns) <= est.error_ns + 1000      # one host
    True
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# the clock itself lives on the floor below (the backward and the RPC layer stamp their
# spans with it and never import this package); the offsets between workers are here
from ..observe import _SKEW, _set_skew_ns, local_ns  # noqa: F401


@dataclass
class Offset:
    """A worker's clock minus the tracing worker's, with its error bound (ns)."""

    offset_ns: int
    error_ns: int
    rtt_ns: int
    pings: int
    shift_ns: int = 0  # moved by keep_causal after the estimate

    def as_meta(self) -> dict:
        return {"offset_us": round(self.offset_ns / 1e3, 3), "error_us": round(self.error_ns / 1e3, 3),
                "min_rtt_us": round(self.rtt_ns / 1e3, 3), "pings": self.pings,
                "causality_shift_us": round(self.shift_ns / 1e3, 3)}


def estimate(remote_now: Callable[[], int], pings: int = 16) -> Offset:
    """NTP-style offset of the clock ``remote_now()`` reads (over RPC) from :func:`local_ns`."""
    best = None
    for _ in range(max(1, pings)):
        t1 = local_ns()
        remote = int(remote_now())
        t2 = local_ns()
        rtt = t2 - t1
        if best is None or rtt < best[0]:
            best = (rtt, remote - (t1 + t2) // 2)
    rtt, offset = best
    return Offset(offset, (rtt + 1) // 2, rtt, max(1, pings))


def keep_causal(offsets: dict[int, int], messages: Iterable[tuple[int, int, int, int]],
                fixed: int) -> dict[int, int]:
    """Offsets (worker -> its clock minus the reference's, ns) moved as little as a
    difference-constraint closure needs so that every message ``(sender, sent_ns,
    receiver, arrived_ns)`` (each on its own worker's clock) arrives no earlier than
    it was sent once both are on the reference clock. ``fixed`` (the reference)
    keeps offset 0. Offsets are only lowered (Bellman-Ford from the estimates), then
    shifted back so ``fixed`` is 0: the greatest consistent offsets below the
    estimates. Returns the new offsets; an inconsistent set (clocks that jumped)
    leaves the estimates as they were."""
    bound: dict[tuple[int, int], int] = {}
    for a, sent, b, arrived in messages:
        if a == b or a not in offsets or b not in offsets:
            continue
        d = arrived - sent  # off_b - off_a <= d
        if d < bound.get((a, b), d + 1):
            bound[(a, b)] = d
    y = dict(offsets)
    for _ in range(len(y) + 1):
        changed = False
        for (a, b), d in bound.items():
            if y[b] - y[a] > d:
                y[b] = y[a] + d
                changed = True
        if not changed:
            base = y[fixed]
            return {w: v - base for w, v in y.items()}
    return dict(offsets)
