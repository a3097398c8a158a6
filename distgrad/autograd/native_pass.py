"""One worker's share of a distributed backward pass on the native engine
(:mod:`.native`, ``native/dist_share.cpp``): one ``GraphTask`` of torch's own engine
per worker per pass, as torch's ``DistEngine`` runs it.

The task's dependencies are computed once over the whole share (the roots and
every send function of the context); gradients that arrive over RPC are fed
into the running task; the caller's thread-local state is the task's (torch's
``ThreadLocalStateGuard`` restores it around every node); leaves' gradients go
to the context by torch's own ``AccumulateGrad::accumulateGrad`` rules; hooks,
``queue_callback``, multi-grad hooks and graph freeing are torch's. Nothing is
run by hand.

The pass speaks the same messages as the Python engine (:mod:`.share`,
:mod:`.engine`), so one worker may run its share natively and another in
Python: gradients as one-way requests with a weight, and weight reports to the
initiator. A share reports when its queue runs dry (the idle marker of the C++
module), with the weight it holds, whether nodes wait for gradients that have
not come (``blocked``) and whether its task holds final callbacks. A send
function that will never get a gradient (an unused RPC result) is retired after
the initiator's discovery: the nodes behind it lose that dependency, as if no
path reached them.

The thread that drives a share: the caller of ``backward`` on the initiator;
on every other worker a runner thread, from the first gradient until the
initiator ends the pass (``ag_release``, or a round of weight when a task holds
final callbacks, so that they ran everywhere before ``backward`` returns).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .. import observe as _observe
from ..observe import local_ns
from . import ddp, rpc_functions
from . import native as _build
from .context import CONTAINER, DistAutogradContext
from .gradients import RECEIVER, _agent, backward_error

M: Any = None                    # the compiled module, once loaded
PASSES: dict[int, NativePass] = {}   # share id -> pass, while its share lives
_LOCK = threading.Lock()


def module() -> Any:
    """The native module (loaded, built if needed, once), or None: the Python engine
    then runs every pass (``distgrad.autograd.native.WHY_NOT`` says why)."""
    global M
    if M is None and _build.wanted():
        m = _build.load()
        if m is not None:
            m.set_callbacks(_ship, _idle, _enter, _leave, _grad_of, _store)
            rpc_functions.use_native_types(m.SendType, m.RecvType)
            M = m
            m.set_ddp(_ddp_capture, ddp.active[0])
            ddp.on_active.append(lambda: m.set_ddp(_ddp_capture, True))
    return M


def share_of(context_id: int, pass_id: tuple) -> NativePass | None:
    """This worker's live native share of ``pass_id`` in context ``context_id`` (also
    once the context was released here), or None."""
    for st in list(PASSES.values()):
        if st.pass_id == pass_id and st.ctx.id == context_id:
            return st
    return None


def is_native_node(node: Any) -> bool:
    return M is not None and type(node) in (M.SendType, M.RecvType)


# -- the C++ module's callbacks (the thread driving a share, or a feeding thread) ----
def _ship(share_id: int, context_id: int, msg_id: int, sender: int, grads: list,
          unreached: list, exp: int) -> None:
    """A recv function ran (or nothing reached it): its gradients go to its sender
    with weight ``2**-exp`` taken from the share."""
    st = PASSES.get(share_id)
    if st is None:
        raise RuntimeError(f"recv function of context {context_id} ran outside a distributed "
                           "backward pass (use distgrad.autograd.backward)")
    if context_id != st.ctx.id:
        # a tensor received in another context fed this pass (torch fails the pass too)
        raise RuntimeError(f"recv function of context {context_id} ran in a distributed backward "
                           f"pass of context {st.ctx.id}: a tensor received in one context was used "
                           "in another's forward (use one context for both)")
    gone = st.ctx.lost_peers.get(sender)
    if gone is not None:
        raise gone
    _ready_on_every_device(grads)
    with st.lock:
        st.targets.add(sender)
    _agent().notify(sender, RECEIVER[0], (context_id, st.pass_id, st.initiator, st.flags, msg_id,
                                          list(grads), exp, list(unreached)),
                    reverse=msg_id not in st.ctx.recv_of_reply)   # (the inverse of its map)


def _ready_on_every_device(grads: list) -> None:
    """Gradients of a recv function on a device other than its stream's: torch's engine
    orders only the node's own stream (its first device input's) after the streams that
    made them; the others would be staged on their devices' current streams, which
    nothing ordered after those: each such device is synchronized first (a rare node:
    its tensors came in one message, to several devices)."""
    devs = {g.device for g in grads if g is not None and g.device.type != "cpu"}
    if not devs:
        return
    try:   # (the engine made the node's stream current, on its device)
        own = torch.accelerator.current_stream().device
    except (RuntimeError, ValueError, AttributeError):
        own = None
    for d in devs:
        if d != own:
            torch.get_device_module(d.type).synchronize(d)


def _idle(share_id: int, pieces: list, open_: bool) -> None:
    """The share's queue ran dry: return its weight to the initiator (``open_``: some of
    its send functions may still get gradients, so its task has not ended)."""
    st = PASSES.get(share_id)
    if st is not None:
        st.report(pieces, open_=open_)


def _enter(share_id: int) -> Any:
    # torch's capture hook sets its C++ thread-local context for DDP's reducer only: the
    # leaf's hooks see no current context from Python (none is current in a pass here)
    return None


def _leave(token: Any) -> None:
    pass


def _grad_of(share_id: int, leaf: Any) -> torch.Tensor | None:
    st = PASSES[share_id]
    st.ctx.acc_lock.acquire()
    try:
        return st.ctx.gradient_of(leaf)
    except BaseException:
        st.ctx.acc_lock.release()
        raise


def _ddp_capture(share_id: int, leaf: Any) -> bool:
    """Whether a captured leaf is DDP's parameter: its gradient then goes to the share's
    torch context, where DDP's reducer reads and writes it (dist_share.cpp, ddp_capture)."""
    if share_id not in PASSES or not ddp.is_param(leaf.variable):
        return False
    ddp.native_take(leaf.variable)
    return True


