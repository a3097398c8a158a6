"""Traces of chosen steps of a long job: ``distgrad.trace.schedule``.

The counterpart of ``torch.profiler.schedule``: the program calls :meth:`Schedule.step`
once per training step, and the schedule opens and closes traces on its own. Its
steps, counted from 0, go ``skip_first`` steps untraced, then cycles of ``wait``
steps untraced, ``warmup`` steps traced and marked as such (the trace opens at the
warmup's first step, so what a start costs, ``profile_ops``'s above all, is paid
there), and ``active`` steps traced; ``repeat`` cycles (0: as long as the job runs).
``skip_first_wait`` (torch's meaning): when true, the first cycle's ``wait`` is
skipped (its warmup follows ``skip_first`` at once); the later cycles wait as usual.
Each cycle writes its own file: ``path`` with ``{n}`` replaced by the cycle's number,
or, without ``{n}`` and with ``repeat`` other than 1, ``trace.json`` becomes
``trace.0.json``, ``trace.1.json``, ...

Until a cycle's first traced step nothing is installed: an untraced step costs the
counting in :meth:`~Schedule.step`. Each traced step is a span on the calling
thread's track (category ``step``: ``step 7``, ``step 6 (warmup)``), like torch's
``ProfilerStep#7``. A trace that cannot start (another is open) or cannot be
written is logged and skipped: a schedule never stops the job.

Example::

    >>> sched = distgrad.trace.schedule("trace.json", wait=999, active=1)  # step 999 only
    >>> for batch in loader:
    ...     train_step(batch)
    ...     sched.step()
    >>> sched.close()
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .. import observe
from .clock import local_ns

log = logging.getLogger(__name__)

NONE, WARMUP, ACTIVE = "none", "warmup", "active"


class Schedule:
    """Opens and closes traces at the steps it is told (see the module docstring).

    Example::

        >>> with distgrad.trace.schedule("t{n}.json", wait=1, warmup=1, active=2, repeat=2) as s:
        ...     for _ in range(8):
        ...         step(); s.step()
        >>> s.written
        ['/home/me/t0.json', '/home/me/t1.json']
    """

    def __init__(self, path: str, *, wait: int = 0, warmup: int = 0, active: int = 1,
                 repeat: int = 1, skip_first: int = 0, skip_first_wait: int = 0,
                 on_trace_ready: Callable[[str], Any] | None = None, **start_kwargs: Any) -> None:
        for name, v in (("wait", wait), ("warmup", warmup), ("active", active), ("repeat", repeat),
                        ("skip_first", skip_first)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"distgrad.trace.schedule: {name} must be an int >= 0, not {v!r}")
        if active < 1:
            raise ValueError("distgrad.trace.schedule: active must be at least 1 (steps traced per cycle)")
        if not isinstance(skip_first_wait, int) or skip_first_wait < 0:   # (a bool is an int)
            raise ValueError("distgrad.trace.schedule: skip_first_wait must be a bool or an int >= 0, "
                             f"not {skip_first_wait!r}")
        _check_start_kwargs(start_kwargs)
        self.path = os.fspath(path)
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first
        self.skip_first_wait = bool(skip_first_wait)
        self.on_trace_ready, self.start_kwargs = on_trace_ready, start_kwargs
        self.step_num = 0
        self.written: list[str] = []
        self._open: int | None = None   # the cycle whose trace is open
        self._t0 = local_ns()
        self._closed = False
        self._failed: int | None = None  # a cycle whose trace did not start: not retried
        self._enter(self.phase(0))

    # -- the schedule ----------------------------------------------------------------
    def cycle(self, step: int) -> int:
        """The cycle step ``step`` falls in (before the first: -1)."""
        return -1 if step < self.skip_first else self._shifted(step) // self._period

    def _shifted(self, step: int) -> int:
        """Step ``step`` (>= skip_first) counted from the first cycle's start; with
        ``skip_first_wait``, as if that cycle's wait had already passed (torch's rule)."""
        return step - self.skip_first + (self.wait if self.skip_first_wait else 0)

    @property
    def _period(self) -> int:
        return self.wait + self.warmup + self.active

    def phase(self, step: int) -> str:
        """``"none"``, ``"warmup"`` or ``"active"``: what step ``step`` is."""
        if step < self.skip_first:
            return NONE
        s = self._shifted(step)
        if self.repeat and s // self._period >= self.repeat:
            return NONE
        mod = s % self._period
        return NONE if mod < self.wait else WARMUP if mod < self.wait + self.warmup else ACTIVE

    def path_for(self, cycle: int) -> str:
        """The file cycle ``cycle`` writes."""
        if "{n}" in self.path:
            return self.path.replace("{n}", str(cycle))
        if self.repeat == 1:
            return self.path
        root, ext = os.path.splitext(self.path)
        return f"{root}.{cycle}{ext}"

    # -- driving it --------------------------------------------------------------------
    def step(self) -> None:
        """End the current step (its span, when traced) and begin the next one: a trace
        opens at a cycle's first traced step and is written after its last."""
        if self._closed:
            raise RuntimeError("distgrad.trace.schedule: step() after close()")
        ended, now = self.step_num, self.phase(self.step_num)
        if now != NONE and self._open is not None:
            rec = observe.ACTIVE
            if rec is not None:
                rec.span(f"step {ended}" + (" (warmup)" if now == WARMUP else ""), "step", self._t0,
                         {"step": ended, "phase": now})
        self.step_num += 1
        nxt = self.phase(self.step_num)
        if self._open is not None and (nxt == NONE or self.cycle(self.step_num) != self._open):
            self._close()
        self._t0 = local_ns()
        self._enter(nxt)

    def close(self) -> None:
        """Write the trace a cycle left open (the job ended inside it); idempotent."""
        if not self._closed:
            self._closed = True
            if self._open is not None:
                self._close()

    def __enter__(self) -> Schedule:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def _enter(self, phase: str) -> None:
        if phase == NONE or self._open is not None:
            return
        from . import start
        cycle = self.cycle(self.step_num)
        if cycle == self._failed:
            return
        path = self.path_for(cycle)
        try:
            start(path, **self.start_kwargs)
        except Exception as e:  # noqa: BLE001 - a schedule never stops the job
            log.warning("distgrad.trace.schedule: step %d: the trace to %s did not start: %s: %s",
                        self.step_num, path, type(e).__name__, e)
            self._failed = cycle
            return
        self._open = cycle

    def _close(self) -> None:
        from . import stop
        self._open = None
        try:
            written = stop()
        except Exception as e:  # noqa: BLE001 - a schedule never stops the job
            log.warning("distgrad.trace.schedule: step %d: the trace was not written: %s: %s",
                        self.step_num, type(e).__name__, e)
            return
        self.written.append(written)
        if self.on_trace_ready is not None:
            self.on_trace_ready(written)


