"""torch's own profiler inside a trace (``distgrad.trace(..., profile_ops=True)``).

Each worker runs ``torch.profiler.profile`` (CPU, and CUDA where there is one) over
every thread of the process for the trace's window, and hands its events to the
trace on its own trace clock. torch stamps events with its own clock (unix time in
its exported chrome trace, relative to ``baseTimeNanoseconds``); the conversion is
measured, not assumed: a few empty ``record_function`` markers are recorded at the
start and the end, each between two reads of :func:`.clock.local_ns`; the marker
with the narrowest bracket gives the offset, and half of what the bracket leaves
around the marker bounds its error.

Example::

    >>> ops = OpsProfiler(); ops.start()
    >>> torch.matmul(a, b)
    >>> events, meta = ops.stop()
    >>> events[0][:3]
    ('X', 'aten::matmul', 'op')
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from .clock import local_ns

log = logging.getLogger(__name__)

MARKER = "distgrad.trace.clock_marker"
_MARKS = 5
# synthetic tracks of a worker for device events: tid = _DEVICE_TID + stream
_DEVICE_TID = 20_000_000
_SKIP_CATS = {"ac2g", "Trace", "python_function"}


class OpsProfiler:
    """torch.profiler.profile over all threads, with clock markers around it."""

    def __init__(self, shapes: bool = False) -> None:
        self.shapes = shapes   # torch's record_shapes: each op's input dims and types
        self.prof: Any = None
        self.marks: list[tuple[int, int]] = []
        self.all_threads = False
        self.start_s = 0.0  # what starting torch's profiler took (the first start in a process: seconds)

    def start(self) -> None:
        """Start torch's profiler (timed: ``start_s``) and record the first clock markers.

        Raises ``RuntimeError`` (naming it) where another profiler is found in this
        process (:func:`active_profiler`): starting ours would end it, or crash."""
        import time
        t0 = time.perf_counter()
        busy = active_profiler()
        if busy:
            raise RuntimeError(f"distgrad.trace: torch's profiler not started: {busy}")
        import torch
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        config = _all_threads_config()
        self.all_threads = config is not None
        kw = {"experimental_config": config} if config is not None else {}
        self.prof = profile(activities=activities, record_shapes=self.shapes, **kw)
        self.prof.start()
        self.start_s = time.perf_counter() - t0
        self._mark()

    def _mark(self) -> None:
        from torch.autograd.profiler import record_function
        for _ in range(_MARKS):
            before = local_ns()
            with record_function(MARKER):
                pass
            self.marks.append((before, local_ns()))

    def taken_over(self) -> str | None:
        """Why torch's profiling session is no longer this one's, or None.

        torch keeps one session per process: a profiler the program starts while a
        ``profile_ops`` trace is open takes it over (torch has no way to refuse it).
        Once that profiler stopped, the session is gone, and stopping or exporting ours
        ends the process with SIGSEGV; while it runs, stopping ours would end the
        program's. Found by torch's flags and a scan for a running autograd profiler
        other than ours (the objects the garbage collector tracks)."""
        enabled = _session_open()
        if enabled is None:
            return None
        import torch.autograd.profiler as autograd_profiler
        legacy = autograd_profiler.profile
        if not enabled:
            return ("a torch profiler the program started during the trace took torch's "
                    "profiling session over and ended it")
        import gc
        mine = getattr(self.prof, "profiler", None)
        for obj in gc.get_objects():
            # type(), not isinstance: isinstance reads __class__, and torch.distributed's
            # deprecated reduce_op warns on every attribute read (a FutureWarning per scan)
            if issubclass(type(obj), legacy) and obj is not mine:
                d = obj.__dict__
                if d.get("entered") and d.get("kineto_results", 0) is None:
                    return ("a torch profiler the program started during the trace holds torch's "
                            "profiling session (left running: stopping ours would end it)")
        return None

    def stop(self) -> tuple[list[tuple], dict]:
        """(events on this worker's trace clock, what the merge needs to know).

        Raises ``RuntimeError`` (nothing stopped, nothing exported) where the session was
        taken over by a profiler of the program's (:meth:`taken_over`)."""
        why = self.taken_over()
        if why:
            raise RuntimeError(f"torch's ops not recorded: {why}")
        self._mark()
        self.prof.stop()
        fd, path = tempfile.mkstemp(prefix="distgrad-ops-", suffix=".json")
        os.close(fd)
        try:
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                raw = json.load(f)
        finally:
            os.unlink(path)
        events, meta = convert(raw, self.marks, self.all_threads)
        meta["start_s"] = round(self.start_s, 3)
        return events, meta


def active_profiler() -> str | None:
    """What profiler already runs in this process, in any phase and on any thread, or
    None: a second one would end it (or, under a schedule, crash the process).

    Found: a profiling session torch has open (``torch.profiler.profile``, the
    autograd profiler, a distgrad trace's own), and a ``torch.profiler.profile`` with a
    ``schedule`` that was started and not stopped, even in its wait or warmup phase,
    where torch has no session open yet: its next ``step()`` would start one under
    ours, and torch 2.x ends that process with SIGSEGV. Those are found by a scan of
    the objects the garbage collector tracks (about 0.1 s per million objects), done
    only where ``profile_ops=True`` asks for a profiler."""
    if _session_open():
        return "a torch profiler is already active in this process"
    return _scheduled_profiler()


def _session_open() -> bool | None:
    """Whether torch has a profiling session open in this process (None: this torch
    cannot say). torch's own flag is per thread (a profiler started on the main thread
    is not seen from a pool thread); the autograd profiler module's is the process's."""
    try:
        import torch
        import torch.autograd.profiler as autograd_profiler
        return bool(getattr(autograd_profiler, "_is_profiler_enabled", False) or
                    torch._C._autograd._profiler_enabled())
    except (AttributeError, ImportError):
        return None


def _scheduled_profiler() -> str | None:
    """A started, not stopped, ``torch.profiler.profile`` with a schedule (see
    :func:`active_profiler`), described, or None."""
    try:
        from torch.profiler import profile
    except ImportError:
        return None
    import gc
    for obj in gc.get_objects():
        if not issubclass(type(obj), profile):
            continue
        d = getattr(obj, "__dict__", {})
        # profile.start() enters a "ProfilerStep#n" record_function when it has a
        # schedule; stop() exits it and sets it to None
        if d.get("record_steps") and d.get("step_rec_fn") is not None:
            action = d.get("current_action")
            phase = {"NONE": "wait", "WARMUP": "warmup", "RECORD": "active",
                     "RECORD_AND_SAVE": "active"}.get(getattr(action, "name", ""), str(action))
            return (f"a torch.profiler.profile with a schedule is started and not stopped in this "
                    f"process (step {d.get('step_num', '?')}, {phase} phase)")
    return None


def _all_threads_config() -> Any:
    """torch's switch to profile every thread (served requests run on pool threads),
    where this torch has it."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def convert(raw: dict, marks: list[tuple[int, int]], all_threads: bool = True) -> tuple[list[tuple], dict]:
    """torch's exported chrome trace -> ("X", name, "op", tid, start_ns, end_ns, args) on
    this worker's trace clock, using the markers bracketed by ``marks``."""
    events = [e for e in raw.get("traceEvents", []) if e.get("ph") == "X"]
    found = sorted((e for e in events if e.get("name") == MARKER), key=lambda e: float(e["ts"]))
    if not found or len(found) != len(marks):
        raise RuntimeError(f"torch's profile has {len(found)} clock markers, {len(marks)} were recorded")
    best = None
    for e, (before, after) in zip(found, marks):
        ts_ns, dur_ns = float(e["ts"]) * 1e3, float(e.get("dur", 0)) * 1e3
        offset = (before + after) / 2 - (ts_ns + dur_ns / 2)   # trace clock - torch's
        err = max(0.0, (after - before) - dur_ns) / 2
        if best is None or err < best[1]:
            best = (offset, err)
    offset, err = best
    out = []
    for e in events:
        if e.get("name") == MARKER or e.get("cat") in _SKIP_CATS:
            continue
        start = int(float(e["ts"]) * 1e3 + offset)
        end = start + int(float(e.get("dur", 0)) * 1e3)
        tid = e.get("tid")
        if not isinstance(tid, int) or e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            tid = _DEVICE_TID + (tid if isinstance(tid, int) else 0)
        args = {"torch_cat": e.get("cat", "")}
        targs = e.get("args") if isinstance(e.get("args"), dict) else {}
        for theirs, ours in _KEPT_ARGS:   # record_shapes's, and the forward-backward link
            if theirs in targs:
                args[ours] = targs[theirs]
        out.append(("X", e.get("name", "?"), "op", tid, start, end, args))
    links = _fwd_bwd(raw, offset)
    out.extend(links)
    return out, {"ops": len(out) - len(links), "marker_error_us": round(err / 1e3, 3),
                 "all_threads": all_threads, "fwd_bwd_links": len(links)}


_KEPT_ARGS = (("Input Dims", "input_dims"), ("Input type", "input_types"),
              ("Sequence number", "seq"))


def _fwd_bwd(raw: dict, offset: float) -> list[tuple]:
    """torch's forward-to-backward links (its ``fwdbwd`` flows: from a forward op to the
    backward node it made) as ``("L", id, (tid, ns), (tid, ns))`` on this worker's clock;
    pairs only."""
    ends: dict[Any, dict[str, tuple]] = {}
    for e in raw.get("traceEvents", []):
        if e.get("cat") == "fwdbwd" and e.get("ph") in ("s", "f") and isinstance(e.get("tid"), int):
            try:
                ns = int(float(e["ts"]) * 1e3 + offset)
            except (KeyError, TypeError, ValueError):
                continue
            ends.setdefault(e.get("id"), {})[e["ph"]] = (e["tid"], ns)
    return [("L", i, d["s"], d["f"]) for i, d in ends.items()
            if "s" in d and "f" in d and isinstance(i, int) and 0 <= i < 1 << 32]