def _take_ddp_results(st: NativePass, ok: bool) -> None:
    """The share's task ended: DDP's results (its finalize ran among the task's final
    callbacks) go from the share's torch context into the context (the same tensor where
    the context's was taken in and added to in place); the torch context goes."""
    for v, g in st.share.ddp_gradients():
        if not ok:
            continue
        leaf = torch.autograd.graph.get_gradient_edge(v).node
        if st.ctx.gradient_of(leaf) is not g:
            st.ctx.replace(leaf, g)


def _store(share_id: int, leaf: Any, grad: torch.Tensor | None, ready: Any, stream_id: int) -> None:
    st = PASSES[share_id]
    try:
        if grad is not None:
            st.ctx.store(leaf, grad, ready, stream_id)
        elif ready is not None:   # (added into the held gradient in place)
            st.ctx.note_ready(ready, stream_id)
    finally:
        st.ctx.acc_lock.release()


# -- runner threads for the shares of passes started elsewhere ---------------------------
_idle_runners: list = []


def _runner(tasks: queue.SimpleQueue) -> None:
    while True:
        st = tasks.get()
        if st is None:
            return
        try:
            st.drive(st.first_exp)
            if st.after_drive is not None:
                st.after_drive()
        finally:
            with _LOCK:
                _idle_runners.append(tasks)


def _start(st: NativePass) -> None:
    with _LOCK:
        tasks = _idle_runners.pop() if _idle_runners else None
    if tasks is None:
        tasks = queue.SimpleQueue()
        threading.Thread(target=_runner, args=(tasks,), name="distgrad-share", daemon=True).start()
    tasks.put(st)


