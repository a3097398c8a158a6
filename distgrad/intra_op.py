"""The user's intra-op thread count (``torch.set_num_threads``) on distgrad's threads.

torch keeps that count per thread: ``torch.set_num_threads(n)`` sets the calling
thread's OpenMP and MKL counts and a global, and another thread reads the global
only when ATen initializes it (its engine and inter-op threads at their start, any
other thread at its first ``parallel_for`` or ``torch.get_num_threads()``). A matrix
product initializes nothing: on a Python thread MKL then runs with OpenMP's default team (every core)
where torch's threads run with the user's ``n``. On 2 cores, in the 3-worker
pipeline, a 10x64 @ 64x512 product took 28-35 us on distgrad's threads and 15 us on
torch's (the team's spin-waits, next to other processes), and the ``Linear(512, 10)``
stage's backward 340 us where a plain loop takes 130; and a distgrad
thread that had initialized its count before the user set one kept the old one.

So a thread distgrad started takes the global before it runs a served call, a
backward run or a future's callbacks (``at::init_num_threads``, about 0.1 us),
which also follows a later ``torch.set_num_threads`` made on any thread. That is
torch's distributed backward (its inter-op threads took the global at their start)
and goes further than torch's RPC serving threads, which keep the count they first
took: a later ``set_num_threads`` does not reach those (docs/compatibility.md). A thread
distgrad did not start (the user's own, where a caller reads its reply or runs its
share of a backward) is never touched: its count stays what the user left.

Example::

    >>> mark_distgrad_thread()       # at the start of a thread distgrad runs
    >>> follow_intra_op_threads()    # before running user code on it
"""
from __future__ import annotations

import threading

import torch

_ours = threading.local()
_init = torch.init_num_threads


def mark_distgrad_thread() -> None:
    """Mark the calling thread as one distgrad started (its pools, its readers)."""
    _ours.started = True


def follow_intra_op_threads() -> None:
    """On a thread distgrad started: take the user's ``torch.set_num_threads``."""
    if getattr(_ours, "started", False):
        _init()
