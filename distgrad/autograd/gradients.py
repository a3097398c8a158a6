"""Gradients between workers, the send side: the pass a thread is running, a recv
function's gradients shipped to the worker that sent its tensors, and the error a
pass raises on this worker.

The receiving end (which runs the share that gets them, and counts the run's
weight) is the engine's: :mod:`.engine` registers it in :data:`RECEIVER` when it
is imported, so that this module, below the walk, the executor and the engine,
imports none of them.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import BackwardError, DistgradError
from ..rpc.agent import current_agent
from .context import CONTAINER

# the run of a share this thread is in: state (its PassState), exp (the weight it
# holds, 2**-exp), targets (workers it shipped to), shipped (recv message ids it
# shipped), fed (recv slots reached, for a run that starts past a send function)
_tls = threading.local()
RECEIVER: list = [None]  # the one-way request that takes shipped gradients in (the engine's)


def current_pass() -> Any:
    """The PassState whose share this thread is running, or None."""
    return getattr(_tls, "state", None)


def _agent() -> Any:
    return current_agent()


def ship_gradients(dg_info: tuple, grads: Sequence, reached: Sequence[bool] | None = None) -> None:
    """Send a recv function's gradients to the worker that sent its tensors.

    ``reached[i]`` False: no path from the roots reaches slot ``i`` (the sender then
    runs nothing behind it); by default the slots the walk found fed."""
    context_id, msg_id, sender = dg_info
    state = getattr(_tls, "state", None)
    if state is None or state.ctx.id != context_id:
        on = sorted({str(g.device) for g in grads if g is not None and g.device.type not in ("cpu", "meta")})
        if on:   # (torch's engine ran the node on the device's autograd thread)
            raise RuntimeError(f"a distributed backward through accelerator tensors (gradients on "
                               f"{', '.join(on)} for a recv function of context {context_id}) needs "
                               "distgrad's native engine, which is not loaded here (it needs a C++ "
                               "compiler and ninja; not DISTGRAD_NATIVE=0); the Python engine runs "
                               "CPU passes only")
        raise RuntimeError(f"recv function of context {context_id} ran outside a distributed "
                           "backward pass (use distgrad.autograd.backward)")
    if reached is None:
        run_fed = getattr(_tls, "fed", None)
        fed = (state.recv_slots if run_fed is None else run_fed).get(msg_id)
        unreached = [] if fed is None else [i for i in range(len(grads)) if i not in fed]
    else:
        unreached = [i for i, r in enumerate(reached) if not r]
    gone = state.ctx.lost_peers.get(sender)
    if gone is not None:  # lost since (a process under its rank now is another one)
        raise gone
    _tls.exp += 1
    _tls.targets.add(sender)
    _tls.shipped.add(msg_id)
    args = (context_id, state.pass_id, state.initiator, state.flags, msg_id, list(grads), _tls.exp,
            unreached)
    reverse = msg_id not in state.ctx.recv_of_reply   # (torch's inverse of the tensors' map)
    if state.create_graph:
        # Gradients that carry a graph travel as an RPC of the context: the send and
        # recv functions recorded here and there let a later pass through them.
        prev = CONTAINER.set_current(state.ctx)
        try:
            _agent().notify(sender, RECEIVER[0], args, reverse=reverse)
        finally:
            CONTAINER.set_current(prev)
    else:
        _agent().notify(sender, RECEIVER[0], args, reverse=reverse)


@contextlib.contextmanager
def fed_slots(fed: dict | None) -> Iterator[None]:
    """Within: recv functions that run on this thread take their reached slots from
    ``fed`` (a native run that starts past a send function reaches fewer of them than
    the walk found)."""
    prev = getattr(_tls, "fed", None)
    _tls.fed = fed
    try:
        yield
    finally:
        _tls.fed = prev


def ship_absent(recvs: Sequence) -> None:
    """Tell the senders of the recv functions that sent nothing in this run that no
    path reached them (the senders may be counting on a message)."""
    for r in recvs:
        if r.dg_info[1] not in _tls.shipped:
            n = len(r._input_metadata)
            ship_gradients(r.dg_info, [None] * n, [False] * n)


def backward_error(e: BaseException, node: Any = None) -> BaseException:
    """The error a pass ends with when ``e`` was raised on this worker (inside
    ``node`` when known): torch's ``RuntimeError("Error on Node <rank>: <message>")``
    as a :class:`~distgrad.errors.BackwardError` naming the node and the worker.
    distgrad's own errors (a lost worker, a timeout) keep their type."""
    if isinstance(e, DistgradError):
        return e
    agent = _agent()
    name = node.name() if node is not None else ""
    where = f" (in {name} on worker {agent.name})" if name else f" (on worker {agent.name})"
    cause = f"{type(e).__module__}.{type(e).__qualname__}"
    err = BackwardError(f"Error on Node {CONTAINER.worker_id}: {e}{where}", agent.name, name, cause)
    err.__cause__ = e
    return err