class NativePass:
    """One worker's share of one pass, on the native engine (see the module's doc)."""

    native = True
    shared = False
    first_exp: int | None = None     # initiator driven by a runner (backward_async): its weight
    late_error: BaseException | None = None   # raised by the task once the pass had ended
    after_drive: Any = None          # ... and what runs once its task completed
    nodes_run = 0
    checkpoints: list = []

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, initiator: int, flags: int,
                 share: Any, sends: dict, roots: Sequence[torch.Tensor] = ()) -> None:
        from .share import CREATE_GRAPH, RETAIN
        self.ctx, self.pass_id, self.initiator, self.flags = ctx, pass_id, initiator, flags
        self.retain_graph = bool(flags & (RETAIN | CREATE_GRAPH))
        self.create_graph = False
        self.anomaly = False
        self.aborted = False
        self.roots = list(roots)
        self.share = share
        self.sends = sends               # msg id -> send node, at first contact
        self.lock = threading.RLock()
        self.targets: set = set()        # workers shipped to since the last report
        self.fed: set = set()            # send functions that got their gradients
        self.discovered: set = set()
        self.reach: set | None = None
        self.reached_recvs: list = []    # recv functions discovery reached here
        self.running = 0
        self.started = False
        self.ack: list = []              # weight of a release round, returned once ended
        self.outcome: BaseException | None = None
        # initiator only: termination (engine._returned), as PassState's
        self.term_lock = threading.Lock()
        from fractions import Fraction
        self.weight = Fraction(0)
        self.round_blocked: set = set()
        self.ddp_holders: set = set()
        self.participants: set = {CONTAINER.worker_id}
        self.finished = False
        self.on_round = None
        self.inline = None
        self.user_grads = False
        PASSES[share.id] = self

    @classmethod
    def create(cls, ctx: DistAutogradContext, pass_id: tuple, initiator: int, flags: int,
               roots: Sequence[torch.Tensor] = (), grads: Sequence[torch.Tensor] = ()
               ) -> NativePass | None:
        """The native share of this pass, or None where the Python engine must run it
        (a send function recorded by the Python engine, a reentrant checkpoint)."""
        from .share import CREATE_GRAPH, RETAIN
        with ctx.lock:
            sends = dict(ctx.send_functions)
        if any(type(n) is not M.SendType for n in sends.values()):
            return None
        share = M.Share(bool(flags & (RETAIN | CREATE_GRAPH)), False, list(roots), list(grads),
                        list(sends.values()))
        if share.reentrant_checkpoint:
            share.forget()
            return None
        return cls(ctx, pass_id, initiator, flags, share, sends, roots)

    def resume(self) -> None:   # (the engine calls round_step on native shares)
        raise AssertionError("native shares resume through round_step")

    flush_ddp = resume

    # -- the engine's questions ---------------------------------------------------------
    def blocked(self) -> bool:
        return self.share.blocked()

    def holds_ddp(self) -> bool:
        return False

    def trace_key(self) -> str:
        return f"{self.pass_id[0]}.{self.pass_id[1]}"

    def walk_reach(self, starts: Sequence[Any]) -> list:
        """Discovery: mark what ``starts`` reach; returns the recv functions met."""
        from .walk import walk_reach
        if self.reach is None:
            self.reach = set()
        recvs = walk_reach(self.reach, starts)
        self.reached_recvs.extend(recvs)
        return recvs

    # -- gradients in -------------------------------------------------------------------
    def arrive(self, msg_id: int, node: Any, grads: list, unreached: Sequence[int], exp: int) -> None:
        """Gradients for send function ``msg_id`` came with weight ``2**-exp``."""
        from .engine import _report
        if self.aborted:
            _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), None)
            return
        with self.lock:
            self.fed.add(msg_id)
        try:
            ok = self.share.feed(node, [g if isinstance(g, torch.Tensor) else None for g in grads],
                                 list(unreached), exp)
        except BaseException as e:  # noqa: BLE001 - the pass's error
            _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), backward_error(e))
            return
        if not ok:   # the share ended (the pass did): nothing in flight can be lost
            _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), None)
            return
        if self.initiator != CONTAINER.worker_id:
            self.ensure_running()

    def ensure_running(self) -> None:
        with self.lock:
            if self.started:
                return
            self.started = True
        _start(self)

    def round_step(self, kind: str, exp: int) -> None:
        """A round the initiator began: ``resume`` (discovery is done: send functions it
        did not reach will get nothing) or ``flush`` (the pass is quiet: end the task,
        its final callbacks run, then return the weight)."""
        from .engine import _report
        if kind == "resume":
            with self.lock:
                dead = [n for m, n in self.sends.items() if m not in self.discovered and m not in self.fed]
            # a recv function discovery reached that dies with them still tells its
            # sender, whose send function discovery counted as one to wait for
            ok = self.share.retire(dead, list(self.reached_recvs), exp)
            if not ok:
                _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), None)
            elif self.initiator != CONTAINER.worker_id:
                self.ensure_running()
            return
        if self.initiator == CONTAINER.worker_id:
            # the initiator's task ends when its backward returns: its callbacks then run
            _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), None)
            return
        with self.lock:
            self.ack.append(exp)
        self.share.release()
        self.ensure_running()

    # -- weight out ---------------------------------------------------------------------
    def report(self, pieces: list, err: BaseException | None = None, open_: bool = False) -> None:
        """Return weight; ``open_`` (a share of a pass started elsewhere whose task has not
        ended): the initiator ends it with a round once the pass is quiet (``held``)."""
        from .engine import _report
        with self.lock:
            targets, self.targets = self.targets, set()
        blocked = err is None and self.share.blocked()
        held = open_ and err is None and self.initiator != CONTAINER.worker_id
        _report(self.ctx.id, self.pass_id, self.initiator, list(pieces), blocked, targets, err, held)

    # -- the task ------------------------------------------------------------------------
    def drive(self, exp: int | None = None) -> None:
        """Run the task on this thread until the pass ends here (``release``)."""
        prev = CONTAINER.set_current(None)   # a pass's nodes run outside any context
        err = None
        tr = _observe.ACTIVE
        t0 = local_ns() if tr is not None else 0
        self.running += 1
        try:
            ok = False
            try:
                self.share.run(exp)
                ok = True
            finally:
                if ddp.active[0]:
                    _take_ddp_results(self, ok)
        except BaseException as e:  # noqa: BLE001 - the pass's error
            if not self.aborted:
                err = backward_error(e)
        finally:
            self.running -= 1
            CONTAINER.set_current(prev)
            if tr is not None:
                tr.span("backward run (native share)", "backward", t0, {"pass": self.trace_key()})
        pieces = self.share.take_pieces()
        with self.lock:
            pieces += self.ack
            self.ack = []
        self.end()
        if err is not None and self.finished and self.initiator == CONTAINER.worker_id:
            # the pass had ended (a final callback of the initiator's task raised): the
            # caller raises it
            self.late_error = err
            return
        if err is not None or pieces:
            self.report(pieces, err) if err is None else self._report_error(pieces, err)

    def _report_error(self, pieces: list, err: BaseException | None) -> None:
        from .engine import _report
        with self.lock:
            targets, self.targets = self.targets, set()
        _report(self.ctx.id, self.pass_id, self.initiator, list(pieces), False, targets, err)

    def release(self) -> None:
        """The pass ended: the task completes on the thread driving it."""
        self.share.release()

    def abort(self) -> None:
        """The pass failed elsewhere (or cannot end): stop running the share."""
        self.aborted = True
        self.share.abort()
        self.end_if_idle()

    def end_if_idle(self) -> None:
        """A share of a pass started elsewhere that nobody started (a discovery built
        it, no gradient came) ends now: nobody else would end it."""
        with self.lock:
            idle = not self.started and self.initiator != CONTAINER.worker_id
            self.started = True   # (nothing starts it now)
        if idle:
            self.aborted = True
            self.share.abort()
            pieces = self.share.take_pieces()
            self.end()
            if pieces:   # (weight an arrival brought just now still goes back)
                self._report_error(pieces, None)

    def end(self) -> None:
        PASSES.pop(self.share.id, None)
        self.share.forget()
        with self.ctx.lock:
            if self.ctx.passes.get(self.pass_id) is self:
                del self.ctx.passes[self.pass_id]
            # a late discovery or round for this pass must not build a new share
            self.ctx.ended_passes.add(self.pass_id)


class EndedShare:
    """This worker's share of a pass that already ended here: a discovery still walks
    from its send functions; a round or a late message only returns its weight."""

    native = True
    shared = False
    nodes_run = 0
    running = 0
    aborted = True

    def __init__(self, ctx: DistAutogradContext, pass_id: tuple, initiator: int, flags: int) -> None:
        self.ctx, self.pass_id, self.initiator, self.flags = ctx, pass_id, initiator, flags
        self.lock = threading.RLock()
        self.discovered: set = set()
        self.reach: set | None = None
        self.reached_recvs: list = []

    walk_reach = NativePass.walk_reach

    def blocked(self) -> bool:
        return False

    def holds_ddp(self) -> bool:
        return False

    def _back(self, exp: int) -> None:
        from .engine import _report
        _report(self.ctx.id, self.pass_id, self.initiator, exp, False, set(), None)

    def arrive(self, msg_id: int, node: Any, grads: list, unreached: Sequence[int], exp: int) -> None:
        self._back(exp)

    def round_step(self, kind: str, exp: int) -> None:
        self._back(exp)

    def release(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def end_if_idle(self) -> None:
        pass
