"""The distributed backward engine: exact, each node once, never waiting on a
gradient that cannot come.

Every worker holds a share of the pass (:mod:`.share`: the walk, native runs
of disjoint regions, the node-by-node executor for shared ones). This module
moves gradients between shares and decides when a pass is over.

Gradients travel as one-way requests (``Kind.NOTIFY``). Quiescence is detected
by weight throwing (see "execution and termination" below): each run returns
its weight straight to the initiator with whether its worker still holds
waiting nodes, so the end of a long chain costs one message, not a reply per
hop. When the pass is quiet and someone waits (a shared node waiting for an
unused RPC's gradient), the initiator runs a *discovery* from the roots (which
send functions are reachable at all), and the waiting workers recount their
dependencies over the reachable part only and resume. Everything is exact and
runs once; discovery costs messages only in that rare case.

Errors come to the initiator's ``backward`` with the weight reports, naming the
worker that raised them, and a lost participant fails the pass there. Pass
state lives in the context and goes with it.
"""
from __future__ import annotations

import collections
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .. import observe as _observe
from ..errors import AnomalyError, BackwardError
from ..intra_op import follow_intra_op_threads
from ..observe import local_ns
from ..rpc import api as rpc_api
from ..rpc.fast_path import GRADIENT_RECEIVER
from ..rpc.functions import async_execution
from ..rpc.future_errors import fail
from ..rpc.remote_exc import pack_exception, unpack_exception
from ..transport import reading as _reading
from . import anomaly as anomaly_mode
from . import checkpoint as _checkpoint
from . import native_pass
from .checks import check_roots as _check_roots
from .context import CONTAINER
from .futures import all_of as _all
from .futures import done as _done
from .gradients import RECEIVER, _agent, _tls, backward_error
from .gradients import fed_slots as fed_slots  # noqa: F401  (its old home)
from .gradients import ship_absent as ship_absent  # noqa: F401
from .gradients import ship_gradients as ship_gradients  # noqa: F401
from .nodes import UNREACHED
from .share import ANOMALY, CREATE_GRAPH, ENGINE, RETAIN, PassState

_MAX_RESUMES = 8



# -- execution and termination ----------------------------------------------------
# Termination by weight throwing: a backward round starts with weight 1 at the
# initiator. Every run of a share (the roots, a gradient arriving, a resume)
# holds a weight 2**-exp; each gradient it ships takes half of what it holds
# (so every weight is a power of two and travels as its exponent), and when the
# run ends it returns the rest straight to the initiator with whether this
# worker is left waiting. The round is over exactly when the initiator holds 1
# again: no gradient is in flight and no run is active anywhere. One message
# per worker run reaches the initiator directly, instead of a reply climbing
# back through every hop of the chain.
def _run_here_or_inline(state: PassState, exp: int, fn, *args) -> None:
    """:func:`_run`, or hand it to the initiator's thread where that thread asked to
    run its pass's work itself (it is profiling: torch's profiler sees one thread)."""
    if state.inline is not None:
        state.inline.put((state, exp, fn, args))
    else:
        _run(state, exp, fn, *args)


def _run(state: PassState, exp: int, fn, *args) -> None:
    """Run ``fn(*args)`` for ``state`` on this thread holding weight ``2**-exp``;
    then return what is left of it to the initiator."""
    prev = (getattr(_tls, "state", None), getattr(_tls, "exp", 0), getattr(_tls, "targets", None),
            getattr(_tls, "shipped", None))
    _tls.state, _tls.exp, _tls.targets, _tls.shipped = state, exp, set(), set()
    # torch's engine threads run a pass's nodes and hooks outside any distributed
    # autograd context: a hook finds none current, may open its own, and its RPCs
    # carry none (the caller's thread, or a served request's, has one set)
    outer_ctx = CONTAINER.set_current(None)
    follow_intra_op_threads()  # the global torch.set_num_threads (distgrad/intra_op.py)
    state.running += 1
    checkpoints = state.checkpoints
    if checkpoints:
        _checkpoint.enter(state, checkpoints)
    err = None
    tr = _observe.ACTIVE
    t0 = local_ns() if tr is not None else 0
    try:
        # torch's engine runs a pass (nodes, hooks) with grad mode = create_graph
        with torch.set_grad_enabled(state.create_graph):
            fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the initiator
        err = backward_error(e)
    finally:
        if checkpoints:
            _checkpoint.leave(state, checkpoints)
        state.running -= 1
        CONTAINER.set_current(outer_ctx)
        exp, targets = _tls.exp, _tls.targets
        _tls.state, _tls.exp, _tls.targets, _tls.shipped = prev
        if tr is not None:
            args = {"pass": state.trace_key(), "shipped_to": sorted(targets)}
            if err is not None:
                args["error"] = repr(err)
            tr.span(f"backward {_RUNS.get(fn.__name__, fn.__name__)}", "backward", t0, args)
    _report(state.ctx.id, state.pass_id, state.initiator, exp, state.blocked(), targets, err,
            state.holds_ddp())


