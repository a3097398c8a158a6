"""Opening and closing a trace across the group (the tracing worker's side).

:func:`open_trace` asks every member (``rpc_async`` to each, with a timeout) to
start recording (:func:`_begin`: a :class:`.recorder.Recorder`, and torch's
profiler with ``profile_ops``), then starts here. :func:`close_trace` stops here,
asks each member for its events (:func:`_end`, with the same timeout: a worker that
died or hangs is named in the file's metadata as missing, never waited for
longer), estimates each clock's offset (:mod:`.clock`, pings over RPC) and writes
the file (:mod:`.export`).

Example (on worker0; the other workers only run RPC as usual)::

    >>> open_trace("trace.json")
    >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    >>> close_trace()
    '/home/me/trace.json'
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import observe
from ..rpc import extensions
from . import clock
from .recorder import DEFAULT_MAX_EVENTS, Recorder

log = logging.getLogger(__name__)
_ids = itertools.count(1)
_lock = threading.Lock()


@dataclass
class Session:
    """A trace this worker opened."""

    id: tuple
    path: str
    profile_ops: bool
    timeout: float
    max_events: int
    members: dict[int, str]                        # rank -> name: recording
    missing: dict[str, str] = field(default_factory=dict)  # name -> why not in the file


_open: dict[str, Session] = {}   # "session" -> the trace this worker opened (one at a time)
# sessions whose open was abandoned (an interrupted start()): a _begin that arrives after
# its _abort must not start recording a trace nobody will close (the last few kept)
_aborted: collections.deque = collections.deque(maxlen=64)


def _agent() -> Any:
    from ..rpc.pending import agent_or_none
    agent = agent_or_none()
    if agent is None:
        raise RuntimeError("distgrad.trace: RPC is not initialized on this process; call "
                           "distgrad.rpc.init_rpc (or torch's) before opening a trace")
    return agent


def _begin(session: tuple, profile_ops: bool, by: str, max_events: int = DEFAULT_MAX_EVENTS) -> int:
    """On every member: start recording for ``session`` (opened by worker ``by``)."""
    agent = _agent()
    with _lock:
        if session in _aborted:
            raise RuntimeError(f"distgrad.trace: worker {agent.name} was asked to start trace {session} "
                               f"after its start was abandoned by {by}")
        old = observe.ACTIVE
        if old is not None and old.session[0] in agent.lost:  # its tracer is gone: nobody will close it
            _stop_lost(old)
        if observe.ACTIVE is not None:
            raise RuntimeError(f"distgrad.trace: worker {agent.name} is already recording a trace "
                               f"(opened by {_by_name(agent, observe.ACTIVE.session)}); close it first")
        rec = Recorder(agent, session, max_events)
        rec.ops = None
        rec.ops_note = None
        if profile_ops:
            from .ops import OpsProfiler
            ops = OpsProfiler(shapes=profile_ops == "shapes")
            try:  # refused where a profiler of someone else's is found, in any phase
                ops.start()
                rec.ops = ops
            except RuntimeError as e:  # never end or crash someone else's profiler: no ops
                rec.ops_note = {"error": f"not recorded: {str(e).replace('distgrad.trace: ', '')}"}
        rec.on_tracer_lost = lambda: agent.callbacks.submit(_tracer_lost, session)
        rec.install()
        observe.ACTIVE = rec
    return clock.local_ns()


def _tracer_lost(session: tuple) -> None:
    """On a member whose tracing worker was lost: stop recording (nobody will ask for it)."""
    with _lock:
        rec = observe.ACTIVE
        if rec is None or rec.session != session:
            return
        _stop_lost(rec)


def _stop_lost(rec: Recorder) -> None:
    """Stop ``rec`` for good (its tracer is lost), its events dropped; called under ``_lock``."""
    observe.ACTIVE = None
    rec.uninstall()
    log.warning("distgrad.trace: worker %s stopped recording trace %s: %s; %d events dropped",
                rec.name, rec.session, rec.stopped_why or "the tracing worker is lost", rec.recorded)
    _stop_ops(rec)


def _end(session: tuple) -> dict:
    """On every member: stop recording ``session``; returns this worker's events."""
    agent = _agent()
    with _lock:
        rec = observe.ACTIVE
        if rec is None or rec.session != session:
            raise RuntimeError(f"distgrad.trace: worker {agent.name} is not recording this trace")
        observe.ACTIVE = None
        rec.uninstall()
    rec.settle()
    out = rec.payload()
    if rec.ops_note is not None:
        out["ops"] = rec.ops_note
    if rec.ops is not None:
        try:
            ops, meta = rec.ops.stop()
            out["events"] = out["events"] + ops
            out["ops"] = meta
        except Exception as e:  # noqa: BLE001 - the trace stays useful without torch's events
            log.warning("worker %s: torch's profiler events left out of the trace: %s", agent.name, e)
            out["ops"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _now() -> int:
    """A ping: this worker's trace clock."""
    return clock.local_ns()


def _abort(session: tuple) -> None:
    """On a member: drop ``session``'s recording (an open that failed or was interrupted
    elsewhere), and refuse its start if that has not arrived yet."""
    with _lock:
        if session not in _aborted:
            _aborted.append(session)
        rec = observe.ACTIVE
        if rec is None or rec.session != session:
            return
        observe.ACTIVE = None
        rec.uninstall()
    _stop_ops(rec)


def _stop_ops(rec: Recorder) -> None:
    """Stop torch's profiler that ``rec`` started (its events dropped), if any."""
    if rec.ops is not None and not rec.ops.taken_over():   # (never end someone else's)
        try:
            rec.ops.prof.stop()
        except Exception:  # noqa: BLE001 - the profiler is ours: nothing else to stop
            pass


def _by_name(agent: Any, session: tuple) -> str:
    w = agent.workers.get(session[0])
    return w.name if w is not None else f"rank {session[0]}"


def open_trace(path: str, profile_ops: bool = False, timeout: float = 30.0,
               max_events: int = DEFAULT_MAX_EVENTS) -> Session:
    """Start recording on every member of the group (see :func:`distgrad.trace.start`)."""
    from .export import check_path
    agent = _agent()
    if "session" in _open:
        raise RuntimeError(f"distgrad.trace: worker {agent.name} already has a trace open "
                           f"(to {_open['session'].path}); stop it first")
    check_path(path)
    if profile_ops not in (False, True, "shapes"):
        raise ValueError(f"distgrad.trace: profile_ops must be False, True or 'shapes', "
                         f"not {profile_ops!r}")
    if int(max_events) < 1:
        raise ValueError(f"distgrad.trace: max_events must be at least 1, not {max_events}")
    if profile_ops:
        from .ops import active_profiler
        busy = active_profiler()
        if busy:
            raise RuntimeError(f"distgrad.trace: profile_ops=True, but {busy} on worker {agent.name}; "
                               "distgrad never ends another profiling session: trace with "
                               "profile_ops=False (torch's ops then go to your own profiler only), "
                               "or stop your profiler first")
    path = os.path.abspath(path)  # a later os.chdir does not move the file
    session = (agent.rank, next(_ids))
    others = [w for w in agent.get_worker_infos() if w.id != agent.rank]
    try:
        return _open_on(agent, session, others, path, profile_ops, timeout, max_events)
    except BaseException:
        # Ctrl-C (or any error) while the members start: none may go on recording a trace
        # nobody will close; those whose start has not run yet refuse it when it does.
        # One that lands once the trace is registered here (as start() returns) must not
        # leave it registered: nothing records it, and every later start would be refused
        if getattr(_open.get("session"), "id", None) == session:
            del _open["session"]
        _abandon(agent, session, others, timeout)
        raise


def _abandon(agent: Any, session: tuple, others: list, timeout: float) -> None:
    """Drop ``session`` here and on every other member (each answer bounded by ``timeout``,
    at most 5 s)."""
    from ..rpc import api
    _abort(session)
    futs = []
    for w in others:
        try:
            futs.append((w, api.rpc_async(w, _abort, args=(session,), timeout=min(timeout, 5.0))))
        except Exception as e:  # noqa: BLE001 - named below
            log.warning("distgrad.trace: worker %s may still record abandoned trace %s: %s",
                        w.name, session, e)
    for w, fut in futs:  # each bounded by its RPC's timeout
        try:
            fut.wait()
        except Exception as e:  # noqa: BLE001 - it stops when it finds this worker lost
            log.warning("distgrad.trace: worker %s did not confirm dropping abandoned trace %s: %s",
                        w.name, session, _first_line(e))


def _open_on(agent: Any, session: tuple, others: list, path: str, profile_ops: bool, timeout: float,
             max_events: int) -> Session:
    """The rest of :func:`open_trace`: start every member, then here."""
    from ..rpc import api
    futs = [(w, api.rpc_async(w, _begin, args=(session, profile_ops, agent.name, max_events),
                                        timeout=timeout))
            for w in others]
    members, missing, refused = {agent.rank: agent.name}, {}, []
    for w, fut in futs:
        try:
            fut.wait()
            members[w.id] = w.name
        except Exception as e:  # noqa: BLE001 - named below or in the file
            if "already recording" in str(e):
                refused.append(f"{w.name}: {_first_line(e)}")
            else:
                missing[w.name] = f"did not start: {type(e).__name__}: {_first_line(e)}"
    if not refused:
        try:
            _begin(session, profile_ops, agent.name, max_events)
        except RuntimeError as e:
            refused.append(f"{agent.name}: {e}")
    if refused:  # open_trace drops it on the members that started (_abandon)
        raise RuntimeError("distgrad.trace: cannot open a trace: " + "; ".join(refused))
    for name, why in missing.items():
        log.warning("distgrad.trace: worker %s is not traced (%s)", name, why)
    for w in others:  # one that answers late must not record a trace that will not ask for it
        if w.name in missing:
            _quiet(lambda w=w: api.rpc_async(w, _abort, args=(session,), timeout=timeout))
    s = Session(session, str(path), profile_ops, timeout, int(max_events), members, missing)
    _open["session"] = s
    return s


def close_trace() -> str:
    """Stop recording everywhere, gather, align clocks, write the file; returns its path."""
    from ..rpc import api
    from . import export
    agent = _agent()
    s = _open.pop("session", None)
    if s is None:
        raise RuntimeError(f"distgrad.trace: worker {agent.name} has no trace open")
    payloads = {agent.rank: _end(s.id)}
    futs = [(r, name, api.rpc_async(r, _end, args=(s.id,), timeout=s.timeout))
            for r, name in s.members.items() if r != agent.rank]
    for r, name, fut in futs:
        try:
            payloads[r] = fut.wait()
        except Exception as e:  # noqa: BLE001 - a lost or hung worker: named in the file
            s.missing[name] = f"no events gathered: {type(e).__name__}: {_first_line(e)}"
    offsets = {agent.rank: clock.Offset(0, 0, 0, 0)}
    for r in list(payloads):
        if r == agent.rank:
            continue
        try:
            offsets[r] = clock.estimate(lambda r=r: api.rpc_sync(r, _now, timeout=s.timeout))
        except Exception as e:  # noqa: BLE001
            s.missing[s.members[r]] = f"clock not aligned: {type(e).__name__}: {_first_line(e)}"
            payloads.pop(r)
    export.write(s.path, agent.rank, payloads, offsets, s)
    return s.path


def close_at_shutdown(graceful: bool) -> None:
    """``rpc.shutdown()`` on this worker with its trace still open (called first thing
    by the shutdown): a graceful one closes the trace and writes its file, as
    :func:`close_trace` would (the members still serve until every worker reached
    shutdown), with a warning naming the path; ``graceful=False``, or a close that
    fails, drops it with a warning naming the path that was not written."""
    s = _open.get("session")
    if s is None:
        return
    name = agent.name if (agent := _agent_or_none()) is not None else "?"
    if graceful:
        try:
            close_trace()
            log.warning("distgrad.trace: worker %s: rpc.shutdown() with a trace open: closed it and "
                        "wrote %s (call distgrad.trace.stop() before shutdown)", name, s.path)
            return
        except Exception as e:  # noqa: BLE001 - the shutdown goes on; the trace is named
            why = f"{type(e).__name__}: {_first_line(e)}"
    else:
        why = "rpc.shutdown(graceful=False) does not wait for the members"
    _open.pop("session", None)
    _abort(s.id)
    log.warning("distgrad.trace: worker %s: rpc.shutdown() with a trace open: the trace to %s was "
                "not written (%s)", name, s.path, why)


def drop_at_shutdown() -> None:
    """The end of ``rpc.shutdown()``: whatever this worker still records (a trace opened
    by a worker that has not closed it) stops, its wrappers, gc hook and torch's
    profiler removed, its events dropped with a warning."""
    _open.pop("session", None)
    with _lock:
        rec = observe.ACTIVE
        if rec is None:
            return
        observe.ACTIVE = None
        rec.uninstall()
    _stop_ops(rec)
    log.warning("distgrad.trace: worker %s: rpc.shutdown() while recording trace %s (opened by rank %s, "
                "not closed): stopped, %d events dropped", rec.name, rec.session, rec.session[0],
                rec.recorded)


def _agent_or_none() -> Any:
    from ..rpc.pending import agent_or_none
    return agent_or_none()


def _quiet(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


def _first_line(e: BaseException) -> str:
    """The line of an error (a remote one: the callee's message, not its traceback) worth showing."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    ours = [ln for ln in lines if "distgrad.trace:" in ln]
    if ours:
        return ours[0].split("distgrad.trace: ", 1)[1].rstrip("')\"")
    lines = [ln for ln in lines if not ln.startswith("On WorkerInfo")]
    return lines[0] if lines else type(e).__name__


# rpc.shutdown() closes (or drops) what this worker has open; RPC never imports the tracer
extensions.at_shutdown(start=close_at_shutdown, end=drop_at_shutdown)
