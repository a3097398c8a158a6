"""Reentrant activation checkpointing (``checkpoint(fn, x, use_reentrant=True)``)
inside a distributed backward.

The reentrant variant's backward (``CheckpointFunction.backward``) recomputes the
block and runs a nested ``torch.autograd.backward`` over it, which writes the
``.grad`` of every leaf the block used. torch forbids it inside
``torch.autograd.grad`` (``_is_checkpoint_valid()`` is False there), which is how
the distributed engine runs every region, so both torch's distributed autograd
and a plain one fail with "When use_reentrant=True, torch.utils.checkpoint is
incompatible with .grad()". And even where it ran, the block's parameters would
get their gradients in ``.grad`` instead of the context.

Here ``CheckpointFunction.backward`` is wrapped: while a distributed pass runs it
on this thread, the nested ``backward`` becomes one engine call over the
recomputed graph that captures its leaves. The block's inputs (the detached
copies the checkpoint made) get ``.grad`` as the checkpoint expects; every other
leaf (the block's parameters) goes to the context exactly as a region's leaves
do (:meth:`.share.PassState.take_leaves`: hooks, DDP). Outside a distributed
pass nothing changes. A block that makes an RPC cannot be recomputed (the call
would run again during backward): that is an error that says to use
``use_reentrant=False``.

Example::

    >>> def block(x):
    ...     return lin2(lin1(x).tanh())
    >>> y = checkpoint(block, x, use_reentrant=True)   # inside an RPC'd function: exact
"""
from __future__ import annotations

import re
import threading
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from . import anomaly
from .context import CONTAINER
from .gradients import _agent, current_pass
from .nodes import grad_call
from .rpc_functions import _node_types
from .walk import accumulate_type

_tls = threading.local()


def _current_pass() -> Any:
    return current_pass()


def _install() -> None:
    fn = _ckpt.CheckpointFunction
    if getattr(fn.backward, "_distgrad", False):
        return
    orig_backward, orig_detach = fn.backward, _ckpt.detach_variable
    orig_valid, orig_autograd_backward = torch.autograd._is_checkpoint_valid, torch.autograd.backward

    def backward(ctx: Any, *args: Any) -> Any:
        state = _current_pass()
        if state is None:
            return orig_backward(ctx, *args)
        prev = getattr(_tls, "frame", None)
        _tls.frame = {"state": state, "inputs": []}
        try:
            return orig_backward(ctx, *args)
        finally:
            _tls.frame = prev

    def detach_variable(inputs: tuple) -> tuple:
        out = orig_detach(inputs)
        frame = getattr(_tls, "frame", None)
        if frame is not None:
            frame["inputs"] = [t for t in out if isinstance(t, torch.Tensor)]
        return out

    def is_checkpoint_valid() -> bool:
        return getattr(_tls, "frame", None) is not None or orig_valid()

    def autograd_backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
        frame = getattr(_tls, "frame", None)
        if frame is None or args or kwargs:
            return orig_autograd_backward(tensors, grad_tensors, *args, **kwargs)
        _tls.frame = None  # a checkpoint nested in the block has a frame of its own
        try:
            _recomputed_backward(frame, list(tensors), list(grad_tensors))
        finally:
            _tls.frame = frame

    backward._distgrad = True  # type: ignore[attr-defined]
    fn.backward = staticmethod(backward)
    _ckpt.detach_variable = detach_variable
    torch.autograd._is_checkpoint_valid = is_checkpoint_valid
    autograd_backward.__doc__ = orig_autograd_backward.__doc__
    torch.autograd.backward = autograd_backward


def _recomputed_backward(frame: dict, outputs: list, grads: list) -> None:
    """The checkpoint's nested backward, for the distributed pass ``frame["state"]``."""
    state = frame["state"]
    _, recv_t = _node_types()
    acc_t = accumulate_type()
    leaves, seen = [], set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if type(n) is recv_t:
            raise RuntimeError(
                "torch.utils.checkpoint(use_reentrant=True) around an RPC cannot run in a "
                "distributed backward: recomputing the block would make the call again. "
                f"Use use_reentrant=False (worker {_worker_name()})")
        if type(n) is acc_t:
            leaves.append(n)
            continue
        stack.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    if not leaves:
        return
    def run() -> tuple:
        return grad_call(tuple(outputs), tuple(grads), tuple(n.variable for n in leaves),
                     state.retain_graph, state.create_graph)
    res = _anomaly_checked(seen, run) if state.anomaly else run()
    inputs = {id(t) for t in frame["inputs"]}
    mine, theirs = [], []
    for node, g in zip(leaves, res):
        if id(node.variable) in inputs:
            if g is not None:  # what AccumulateGrad would write for the checkpoint to read
                v = node.variable
                v.grad = g if v.grad is None else v.grad + g
        else:
            mine.append(node)
            theirs.append(g)
    if mine:
        state.take_leaves(mine, theirs, grads, owned=False, lazy=False)  # inside a running call


_NAN = re.compile(r"Function '([^']+)' returned (nan|inf) values in its (\d+)th output")


def _anomaly_checked(nodes: set, run: Any) -> tuple:
    """``run()`` (the nested engine call) under detect_anomaly(): torch's own NaN/Inf
    check runs inside it (the pass's executor checks only the nodes it runs itself),
    and a node of the recomputed block (``nodes``) that produced one is reported as
    the executor reports."""
    was = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    torch.set_anomaly_enabled(True, True)
    try:
        return run()
    except RuntimeError as e:
        m = _NAN.search(str(e))
        node = next((n for n in nodes if m and n.name() == m.group(1)), None)
        if node is None:
            raise
        outs = [None] * int(m.group(3)) + [torch.tensor(float(m.group(2)))]
        anomaly.check(node, outs, CONTAINER.worker_id, _worker_name())
        raise
    finally:
        torch.set_anomaly_enabled(*was)


def _worker_name() -> str:
    try:
        return _agent().name
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


_install()
