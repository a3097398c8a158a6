"""Anomaly detection across workers: ``dist_autograd.detect_anomaly()``.

torch's anomaly mode stops at the process boundary. Here, inside
:func:`detect_anomaly`:

* every RPC made from the block carries a flag (in its autograd meta), and the
  worker that serves it records forward stacks too (torch's anomaly mode is on
  while such a request runs there; RPCs it makes carry the flag on);
* a backward pass started in the block runs on every worker with the
  node-by-node executor, which checks each node's outputs: the first node that
  returns NaN or Inf ends the pass everywhere (no poisoned gradient leaves that
  worker) with an :class:`~distgrad.errors.AnomalyError` naming the worker, the
  node, the forward stack where the node was created, and the chains of workers
  the poisoned gradient would have travelled (found once the pass ended).

Off by default; a pass started outside the block costs one flag test per run.

Example::

    >>> with dist_autograd.detect_anomaly(), dist_autograd.context() as cid:
    ...     loss = rpc.rpc_sync("worker1", model_part, args=(x,)).sum()
    ...     dist_autograd.backward(cid, [loss])
    AnomalyError: Error on Node 1: Function 'LogBackward0' returned nan values in its 0th
    output (on worker worker1) ...
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import AnomalyError
from ..rpc import api as rpc_api
from ..rpc.agent import current_agent
from .context import CONTAINER
from .rpc_functions import _node_types
from .walk import below

_lock = threading.Lock()
_users = [0, None]  # threads inside an anomaly scope here; torch's mode before the first


def enabled() -> bool:
    """Whether some thread of this process is inside :func:`detect_anomaly` (or serves an
    RPC made there): process-wide, as torch's anomaly mode is."""
    return _users[0] > 0


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Anomaly mode (process-wide, as torch's) while any thread of this process is in
    such a scope; torch's forward-stack recording with it."""
    with _lock:
        if _users[0] == 0:
            _users[1] = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, False)  # stacks only: the executor checks values
        _users[0] += 1
    try:
        yield
    finally:
        with _lock:
            _users[0] -= 1
            if _users[0] == 0:
                torch.set_anomaly_enabled(*_users[1])


def detect_anomaly() -> contextlib.AbstractContextManager:
    """A context manager around forward and backward, like ``torch.autograd.detect_anomaly()``
    across workers: nodes created inside (on any worker, through RPCs made inside) keep
    their forward stack, and a distributed backward started inside stops at the first
    node, on any worker, whose output holds NaN or Inf, raising
    :class:`~distgrad.errors.AnomalyError` on the caller of ``backward``.

    Example::

        >>> with dist_autograd.detect_anomaly():
        ...     with dist_autograd.context() as cid:
        ...         y = rpc.rpc_sync("worker1", torch.log, args=(x,))   # x has a 0
        ...         dist_autograd.backward(cid, [y.sum()])
        Traceback (most recent call last):
        distgrad.errors.AnomalyError: Error on Node 0: Function 'DivBackward0' ...
    """
    return scope()


def _bad_output(outs: Sequence) -> tuple[int, str] | None:
    for i, g in enumerate(outs):
        if not isinstance(g, torch.Tensor) or not (g.is_floating_point() or g.is_complex()):
            continue
        v = g._values() if g.layout == torch.sparse_coo else g
        if not bool(torch.isfinite(v).all()):
            return i, ("nan" if bool(torch.isnan(v).any()) else "inf")
    return None


def check(node: Any, outs: Sequence, rank: int, worker: str) -> None:
    """Raise :class:`AnomalyError` when an output of ``node`` holds NaN or Inf."""
    bad = _bad_output(outs)
    if bad is None:
        return
    i, what = bad
    _, recv_t = _node_types()
    hops = sorted({(r.dg_info[2], r.dg_info[1]) for r in below([node]) if type(r) is recv_t})
    stack = _user_frames(node.metadata.get("traceback_", []) or [])
    raise AnomalyError(f"Error on Node {rank}: Function '{node.name()}' returned {what} values in its "
                       f"{i}th output (on worker {worker})", worker, node.name(), "", stack, hops)


def _user_frames(frames: list) -> str:
    """The forward stack from the user's code on: on a worker serving an RPC, the
    frames of the thread and of distgrad's serving path come first; they go."""
    import os
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    last = max((i for i, f in enumerate(frames) if pkg in f or "threading.py" in f), default=-1)
    return "".join(frames[last + 1:] if last + 1 < len(frames) else frames)


def _hops(context_id: int, msg_ids: list[int]) -> dict[int, list]:
    """RPC target: for each send function, the (sender, message id) of the recv
    functions its region reaches here (where the gradient would go next)."""
    _, recv_t = _node_types()
    ctx = CONTAINER.retrieve(context_id)
    out = {}
    for m in msg_ids:
        node = ctx.send_functions.get(m)
        if node is not None:
            out[m] = sorted({(r.dg_info[2], r.dg_info[1]) for r in below([node]) if type(r) is recv_t})
    return out


def complete(err: AnomalyError, context_id: int, limit: int = 64) -> AnomalyError:
    """Follow the poisoned gradient's way from worker to worker (RPCs to each worker
    on it; call on a thread that may block) and fill ``err.chains``."""
    agent = current_agent()
    name = {r: w.name for r, w in agent.workers.items()}
    start = err.worker_name or "?"
    paths, frontier = [], [([start], err.hops)]
    seen: set = set()
    while frontier and len(paths) < limit:
        path, hops = frontier.pop(0)
        if not hops:
            paths.append(path)
            continue
        by_worker: dict[int, list[int]] = {}
        for w, m in hops:
            if (w, m) not in seen:
                seen.add((w, m))
                by_worker.setdefault(w, []).append(m)
        if not by_worker:
            paths.append(path + ["..."])  # a cycle back into what was followed
            continue
        for w, ms in sorted(by_worker.items()):
            wname = name.get(w, f"worker id {w}")
            try:
                nxt = rpc_api.rpc_sync(w, _hops, args=(context_id, ms))
            except Exception:  # noqa: BLE001 - a best effort on an error path
                paths.append(path + [wname, "?"])
                continue
            following = sorted({h for m in ms for h in nxt.get(m, [])})
            frontier.append((path + [wname], following))
    err.set_chains(paths)
    return err