_RUNS = {"run_entry": "run", "resume": "resume", "flush_ddp": "DDP flush"}


def _report(context_id: int, pass_id: tuple, initiator: int, exp: Any, blocked: bool,
            targets: set, err: BaseException | None, held: bool = False) -> None:
    """Return weight ``2**-exp`` to the initiator, with whether this worker still waits
    (``blocked``) and whether it holds DDP gradients for the flush (``held``)."""
    me = CONTAINER.worker_id
    if initiator == me:
        _returned(pass_id, me, exp, blocked, targets, err, held)
        return
    agent = _agent()
    blob = _pack_error(err, agent) if err is not None else None
    agent.send_control(initiator, "ag_report", context_id, pass_id, exp, blocked, sorted(targets), blob,
                       held)


def _pack_error(err: BaseException, agent: Any) -> bytes:
    if isinstance(err, AnomalyError):
        return pickle.dumps(("anomaly", err.summary, err.worker_name, err.node_name, err.forward_stack,
                             err.hops))
    if isinstance(err, BackwardError):  # keep torch's message; the traceback goes along
        tb = "".join(traceback.format_exception(err.__cause__ or err))
        return pickle.dumps(("backward", str(err), err.worker_name, err.node_name, err.cause_type, tb))
    return pickle.dumps(("other", pack_exception(err, agent.name, agent.rank)))


def _unpack_error(blob: bytes) -> BaseException:
    kind, *rest = pickle.loads(blob)
    if kind == "anomaly":
        summary, worker, node, stack, hops = rest
        return AnomalyError(summary, worker, node, "", stack, hops)
    if kind != "backward":
        return unpack_exception(rest[0])
    message, worker, node, cause, tb = rest
    err = BackwardError(f"{message}\nRemote traceback ({cause}):\n{tb}", worker, node, cause)
    err.remote_traceback = tb
    return err


def on_report(sender: int, context_id: int, pass_id: tuple, exp: Any, blocked: bool,
              targets: list, blob: bytes | None, held: bool = False) -> None:
    """Control message (reading thread): a worker's run of one of our passes ended
    (``exp``: an exponent, or a native share's list of them)."""
    err = _unpack_error(blob) if blob is not None else None
    exp = [int(e) for e in exp] if isinstance(exp, (list, tuple)) else int(exp)
    _returned(tuple(pass_id), sender, exp, bool(blocked), set(targets), err, bool(held))


def _weight(exp: Any) -> Fraction:
    if isinstance(exp, list):
        return sum((Fraction(1, 1 << e) for e in exp), Fraction(0))
    return Fraction(1, 1 << exp)


def _returned(pass_id: tuple, worker: int, exp: Any, blocked: bool, targets: set,
              err: BaseException | None, held: bool = False) -> None:
    """Initiator: weight ``2**-exp`` came back from ``worker``."""
    state = ENGINE.initiated.get(pass_id)
    if state is None:
        return  # finished (an error came first)
    with state.term_lock:
        if state.finished:
            return
        if err is None:
            state.participants |= targets
            lost = _agent().lost
            gone = next((w for w in state.participants if w in lost), None)
            if gone is not None:
                err = _agent()._lost_error(gone)
        if err is None:
            state.weight += _weight(exp)
            if blocked:
                state.round_blocked.add(worker)
            if held:
                state.ddp_holders.add(worker)
            if state.weight != 1:
                return
            waiting, state.round_blocked, state.weight = state.round_blocked, set(), Fraction(0)
            holders = set() if waiting else state.ddp_holders
            if holders:
                state.ddp_holders = set()
        else:
            state.finished = True
    if err is None and holders:
        # quiet everywhere: the workers holding DDP gradients flush them (not on a
        # reading thread: DDP's all-reduce waits for the other members of its group)
        _agent().callbacks.submit(_flush_all, state, holders)
        return
    state.on_round(err, waiting if err is None else set())


