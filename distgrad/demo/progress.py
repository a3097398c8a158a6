"""The demo's training progress: a tqdm bar on a terminal, plain lines elsewhere.

A bar redraws itself with carriage returns, which a log file or a CI console
shows as one endless line; when stderr is not a terminal the demo prints a
plain line instead every 10% of the steps (and at least every
``every_s`` seconds), so a piped run prints a bounded number of lines.

Example::

    bar = progress(range(1, 201), desc="training")
    for step in bar:
        ...
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any


def progress(iterable: Iterable[Any], desc: str, total: int | None = None, stream: IO[str] | None = None,
             tty: bool | None = None, every_s: float = 30.0):
    """A tqdm bar over ``iterable`` when ``stream`` (default stderr) is a terminal,
    else a :class:`PlainProgress` writing to stdout. ``tty`` overrides the check."""
    stream = sys.stderr if stream is None else stream
    if tty is None:
        tty = bool(getattr(stream, "isatty", lambda: False)())
    if tty:
        from tqdm import tqdm
        return tqdm(iterable, desc=desc, total=total, unit="step", dynamic_ncols=True, mininterval=0.25,
                    file=stream)
    return PlainProgress(iterable, desc, total=total, every_s=every_s)


class PlainProgress:
    """tqdm's loop interface (iteration, ``set_postfix``, ``close``) printing
    one line per 10% of ``total`` (and after ``every_s`` seconds without one).

    Example::

        for i in PlainProgress(range(100), "work"):
            pass          # prints "work: 10/100 (10%) ..." up to "work: 100/100 (100%) ..."
    """

    def __init__(self, iterable: Iterable[Any], desc: str, total: int | None = None,
                 out: IO[str] | None = None, every_s: float = 30.0) -> None:
        self.iterable = iterable
        self.desc = desc
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.out = out
        self.every_s = every_s
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.lines = 0
        self._start = time.monotonic()
        self._last = self._start
        self._next_pct = 10
        self._closed = False
        self._printed_n = -1

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            yield item
            self.update()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps; print a line when a 10% mark is passed or
        ``every_s`` seconds went by without one."""
        self.n += n
        now = time.monotonic()
        due = now - self._last >= self.every_s
        if self.total:
            pct = 100 * self.n // self.total
            if pct >= self._next_pct:
                due = True
                self._next_pct = (pct // 10 + 1) * 10
        if due:
            self._print(now)

    def set_postfix(self, **values: Any) -> None:
        """Values shown at the end of the next line (``loss=...``)."""
        self.postfix = values

    def close(self) -> None:
        """Print the final line unless the last one already showed every step."""
        if not self._closed and self.n and self._printed_n != self.n:
            self._print(time.monotonic())
        self._closed = True

    def _print(self, now: float) -> None:
        rate = self.n / max(now - self._start, 1e-9)
        where = f"{self.n}/{self.total} ({100 * self.n // self.total}%)" if self.total else f"{self.n}"
        extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
        out = self.out if self.out is not None else sys.stdout
        print(f"{self.desc}: {where} {rate:.1f} steps/s{extra}", file=out, flush=True)
        self._last = now
        self._printed_n = self.n
        self.lines += 1
