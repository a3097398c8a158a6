"""When a silent peer is lost: a phi accrual failure detector with a floor and a ceiling.

A peer whose process ends is lost at once: its connection closes (the reading
loop sees it). This module judges the other case, a peer that stays connected
and says nothing: a frozen or stopped process, a host gone without a FIN, a
partition, or a live process that does not get to run (a busy or ``nice``d
machine, an interpreter held by a long call).

For each peer it keeps the last ``window`` silences that ended with an
authenticated message: the time from the message before to that one, counted
only when it lasted at least half a heartbeat interval (a shorter one is
traffic flowing, no news about pauses). From their mean ``m`` and standard
deviation ``s`` (at least a quarter interval), a silence of ``t`` seconds has

    phi(t) = -log10(P(a live peer stays silent longer than t))

under a normal law N(m, s) (the phi accrual detector of Hayashibara et al., as
Akka and Cassandra use it). The peer is lost once ``phi`` passes ``threshold``
(8 by default: a one in 10**8 chance that the peer was alive, by that law),
that is once it was silent for ``m + z * s`` seconds (z = 5.6 for 8). That
time is held between two bounds:

* ``floor`` (the transport's ``heartbeat_deadline``): a peer silent for less
  is never lost, whatever the history. Chosen above the longest silence a
  loaded machine showed (docs/architecture.md, "Failures").
* ``ceiling`` (``heartbeat_limit``): a peer silent for longer is lost, however
  long its past pauses were. With the check's period (half a heartbeat
  interval) this bounds the time to find a frozen worker.

Time this process itself did not run (starved, stopped) is not the peer's: the
transport moves the peer's last sign of life forward by that much.

Example::

    >>> d = PhiDetector(interval=0.5, floor=8.0, ceiling=30.0)
    >>> for _ in range(20):
    ...     d.sample(1, 0.5)
    >>> d.deadline(1)               # a quiet history: the floor decides
    8.0
    >>> d.sample(1, 7.0)            # pauses seen: the peer gets more time
    >>> d.deadline(1) > 8.0
    True
    >>> d.phi(1, 3.0) < d.threshold <= d.phi(1, 40.0)
    True
"""
from __future__ import annotations

import collections
import math

__all__ = ["HEARTBEAT_DEADLINE", "HEARTBEAT_INTERVAL", "PhiDetector", "default_limit", "z_of_phi"]

#: seconds between heartbeats on a connection that carries nothing else
HEARTBEAT_INTERVAL = 0.5
#: the floor: a peer silent for less is never lost (see docs/architecture.md, "Failures")
HEARTBEAT_DEADLINE = 10.0
DEFAULT_THRESHOLD = 8.0
DEFAULT_WINDOW = 200


def default_limit(deadline: float) -> float:
    """The ceiling when none is given: three times the floor.

    Example::

        >>> default_limit(10.0)
        30.0
    """
    return 3.0 * deadline


def _phi_of_z(z: float) -> float:
    """-log10 of the upper tail of a standard normal law at ``z`` (inf past the
    floats' range)."""
    tail = 0.5 * math.erfc(z / math.sqrt(2.0))
    return -math.log10(tail) if tail > 0.0 else math.inf


def z_of_phi(phi: float) -> float:
    """The ``z`` whose standard normal upper tail is ``10**-phi`` (by bisection).

    Example::

        >>> round(z_of_phi(8.0), 2)
        5.61
    """
    if phi <= 0:
        raise ValueError(f"the phi threshold must be > 0, got {phi!r}")
    lo, hi = -10.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if _phi_of_z(mid) < phi:
            lo = mid
        else:
            hi = mid
    return hi


class _History:
    """One peer's recent silences, with their sums kept for the mean and spread."""
    __slots__ = ("gaps", "total", "squares", "deadline")

    def __init__(self, deadline: float) -> None:
        self.gaps: collections.deque = collections.deque()
        self.total = 0.0
        self.squares = 0.0
        self.deadline = deadline