def _fail(state: PassState, err: BaseException) -> None:
    """Initiator: end ``state`` with ``err`` unless it already ended."""
    with state.term_lock:
        if state.finished:
            return
        state.finished = True
    state.on_round(err, set())


def _abort(state: PassState) -> None:
    """Initiator: the pass failed; every participant stops running it."""
    state.aborted = True
    agent, me = _agent(), CONTAINER.worker_id
    with state.term_lock:
        others = [w for w in state.participants if w != me and w not in agent.lost]
    for w in others:
        agent.send_control(w, "ag_abort", state.ctx.id, state.pass_id)


def on_abort(sender: int, context_id: int, pass_id: tuple) -> None:
    """Control message (reading thread): a pass this worker took part in failed."""
    pass_id = tuple(pass_id)
    ctx = CONTAINER.contexts.get(context_id)
    state = None
    if ctx is not None:
        with ctx.lock:
            state = ctx.passes.get(pass_id)
    else:   # released here while its native share still runs (the pass goes on, as torch's)
        state = native_pass.share_of(context_id, pass_id)
    if state is not None:
        if getattr(state, "native", False):
            state.abort()
        else:
            state.aborted = True


def on_pass_end(sender: int, context_id: int, pass_id: tuple) -> None:
    """Control message (reading thread): a pass this worker took part in ended; its
    native share's task completes."""
    ctx = CONTAINER.contexts.get(context_id)
    if ctx is not None:
        with ctx.lock:
            state = ctx.passes.get(tuple(pass_id))
        if state is not None and getattr(state, "native", False):
            state.release()


def _end_remote_shares(state: Any) -> None:
    """Initiator: the pass ended well; every other participant's native share ends."""
    agent, me = _agent(), CONTAINER.worker_id
    with state.term_lock:
        others = [w for w in state.participants if w != me and w not in agent.lost]
    for w in others:
        agent.send_control(w, "ag_pass_end", state.ctx.id, state.pass_id)


def fail_passes(peer: int, err_for: Any) -> None:
    """``peer`` is lost: fail the passes started here that it took part in."""
    for state in list(ENGINE.initiated.values()):
        with state.term_lock:
            involved = peer in state.participants
        if involved:
            _fail(state, err_for(peer))


def _propagate(context_id: int, pass_id: tuple, initiator: int, flags: int,
               msg_id: int, grads: list, exp: int, unreached: Sequence[int] = ()) -> None:
    """One-way request: gradients for send function ``msg_id`` of this worker
    (``unreached``: slots no path from the roots reached)."""
    for i in unreached:
        grads[i] = UNREACHED
    try:
        state = ENGINE.get_or_create(context_id, pass_id, initiator, flags)
        node = _send_function(state, msg_id)
    except BaseException as e:  # noqa: BLE001
        _report(context_id, pass_id, initiator, exp, False, set(), e)
        return
    if getattr(state, "native", False):
        state.arrive(msg_id, node, grads, list(unreached), exp)
        return
    outputs = [GradientEdge(node, i) for i in range(len(grads))]
    _run_here_or_inline(state, exp, state.run_entry, msg_id, outputs, grads)


RECEIVER[0] = _propagate  # gradients shipped here arrive there
GRADIENT_RECEIVER[0] = _propagate  # ... in the agent's gradient layout (no pickle) where they fit


def _send_function(state: PassState, msg_id: int) -> Any:
    with state.ctx.lock:
        node = state.ctx.send_functions.get(msg_id)
    if node is None:
        gone = " (the context was released)" if state.ctx.released else ""
        raise RuntimeError(f"no send function with autograd message id {msg_id} in context "
                           f"{state.ctx.id} on worker {_agent().name}{gone}")
    return node


