"""On-demand capture of a running job: ``distgrad.trace.on_signal``.

A job that called :func:`on_signal` once (on the main thread, after ``init_rpc``)
records a trace of the whole group whenever its process gets the signal (default
``SIGUSR1``: ``kill -USR1 <pid>``), for ``seconds``, to a new file, without a
restart or a line of code in the training loop: as ``ray timeline`` does for a Ray
cluster. Only who may signal the process (its user, or root) can ask, and the
trace itself travels over the group's authenticated connections.

The signal handler does nothing but note the request and write a byte to a wakeup
pipe (no logging, no lock, no thread started in signal context: a flood of signals
cannot nest handlers into a RecursionError, nor re-enter a lock); a daemon thread
waiting on that pipe opens the trace, records ``seconds`` and writes it. Signals that
come while a capture runs are ignored (counted, and logged after it). ``{time}`` in
``path`` is the capture's start to the millisecond; a file of that name already there
is never replaced (``.1``, ``.2``, ... before the extension). Not on Windows (no
``SIGUSR1``): pass another signal there, or call :func:`distgrad.trace.start` from
the program.

Example::

    >>> distgrad.trace.on_signal("/tmp/job-{time}.json", seconds=5)
    >>> # later, from a shell: kill -USR1 <pid of this worker>
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class _State:
    """What the handler and the capturing thread share: plain attributes, set without
    a lock (the handler runs on the main thread, between bytecodes)."""

    busy = False                  # a capture is asked for or running
    ignored = 0                   # signals that came while busy
    request: tuple | None = None  # (signum, path, seconds, start_kwargs) of the capture asked
    wake: int | None = None       # the wakeup pipe's write end
    pid = 0                       # the process whose thread reads the pipe (a fork has none)


_state = _State()
_setup = threading.Lock()


def target_path(path: str, now: float | None = None) -> str:
    """``path`` with ``{pid}`` and ``{time}`` (local time to the millisecond,
    ``20261203-184500.123``) filled in; where that file exists, ``.1``, ``.2``, ...
    before the extension: a capture never replaces an earlier one.

    Example::

        >>> target_path("/tmp/job-{time}.json", 0.0)
        '/tmp/job-19700101-000000.000.json'
    """
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    out = path.replace("{time}", stamp).replace("{pid}", str(os.getpid()))
    root, ext = os.path.splitext(out)
    n = 0
    while os.path.lexists(out):
        n += 1
        out = f"{root}.{n}{ext}"
    return out


def _capture(path: str, seconds: float, start_kwargs: dict) -> None:
    from . import start, stop
    try:
        start(target_path(path), **start_kwargs)
        try:
            time.sleep(seconds)
        finally:
            written = stop()
        log.warning("distgrad.trace: on signal, recorded %.1f s to %s", seconds, written)
    except Exception as e:  # noqa: BLE001 - a capture never costs the job
        log.warning("distgrad.trace: the trace asked for by a signal was not written: %s: %s",
                    type(e).__name__, e)


def _watch(read_end: int) -> None:
    """The capturing thread: wait for the handler's byte, capture, report the signals
    that came meanwhile; again."""
    while True:
        try:
            os.read(read_end, 512)
        except InterruptedError:
            continue
        except OSError:   # the pipe is gone: no more captures
            return
        req = _state.request
        try:
            if req is not None:
                _capture(*req[1:])
        finally:
            ignored, _state.ignored = _state.ignored, 0
            _state.busy = False
        if ignored:
            log.warning("distgrad.trace: %d signal(s) during a capture already running: ignored",
                        ignored)


def _start_watcher() -> int:
    """The wakeup pipe's write end, its reading thread started at the first call (again
    in a forked child, which has no such thread)."""
    with _setup:
        if _state.wake is None or _state.pid != os.getpid():
            r, w = os.pipe()
            os.set_blocking(w, False)   # a full pipe already holds a wakeup
            threading.Thread(target=_watch, args=(r,), name="distgrad-trace-capture",
                             daemon=True).start()
            _state.wake, _state.pid, _state.busy, _state.ignored = w, os.getpid(), False, 0
        return _state.wake


def on_signal(path: str = "distgrad-trace-{pid}-{time}.json", seconds: float = 10.0,
              sig: int | None = None, **start_kwargs: Any) -> Any:
    """Record a trace of the group for ``seconds`` each time this process gets ``sig``
    (default ``SIGUSR1``); ``{time}`` (to the millisecond) and ``{pid}`` in ``path`` are
    filled in, and an existing file is never replaced (see :func:`target_path`);
    ``start_kwargs`` go to :func:`distgrad.trace.start`. Call it on the main thread;
    returns the handler it replaced.

    Example::

        >>> distgrad.trace.on_signal("/tmp/job-{time}.json", seconds=5)
        >>> # kill -USR1 <pid>  ->  /tmp/job-20261203-184500.123.json, 5 s of the group
    """
    if sig is None:
        sig = getattr(_signal, "SIGUSR1", None)
        if sig is None:
            raise ValueError("distgrad.trace.on_signal: this platform has no SIGUSR1; pass sig=")
    if not seconds > 0:
        raise ValueError(f"distgrad.trace.on_signal: seconds must be > 0, not {seconds!r}")
    from .export import check_path
    path = os.path.abspath(os.fspath(path))   # (a later chdir does not move it)
    check_path(path.replace("{time}", "x").replace("{pid}", "x"))   # now, not at the signal
    _start_watcher()

    def handler(signum: int, frame: Any) -> None:
        # signal context: no logging, no lock, no thread (see the module docstring)
        if _state.pid != os.getpid():   # a forked child: its parent's pipe is not its own
            return
        if _state.busy:
            _state.ignored += 1
            return
        _state.busy = True
        _state.request = (signum, path, seconds, start_kwargs)
        try:
            os.write(_state.wake, b"\0")
        except OSError:   # the pipe is full (a wakeup is pending) or gone
            pass

    return _signal.signal(sig, handler)