class PhiDetector:
    """Per peer: the silence after which it is lost (see the module's docstring).

    ``sample(peer, gap)`` records a silence that ended (the transport calls it
    for each one of at least ``interval / 2`` s), ``deadline(peer)`` is the
    silence that loses the peer now, ``phi(peer, silent)`` the suspicion level
    and ``describe(peer, silent)`` a line for the error that names why.

    Example::

        >>> d = PhiDetector(interval=0.5, floor=8.0, ceiling=30.0)
        >>> d.deadline(3)         # no history yet: the floor
        8.0
        >>> d.forget(3)           # a new process under that rank starts afresh
    """

    def __init__(self, interval: float, floor: float, ceiling: float,
                 threshold: float = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW) -> None:
        if not 0 < interval < floor <= ceiling:
            raise ValueError("need 0 < heartbeat interval < floor <= ceiling, got "
                             f"{interval!r}, {floor!r}, {ceiling!r}")
        if window < 2:
            raise ValueError(f"the window must hold at least 2 silences, got {window!r}")
        self.interval = float(interval)
        self.floor = float(floor)
        self.ceiling = float(ceiling)
        self.threshold = float(threshold)
        self.window = int(window)
        self.min_gap = self.interval / 2     # shorter: traffic flowing, not a sample
        self.min_sd = self.interval / 4
        self._z = z_of_phi(self.threshold)
        self._peers: dict[int, _History] = {}

    def _stats(self, h: _History) -> tuple[float, float]:
        n = len(h.gaps)
        mean = h.total / n
        var = max(0.0, h.squares / n - mean * mean)
        return mean, max(math.sqrt(var), self.min_sd)

    def sample(self, peer: int, gap: float) -> None:
        """Record a silence of ``gap`` s from ``peer`` that ended with a message."""
        h = self._peers.get(peer)
        if h is None:
            h = self._peers[peer] = _History(self.floor)
        h.gaps.append(gap)
        h.total += gap
        h.squares += gap * gap
        if len(h.gaps) > self.window:
            old = h.gaps.popleft()
            h.total -= old
            h.squares -= old * old
            if len(h.gaps) % self.window == 0:   # now and then: no drift from the sums
                h.total = math.fsum(h.gaps)
                h.squares = math.fsum(g * g for g in h.gaps)
        mean, sd = self._stats(h)
        h.deadline = min(self.ceiling, max(self.floor, mean + self._z * sd))

    def deadline(self, peer: int) -> float:
        """The silence (s) that loses ``peer`` now: between the floor and the ceiling."""
        h = self._peers.get(peer)
        return self.floor if h is None else h.deadline

    def phi(self, peer: int, silent: float) -> float:
        """The suspicion level of ``peer`` after ``silent`` s of silence (0: none)."""
        h = self._peers.get(peer)
        if h is None or not h.gaps:
            mean, sd = self.interval, self.min_sd
        else:
            mean, sd = self._stats(h)
        return max(0.0, _phi_of_z((silent - mean) / sd))

    def describe(self, peer: int, silent: float) -> str:
        """Why ``peer`` is lost after ``silent`` s, for the error message."""
        h = self._peers.get(peer)
        n = 0 if h is None else len(h.gaps)
        phi = self.phi(peer, silent)
        level = "phi > 99" if phi > 99 else f"phi {phi:.1f}"
        if n:
            mean, sd = self._stats(h)
            seen = f"its {n} last pauses: mean {mean:.2f} s, sd {sd:.2f} s"
        else:
            seen = "no pauses seen"
        return (f"no heartbeat for {silent:.1f} s ({level}, threshold {self.threshold:g}; "
                f"{seen}; lost after {self.deadline(peer):.1f} s, floor {self.floor:g} s, "
                f"limit {self.ceiling:g} s)")

    def forget(self, peer: int) -> None:
        """Drop ``peer``'s history (it left; a new process may take its rank)."""
        self._peers.pop(peer, None)