# -- the fallback: discovery, then resume ------------------------------------------
def _discover_remote(state: PassState, recvs: list) -> torch.futures.Future:
    by_worker: dict[int, list[int]] = collections.defaultdict(list)
    for r in recvs:
        _, msg_id, sender = r.dg_info
        by_worker[sender].append(msg_id)
    futs = [rpc_api.rpc_async(w, _discover, timeout=0,
                              args=(state.ctx.id, state.pass_id, state.initiator,
                                    state.flags, ids))
            for w, ids in by_worker.items()]
    return _all(futs)


@async_execution
def _discover(context_id: int, pass_id: tuple, initiator: int, flags: int,
              msg_ids: list[int]) -> torch.futures.Future:
    state = ENGINE.get_or_create(context_id, pass_id, initiator, flags)
    with state.lock:
        starts = []
        for m in msg_ids:
            if m not in state.discovered:
                state.discovered.add(m)
                starts.append(_send_function(state, m))
        recvs = state.walk_reach(starts)
    return _discover_remote(state, recvs)


def _resume(context_id: int, pass_id: tuple, exp: int) -> None:
    """One-way request: recount over what discovery reached and run what is complete."""
    _run_round_step(context_id, pass_id, exp, PassState.resume)


def _run_round_step(context_id: int, pass_id: tuple, exp: int, method: Callable) -> None:
    """Run ``method`` of this worker's share of the pass for a round the initiator began."""
    try:
        state = ENGINE.get_or_create(context_id, pass_id, pass_id[0], RETAIN)
    except BaseException as e:  # noqa: BLE001
        _report(context_id, pass_id, pass_id[0], exp, False, set(), e)
        return
    if getattr(state, "native", False):
        state.round_step("resume" if method is PassState.resume else "flush", exp)
        return
    _run_here_or_inline(state, exp, method, state)


def _resume_all(state: PassState, blocked: set) -> None:
    """A new round: each waiting worker resumes with a share of weight 1."""
    _round(state, blocked, _resume, state.resume)


def _flush(context_id: int, pass_id: tuple, exp: int) -> None:
    """One-way request: the pass is quiet; flush the DDP gradients held here."""
    _run_round_step(context_id, pass_id, exp, PassState.flush_ddp)


def _flush_all(state: PassState, holders: set) -> None:
    """A flush round: each worker holding DDP gradients flushes them, with a share of
    weight 1 (:meth:`PassState.flush_ddp`); the pass ends when they all reported."""
    _round(state, holders, _flush, state.flush_ddp)


def _round(state: PassState, workers: set, remote: Callable, local: Callable) -> None:
    """Start a round in which each of ``workers`` runs ``remote`` (a one-way request;
    ``local`` here), weight 1 split among them."""
    me, exp, mine = CONTAINER.worker_id, 0, None
    agent = _agent()
    for w in sorted(workers):
        exp += 1
        if w == me:
            mine = exp
        elif not agent.notify(w, remote, (state.ctx.id, state.pass_id, exp)):
            _fail(state, agent._lost_error(w))
            return
    if mine is not None:
        if getattr(state, "native", False):
            state.round_step("resume" if remote is _resume else "flush", mine)
        else:
            _run_here_or_inline(state, mine, local)
    _returned(state.pass_id, me, exp, False, set(), None)  # the rest of the round's weight


