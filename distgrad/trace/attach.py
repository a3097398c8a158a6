"""On-demand capture of a running job: ``distgrad.trace.on_signal``.

A job that called :func:`on_signal` once (on the main thread, after ``init_rpc``)
records a trace of the whole group whenever its process gets the signal (default
``SIGUSR1``: ``kill -USR1 <pid>``), for ``seconds``, to a new file, without a
restart or a line of code in the training loop: as ``ray timeline`` does for a Ray
cluster. Only who may signal the process (its user, or root) can ask, and the
trace itself travels over the group's authenticated connections.

The handler only starts a thread: the trace opens, records ``seconds`` and is
written from there (a signal during a trace already open is logged and ignored).
Not on Windows (no ``SIGUSR1``): pass another signal there, or call
:func:`distgrad.trace.start` from the program.

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
_busy = threading.Lock()


def _capture(path: str, seconds: float, start_kwargs: dict) -> None:
    from . import start, stop
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = path.replace("{time}", stamp).replace("{pid}", str(os.getpid()))
        start(target, **start_kwargs)
        try:
            time.sleep(seconds)
        finally:
            written = stop()
        log.warning("distgrad.trace: on signal, recorded %.1f s to %s", seconds, written)
    except Exception as e:  # noqa: BLE001 - a capture never costs the job
        log.warning("distgrad.trace: the trace asked for by a signal was not written: %s: %s",
                    type(e).__name__, e)
    finally:
        _busy.release()


def on_signal(path: str = "distgrad-trace-{pid}-{time}.json", seconds: float = 10.0,
              sig: int | None = None, **start_kwargs: Any) -> Any:
    """Record a trace of the group for ``seconds`` each time this process gets ``sig``
    (default ``SIGUSR1``); ``{time}`` and ``{pid}`` in ``path`` are filled in, and
    ``start_kwargs`` go to :func:`distgrad.trace.start`. Call it on the main thread;
    returns the handler it replaced.

    Example::

        >>> distgrad.trace.on_signal("/tmp/job-{time}.json", seconds=5)
        >>> # kill -USR1 <pid>  ->  /tmp/job-20261203-184500.json, 5 s of the group
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

    def handler(signum: int, frame: Any) -> None:
        if not _busy.acquire(blocking=False):
            log.warning("distgrad.trace: signal %d during a capture already running: ignored", signum)
            return
        threading.Thread(target=_capture, args=(path, seconds, start_kwargs),
                         name="distgrad-trace-capture", daemon=True).start()

    return _signal.signal(sig, handler)