#: :func:`distgrad.trace.start`'s keywords after ``path`` (a test holds the two together)
START_KWARGS = ("profile_ops", "timeout", "max_events")


def _check_start_kwargs(kwargs: dict) -> None:
    """Refuse now, not at each cycle's start, a keyword :func:`distgrad.trace.start` lacks."""
    unknown = sorted(set(kwargs) - set(START_KWARGS))
    if unknown:
        raise TypeError(f"distgrad.trace.schedule: unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(distgrad.trace.start takes {', '.join(START_KWARGS)})")


def schedule(path: str, *, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 1,
             skip_first: int = 0, skip_first_wait: int = 0,
             on_trace_ready: Callable[[str], Any] | None = None, **start_kwargs: Any) -> Schedule:
    """A :class:`Schedule`: trace chosen steps of a long job, as ``torch.profiler.schedule``
    (``skip_first_wait``: skip the first cycle's wait, as torch's; ``start_kwargs``:
    :func:`distgrad.trace.start`'s ``profile_ops``, ``timeout``, ``max_events``, any
    other refused here with TypeError; ``on_trace_ready(path)`` runs after each file
    is written).

    Example::

        >>> sched = distgrad.trace.schedule("trace.json", wait=999, active=1)
        >>> for batch in loader:
        ...     train_step(batch)
        ...     sched.step()        # step 999 is traced, to trace.json
        >>> sched.close()
    """
    return Schedule(path, wait=wait, warmup=warmup, active=active, repeat=repeat,
                    skip_first=skip_first, skip_first_wait=skip_first_wait,
                    on_trace_ready=on_trace_ready, **start_kwargs)