# -- the public entry ---------------------------------------------------------------
def start_backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool,
                   grad_tensors: Sequence[torch.Tensor] | None,
                   deliver: Callable[[BaseException | None], None],
                   inline: queue.SimpleQueue | None = None, create_graph: bool = False,
                   alone: bool = True) -> None:
    """Start a distributed backward pass; ``deliver(error or None)`` is called once,
    on whichever thread sees the pass end (a reading thread included). With ``inline``,
    this worker's later runs of the pass are queued there for the caller to run.
    ``create_graph``: every worker records the backward it runs (gradients shipped
    between workers as RPCs of the context), and the graph is retained."""
    if isinstance(roots, torch.Tensor) or not isinstance(roots, (list, tuple)):
        raise TypeError("backward(): incompatible function arguments. roots must be a list of "
                        f"tensors, got {type(roots).__name__}")
    ctx = CONTAINER.retrieve(context_id)
    with torch._C.DisableTorchFunction():   # (torch checks them in C++: no mode sees it)
        roots, grads = _check_roots(roots, grad_tensors)
    flags = ((RETAIN if retain_graph or create_graph else 0) | (CREATE_GRAPH if create_graph else 0)
             | (ANOMALY if anomaly_mode.enabled() else 0))
    state = ENGINE.new_pass(ctx, flags, roots, grads)
    native = getattr(state, "native", False)
    state.inline = None if native else inline
    state.user_grads = grad_tensors is not None
    if not native and (inline is None or alone) and state.alone():
        _run_alone(state, roots, grads, deliver)
        return state
    rounds = [0]

    def finish(exc: BaseException | None) -> None:
        if native:
            with state.term_lock:
                state.finished = True
        ENGINE.finish(state)
        if exc is not None:
            _abort(state)
        deliver(exc)
        if native:   # the initiator's task completes (its final callbacks run) or stops
            if exc is not None:
                state.abort()
            else:
                state.release()

    def on_round(exc: BaseException | None, blocked: set) -> None:
        if exc is not None or not blocked:
            finish(exc)
            return
        rounds[0] += 1
        if rounds[0] > _MAX_RESUMES:
            with state.term_lock:
                state.finished = True
            finish(RuntimeError(f"distributed backward in context {ctx.id} did not settle: "
                                f"workers {sorted(blocked)} still wait for gradients"))
            return
        # Someone waits for a gradient that may never come: find what is reachable
        # (not on a reading thread: it walks graphs and waits for replies).
        _agent().callbacks.submit(discover, blocked)

    def discover(blocked: set) -> None:
        if rounds[0] == 1:
            with ENGINE.lock:
                ENGINE.stats["passes_discovered"] += 1
            with state.lock:
                recvs = state.walk_reach([r.grad_fn for r in roots])
            disc = _discover_remote(state, recvs)
        else:
            disc = _done([])
        disc.add_done_callback(lambda f: after_discovery(f, blocked))

    def after_discovery(f: torch.futures.Future, blocked: set) -> None:
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001
            _fail(state, e)
            return
        # a worker may wait for a gradient whose way runs through another worker's native
        # share held up by a send function that will get nothing (not blocked there:
        # nothing reached those nodes yet): every open share (they report "held") retires
        # what discovery did not reach, and the initiator's share resumes too
        with state.term_lock:
            blocked = set(blocked) | state.ddp_holders | {CONTAINER.worker_id}
        _resume_all(state, blocked)

    state.on_round = on_round
    if native:
        # the caller drives it: _backward_inline on its thread, backward_async on a runner
        state.first_exp = 0
        return state
    _run(state, 0, state.run_entry, "root", list(roots), grads)
    return state


def _run_alone(state: PassState, roots: list, grads: list,
               deliver: Callable[[BaseException | None], None]) -> None:
    """A pass nobody else takes part in (:meth:`.PassState.alone`): its one region runs
    here and the pass ends, without the weights that count other workers' runs."""
    err = None
    prev = (getattr(_tls, "state", None), getattr(_tls, "exp", 0), getattr(_tls, "targets", None),
            getattr(_tls, "shipped", None))
    _tls.state, _tls.exp, _tls.targets, _tls.shipped = state, 0, set(), set()
    outer_ctx = CONTAINER.set_current(None)   # no current context in a pass (see _run)
    state.running += 1
    checkpoints = state.checkpoints
    if checkpoints:
        _checkpoint.enter(state, checkpoints)
    tr = _observe.ACTIVE
    t0 = local_ns() if tr is not None else 0
    try:
        with torch.set_grad_enabled(False):
            state.run_entry("root", roots, grads)
    except BaseException as e:  # noqa: BLE001 - the pass's error
        err = backward_error(e)
    finally:
        if checkpoints:
            _checkpoint.leave(state, checkpoints)
        state.running -= 1
        CONTAINER.set_current(outer_ctx)
        _tls.state, _tls.exp, _tls.targets, _tls.shipped = prev
        state.finished = True
        ENGINE.finish(state)
        if tr is not None:
            tr.span("backward run (local only)", "backward", t0, {"pass": state.trace_key()})
    deliver(err)


