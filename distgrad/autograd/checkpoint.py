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

Here, while a pass whose walk met a ``CheckpointFunction`` node runs on this
worker (:func:`enter` .. :func:`leave`, around each run of its share), four
pass-through wrappers are in place (none at any other time): on
``CheckpointFunction.backward``, ``torch.utils.checkpoint.detach_variable``,
``torch.autograd._is_checkpoint_valid`` and ``torch.autograd.backward``. The
pass is found *from the node*: the nodes the walk met map to their pass, so a
node that torch runs on another thread (its device threads run CUDA nodes) is
still the pass's. While such a node's backward runs, on whatever thread, the
nested ``backward`` becomes one engine call over the recomputed graph that
captures its leaves: the block's inputs (the detached copies the checkpoint
made) get ``.grad`` as the checkpoint expects; every other leaf (the block's
parameters) goes to the context exactly as a region's leaves do
(:meth:`.share.PassState.take_leaves`: hooks, DDP). A checkpoint nested in the
block is mapped to the pass for that nested call. Any other checkpoint, a local
``backward()`` on another thread included, runs torch's code unchanged. A block
that makes an RPC cannot be recomputed (the call would run again during
backward): that is an error that says to use ``use_reentrant=False``.

Example::

    >>> def block(x):
    ...     return lin2(lin1(x).tanh())
    >>> y = checkpoint(block, x, use_reentrant=True)   # inside an RPC'd function: exact
"""
from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from . import anomaly
from .context import CONTAINER
from .gradients import _agent, current_pass
from .nodes import grad_call
from .rpc_functions import _node_types
from .walk import accumulate_type, checkpoint_type

_tls = threading.local()     # the frame of the checkpoint backward this thread runs
_lock = threading.Lock()
_owner: dict[Any, list] = {}  # CheckpointFunction node -> the running passes it belongs to
_users = [0]                 # runs of such passes in progress: the wrappers are in while > 0
_saved: dict[str, Any] = {}  # torch's originals (as found at the last install)


def enter(state: Any, nodes: Sequence) -> None:
    """A run of ``state``'s share starts, whose walk met the CheckpointFunction
    ``nodes``: they are the pass's until :func:`leave`; the wrappers are in meanwhile."""
    with _lock:
        for n in nodes:
            _owner.setdefault(n, []).append(state)
        _users[0] += 1
        if _users[0] == 1:
            _install()


def leave(state: Any, nodes: Sequence) -> None:
    """The run :func:`enter` announced ended; the last one takes the wrappers out."""
    with _lock:
        for n in nodes:
            states = _owner.get(n)
            if states is not None:
                states.remove(state)
                if not states:
                    del _owner[n]
        _users[0] -= 1
        if _users[0] == 0:
            _uninstall()


def _pass_of(node: Any) -> Any:
    """The running pass ``node`` belongs to (the thread's own where two are), or None."""
    states = _owner.get(node)
    if not states:
        return None
    current = current_pass()
    return current if current in states else states[-1]


def _backward(ctx: Any, *args: Any) -> Any:
    state = _pass_of(ctx)
    if state is None:
        return _saved["backward"].__func__(ctx, *args)
    prev = getattr(_tls, "frame", None)
    _tls.frame = {"state": state, "inputs": []}
    # the block is recomputed in the pass's context (a pass's nodes run with none
    # current): an RPC in it records a recv function, which the nested backward
    # refuses with the error that names use_reentrant=False
    outer_ctx = CONTAINER.set_current(state.ctx)
    try:
        return _saved["backward"].__func__(ctx, *args)
    finally:
        CONTAINER.set_current(outer_ctx)
        _tls.frame = prev


def _detach_variable(inputs: tuple) -> tuple:
    out = _saved["detach"](inputs)
    frame = getattr(_tls, "frame", None)
    if frame is not None:
        frame["inputs"] = [t for t in out if isinstance(t, torch.Tensor)]
    return out


def _is_checkpoint_valid() -> bool:
    return getattr(_tls, "frame", None) is not None or _saved["valid"]()


def _autograd_backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
    frame = getattr(_tls, "frame", None)
    if frame is None or args or kwargs:
        return _saved["autograd_backward"](tensors, grad_tensors, *args, **kwargs)
    _tls.frame = None  # a checkpoint nested in the block has a frame of its own
    try:
        _recomputed_backward(frame, list(tensors), list(grad_tensors))
    finally:
        _tls.frame = frame


def _like(wrapper: Any, original: Any) -> Any:
    """``wrapper`` with ``original``'s name, docstring and signature (``__wrapped__``);
    its ``__module__`` stays distgrad's, so it never passes for torch's."""
    return functools.update_wrapper(wrapper, original, ("__name__", "__qualname__", "__doc__"), ())


def _slots() -> list:
    """(owner, attribute, key, wrapper as stored) of the four replacements."""
    return [(_ckpt.CheckpointFunction, "backward", "backward", _STATIC_BACKWARD),
            (_ckpt, "detach_variable", "detach", _detach_variable),
            (torch.autograd, "_is_checkpoint_valid", "valid", _is_checkpoint_valid),
            (torch.autograd, "backward", "autograd_backward", _autograd_backward)]


def _install() -> None:
    for owner, attr, key, wrapper in _slots():
        current = owner.__dict__[attr]
        if current is wrapper:
            continue
        # kept after the wrappers go: a call already inside one still finds its original
        _saved[key] = current
        _like(wrapper.__func__ if key == "backward" else wrapper,
              current.__func__ if key == "backward" else current)
        setattr(owner, attr, wrapper)


def _uninstall() -> None:
    """torch's originals back, each unless someone replaced the wrapper since."""
    for owner, attr, key, wrapper in _slots():
        if owner.__dict__.get(attr) is wrapper:
            setattr(owner, attr, _saved[key])


_STATIC_BACKWARD = staticmethod(_backward)


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
    nested = [n for n in seen if type(n) is checkpoint_type()]  # the pass's for this call
    enter(state, nested)
    try:
        res = _anomaly_checked(seen, run) if state.anomaly else run()
    finally:
        leave(state, nested)
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

