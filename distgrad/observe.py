"""What the lower floors tell the tracer: one observer slot and the trace clock.

The tracer (:mod:`distgrad.trace`) sits above RPC and distributed autograd; they
never import it. Instead, where they start a span (once per backward run or
region, optimizer step or RRef fork, never per message) they read :data:`ACTIVE`
here: ``None`` while no trace is open on this worker, else the open trace's
recorder, which :mod:`distgrad.trace.session` puts in the slot when the trace
starts and takes out when it stops. An observer has two methods:

* ``span(name, category, t0_ns, args)``: something that began at ``t0_ns`` (read
  with :func:`local_ns`) ended now;
* ``instant(name, category, args)``: something happened now.

Every event is stamped with :func:`local_ns`, this worker's trace clock
(``time.perf_counter_ns``; ``DISTGRAD_TRACE_SKEW_NS`` or :func:`_set_skew_ns`
shifts it by a known amount, the tests' way to check the merge of workers'
clocks, :mod:`distgrad.trace.clock`).

Example (what the backward does around one run)::

    >>> from distgrad import observe
    >>> tr = observe.ACTIVE
    >>> t0 = observe.local_ns() if tr is not None else 0
    >>> ...  # the run
    >>> if tr is not None:
    ...     tr.span("backward run", "backward", t0, {"pass": "0:1"})
"""
from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["ACTIVE", "local_ns"]

#: the observer of this worker (the recorder of the trace open here), or None
ACTIVE: Any = None

_SKEW = [int(os.environ.get("DISTGRAD_TRACE_SKEW_NS", "0") or 0)]


def local_ns() -> int:
    """This worker's trace clock, in nanoseconds (shifted by the test skew, if any).

    Example::

        >>> t0 = local_ns(); t1 = local_ns()
        >>> t1 >= t0
        True
    """
    return time.perf_counter_ns() + _SKEW[0]


def _set_skew_ns(ns: int) -> None:
    """Tests only: shift this process's trace clock by ``ns`` nanoseconds."""
    _SKEW[0] = int(ns)
