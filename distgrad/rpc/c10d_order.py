"""While RPC is up, ``init_process_group`` returns only once every rank has its default group.

Code written for torch often starts a process group after ``init_rpc`` and at
once sends an RPC whose function uses the group on the receiver
(``dist.new_group`` in torch's own ``DdpUnderDistAutogradTest``: the master
builds each trainer's model over RPC right after its ``init_process_group``).
torch 2.13's ``init_process_group`` has no barrier at its end (since 2.1;
``TORCH_DIST_INIT_BARRIER=1`` brings it back): each rank returns when its own
backend is connected, a few ms apart, and the receiver may not have registered
its default group yet when the request arrives. Under torch the program works
anyway because torch's first RPC to a peer takes longer than that skew (measured
on 2 cores: 3-136 ms to the first trainer and 80-700 ms to the others, against
returns of ``init_process_group`` up to 9 ms apart); distgrad's takes 2-8 ms, so
the same program failed about one run in eight with "Default process group has
not been initialized".

So while RPC is up this wraps ``torch.distributed.distributed_c10d._is_barrier_after_init``
(the function behind torch's switch): called from ``init_process_group`` it says 1,
and torch runs its own store-based barrier after registering the default group,
exactly as with ``TORCH_DIST_INIT_BARRIER=1``. Nothing else changes:
``new_group`` keeps torch's default (a barrier there would make a rank that is not
a member wait for the members, and a program that tells the members over RPC to
call ``new_group`` after its own returned would hang), and a
``TORCH_DIST_INIT_BARRIER`` the user set is obeyed as torch obeys it. The
barrier costs a few store operations (all ranks already wait for each other in
``init_process_group``: the backends connect to every rank, and so does rank 0's
store).

Example::

    >>> rpc.init_rpc("worker1", rank=1, world_size=3)
    >>> dist.init_process_group("gloo", rank=1, world_size=3, init_method=...)
    >>> # every rank has registered its default group now: an RPC sent from here
    >>> # may call dist.new_group / DDP on its receiver
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from typing import Any

_lock = threading.Lock()
_installed: dict[str, Any] = {}  # "original", "wrapper", "module" while attached


def _c10d() -> Any:
    """torch's c10d module, if it has the switch this relies on (None otherwise)."""
    try:
        import torch.distributed as dist
        if not dist.is_available():
            return None
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return None
    if not (callable(getattr(c10d, "_is_barrier_after_init", None))
            and callable(getattr(c10d, "init_process_group", None))):
        return None
    return c10d


def attach() -> None:
    """RPC is up: ``init_process_group`` ends with torch's barrier."""
    with _lock:
        if _installed:
            return
        c10d = _c10d()
        if c10d is None:
            return
        original = c10d._is_barrier_after_init
        init_code = inspect.unwrap(c10d.init_process_group).__code__

        def _is_barrier_after_init():
            if "TORCH_DIST_INIT_BARRIER" not in os.environ and sys._getframe(1).f_code is init_code:
                return 1
            return original()

        functools.update_wrapper(_is_barrier_after_init, original, ("__name__", "__qualname__", "__doc__"),
                                 ())
        _is_barrier_after_init.__wrapped__ = original  # type: ignore[attr-defined]
        _installed.update(original=original, wrapper=_is_barrier_after_init, module=c10d)
        c10d._is_barrier_after_init = _is_barrier_after_init


def detach() -> None:
    """RPC shut down: torch's function back (unless someone replaced the wrapper since)."""
    with _lock:
        if not _installed:
            return
        c10d = _installed["module"]
        if c10d.__dict__.get("_is_barrier_after_init") is _installed["wrapper"]:
            c10d._is_barrier_after_init = _installed["original"]
        _installed.clear()