def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                   grad_tensors: Sequence[torch.Tensor] | None = None,
                   create_graph: bool = False) -> torch.futures.Future:
    """Start a distributed backward pass; returns a Future done when every worker is done."""
    result = torch.futures.Future()
    agent = _agent()

    def complete(exc: BaseException | None) -> None:
        if exc is None:
            result.set_result(None)
        else:
            if isinstance(exc, AnomalyError):
                anomaly_mode.complete(exc, context_id)
            fail(result, exc)

    def deliver(exc: BaseException | None) -> None:
        # never run the caller's callbacks on a reading thread (nor block one)
        if agent.transport.on_io_thread() or isinstance(exc, AnomalyError):
            agent.callbacks.submit(complete, exc)
        else:
            complete(exc)

    native = [False]
    outcome: list = [None]

    def deliver_any(exc: BaseException | None) -> None:
        if native[0]:   # completed once the initiator's task did (its final callbacks ran)
            outcome[0] = exc
        else:
            deliver(exc)

    state = start_backward(context_id, roots, retain_graph, grad_tensors, deliver_any,
                           create_graph=create_graph)
    if getattr(state, "native", False):
        native[0] = True
        state.after_drive = lambda: complete(outcome[0])
        native_pass._start(state)
    return result


def backward_sync(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False,
                  grad_tensors: Sequence[torch.Tensor] | None = None,
                  create_graph: bool = False) -> None:
    """:func:`backward_async` + wait, woken straight from the thread that sees the end.

    Under torch's profiler the calling thread runs every piece of the pass that
    falls to this worker (the profiler records one thread), inside a
    ``torch::distributed::autograd::backward`` range, as torch's engine shows it."""
    if torch.autograd._profiler_enabled():
        with torch.autograd.profiler.record_function("torch::distributed::autograd::backward"):
            return _backward_inline(context_id, roots, retain_graph, grad_tensors, create_graph,
                                    alone=False)
    # Every run of this pass on this worker happens here, on the caller's thread, under
    # its thread-local state (dispatch and function modes, autocast, grad mode...), as
    # torch's GraphTask carries the caller's state to wherever a gradient resumes it.
    return _backward_inline(context_id, roots, retain_graph, grad_tensors, create_graph)


def _next_task(tasks: queue.SimpleQueue) -> Any:
    """The next task, looking for DISTGRAD_SPIN_US first (yielding the core between
    looks) before sleeping: a short hop then wakes no sleeping thread."""
    spin = _reading.SPIN_S
    if spin:
        stop = time.perf_counter() + spin
        while time.perf_counter() < stop:
            _reading._yield()
            try:
                return tasks.get_nowait()
            except queue.Empty:
                pass
    return tasks.get()


def _backward_inline(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool,
                     grad_tensors: Sequence[torch.Tensor] | None, create_graph: bool,
                     alone: bool = True) -> None:
    """Run the pass, and every later run of it on this worker, on this thread (the
    reading threads queue them here); ``alone``: a pass no other worker takes part in
    runs at once, without the queue."""
    tasks: queue.SimpleQueue = queue.SimpleQueue()
    state = start_backward(context_id, roots, retain_graph, grad_tensors,
                           lambda exc: tasks.put((None, exc)), inline=tasks,
                           create_graph=create_graph, alone=alone)
    if getattr(state, "native", False):
        if torch._C._current_graph_task_id() == -1:
            # one graph task of torch's engine, driven here until the pass ends everywhere
            state.drive(0)
        else:
            # called from inside a backward (a hook): this thread's engine queue is that
            # backward's, so a runner thread drives the share (the task still carries
            # this thread's state) while this one waits
            done = threading.Event()
            state.after_drive = done.set
            native_pass._start(state)
            done.wait()
        _, exc = tasks.get()
        if exc is None:
            exc = state.late_error   # a final callback of this worker's task raised
        if exc is not None:
            raise exc
        return
    while True:
        state, *task = _next_task(tasks)
        if state is None:
            if task[0] is not None:
                if isinstance(task[0], AnomalyError):
                    anomaly_mode.complete(task[0], context_id)
                raise task[0]
            return
        exp, fn, args = task
        _run(state, exp, fn, *args)


def debug_info() -> dict[str, int]:
    """torch's two counters: ``num_current_backward_passes`` and ``num_autograd_contexts``."""
    passes = ENGINE.current_passes()
    with CONTAINER.lock:
        contexts = len(CONTAINER.contexts)
    return {"num_current_backward_passes": passes, "num_autograd_contexts": contexts}
