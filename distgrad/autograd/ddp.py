"""DistributedDataParallel inside a distributed backward, wherever its parameters are.

DDP averages gradients from hooks on its parameters' AccumulateGrad nodes, and
its reducer writes the averaged gradient back at the end of the engine call in
which the last bucket became ready. It expects one backward: every parameter's
hook, then the end. A distributed backward instead runs a worker's graph in
pieces (the root's region, later the region behind each send function, as
their gradients arrive), and captures leaf gradients without running
AccumulateGrad. So the engine (:mod:`.share`) *holds* the gradients of DDP's
parameters until the pass is quiet everywhere (no gradient in flight, no run
active), then :mod:`.engine` asks each worker that holds some to *flush*: all
of them go to their AccumulateGrad nodes in one run of torch's own distributed
engine, in a torch distributed autograd context of its own (:func:`synced`): the
hooks fire, buckets fill, the all-reduce runs, and the reducer, finding that
context on its thread, reads and writes the gradients there
(``Reducer::runGradCallbackForVariable``), exactly as under torch's distributed
autograd; ``.grad`` is never touched. The context thus holds what torch's
context holds with DDP: the group's average, whether DDP's layers lie before,
after or on both sides of an RPC.

``find_unused_parameters=True``: DDP's forward looks for its unused parameters
by walking the local graph from the outputs, and stops at a recv function, so a
layer before an RPC would look unused. Inside a distributed autograd context
that search is therefore deferred to the flush, where the pass has shown which
parameters got a gradient (the others are the unused ones).

DDP's parameters are known without replacing anything of DDP: a global hook on
module registration (``torch.nn.modules.module.register_module_module_registration_hook``,
torch's public API, registered when this module is imported) sees every DDP
assign its ``module`` in its constructor; its parameters are taken in once the
constructor finished (it has a reducer), at the first pass that looks. Nothing is
checked while no DDP exists. The deferred search is the one replacement:
``Reducer.prepare_for_backward``, a pass-through wrapper that is in only while
RPC is up (:func:`attach` .. :func:`detach`) and some DDP exists (no distributed
autograd context can have RPCs otherwise).

Example::

    >>> model = DistributedDataParallel(Hybrid(fc1, remote_emb, fc2), process_group=trainers)
    >>> with dist_autograd.context() as cid:
    ...     loss = model(x).sum()                    # fc1 -> RPC -> fc2
    ...     dist_autograd.backward(cid, [loss])      # every trainer gets the average
"""
from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .context import CONTAINER
from .nodes import _engine_run_backward

_params: dict[int, weakref.ref] = {}            # id -> parameter some DDP instance syncs
_owner: dict[int, weakref.ref] = {}             # id of a parameter -> its DDP instance
_pending: weakref.WeakSet = weakref.WeakSet()   # DDP instances seen, constructor not done
_deferred: dict[int, Any] = {}                  # id(reducer) -> reducer whose unused-search waits
_groups: dict[int, Any] = {}                    # id(DDP taken in) -> its process group (_hold_group)
_retired: list = []                             # groups of DDP instances gone, let go at the next look
_lock = threading.Lock()                        # one flush at a time (DDP's reducer is not thread-safe)
_state_lock = threading.Lock()                  # the books above and the wrapper's place
active = [False]                                # some DDP was seen
_rpc_up = [False]
on_active: list = []                            # called once when the first DDP is seen

try:
    from torch.distributed import Reducer
    from torch.nn.parallel import DistributedDataParallel as _DDP
    _original_prepare = Reducer.prepare_for_backward
except ImportError:  # a torch without distributed
    Reducer = _DDP = _original_prepare = None


def _on_module_registration(module: Any, name: str, submodule: Any) -> None:
    """torch's global module-registration hook: a DDP assigning its ``module``."""
    if name == "module" and isinstance(module, _DDP):
        with _state_lock:
            _pending.add(module)
            first = not active[0]
            active[0] = True
            _place_wrapper()
        if first:
            for fn in list(on_active):   # (the native engine turns its DDP capture on)
                fn()


def _adopt() -> None:
    """Take in the parameters of the DDP instances whose constructor finished."""
    with _state_lock:
        for ddp in list(_pending):
            if "reducer" not in ddp.__dict__:
                continue  # still constructing (or its constructor failed)
            _pending.discard(ddp)
            _hold_group(ddp)
            me = weakref.ref(ddp)
            for p in ddp.module.parameters():
                if p.requires_grad:
                    _params[id(p)] = weakref.ref(p, lambda _r, k=id(p): (_params.pop(k, None),
                                                                          _owner.pop(k, None)))
                    _owner[id(p)] = me


def _hold_group(ddp: Any) -> None:
    """Keep a Python reference to ``ddp``'s process group until the DDP is gone.

    torch's ``Reducer`` holds its process group through a C++ ``shared_ptr`` and
    is freed with the GIL held. When it holds the group's last reference (a
    program that calls ``destroy_process_group()`` and then drops its DDP, as
    torch's ``DdpComparisonTest`` does), ``~ProcessGroupGloo`` joins gloo's worker
    threads under the GIL, while one of them waits for the GIL to free a finished
    all-reduce whose tensor's Python object was dropped: the process hangs for
    good. That is torch's own bug: ten rounds of that test's body in a loop (DDP,
    ``join()`` over uneven inputs, ``destroy_process_group()``) hung 3 of 6 runs
    with torch's RPC and distributed autograd, 9 of 9 with distgrad's, and 0 of 6
    with the group kept this way. A group's last Python
    reference goes through torch's holder that releases the GIL while the group
    is destroyed, so distgrad keeps one for every DDP it takes in, and lets it go
    after the DDP (and its reducer) are gone: at the next pass that looks, at
    ``rpc.shutdown()``, or at the interpreter's exit."""
    pg = getattr(ddp, "process_group", None)
    if pg is None:
        return
    key = id(ddp)
    _groups[key] = pg
    weakref.finalize(ddp, _retire, key).atexit = False


def _retire(key: int) -> None:
    """(during the DDP's deallocation, its reducer still alive) its group waits in _retired."""
    pg = _groups.pop(key, None)
    if pg is not None:
        _retired.append(pg)


def _let_go() -> None:
    """Drop the groups of DDP instances gone (each ``pop`` may destroy a group, GIL released)."""
    while _retired:
        try:
            _retired.pop()
        except IndexError:  # another thread took the last one
            break


def attach() -> None:
    """RPC is up: the deferred unused-parameter search is needed once a DDP exists."""
    with _state_lock:
        _rpc_up[0] = True
        _place_wrapper()


def detach() -> None:
    """RPC shut down: torch's ``Reducer.prepare_for_backward`` again."""
    with _state_lock:
        _rpc_up[0] = False
        _deferred.clear()
        _place_wrapper()
    _let_go()


def _place_wrapper() -> None:
    """The wrapper in exactly while RPC is up and some DDP exists (caller holds the lock)."""
    if Reducer is None:
        return
    want = _rpc_up[0] and active[0]
    if want and Reducer.prepare_for_backward is _original_prepare:
        Reducer.prepare_for_backward = _prepare_for_backward
    elif not want and Reducer.prepare_for_backward is _prepare_for_backward:
        Reducer.prepare_for_backward = _original_prepare


def _prepare_for_backward(self, outputs):
    ctx = CONTAINER.current() if outputs else None
    if ctx is not None and (ctx.send_functions or ctx.recv_functions):
        # find_unused_parameters after RPCs inside a distributed autograd context:
        # the local graph ends at recv functions, so the search waits for the flush
        _deferred[id(self)] = self
        return None
    return _original_prepare(self, outputs)


atexit.register(_let_go)  # before the interpreter tears modules down

if _original_prepare is not None:
    for _attr in ("__name__", "__qualname__", "__doc__"):
        setattr(_prepare_for_backward, _attr, getattr(_original_prepare, _attr, None))
    _prepare_for_backward.__wrapped__ = _original_prepare  # type: ignore[attr-defined]
    torch.nn.modules.module.register_module_module_registration_hook(_on_module_registration)


def _is_ddp(t: torch.Tensor) -> bool:
    ref = _params.get(id(t))
    return ref is not None and ref() is t


def held(leaves: Sequence[Any], grads: Sequence) -> list[int]:
    """Indices of the gradients in ``grads`` (one per AccumulateGrad node of
    ``leaves``) that belong to a DDP parameter: the engine holds those until the
    pass's flush."""
    if not _take_in() or not _params:
        return []
    return [i for i, g in enumerate(grads) if g is not None and _is_ddp(leaves[i].variable)]


def _take_in() -> bool:
    """Whether some DDP was seen; if so, the groups of DDPs gone let go and the DDPs
    whose constructor finished taken in."""
    if not active[0]:
        return False
    if _retired:
        _let_go()
    if _pending:
        _adopt()
    return True


def _owner_of(v: Any) -> Any:
    """The DDP instance that syncs parameter ``v`` (None when none does, or it is gone)."""
    ref = _owner.get(id(v))
    return ref() if ref is not None else None


def _search_unused(variables: list) -> None:
    """Run the unused-parameter search that DDP's forward deferred (see above), with
    the parameters that got a gradient in this pass as what the outputs reached."""
    owners: dict[int, list] = {}
    for v in variables:
        module = _owner_of(v)
        if module is not None and id(module.reducer) in _deferred:
            owners.setdefault(id(module.reducer), []).append(v)
    for key, vs in owners.items():
        reducer = _deferred.pop(key)
        with torch.enable_grad():
            reached = [v.view_as(v) for v in vs]
        _original_prepare(reducer, reached)


class _Feed(torch.autograd.Function):
    """A root whose backward hands each of its inputs (DDP's parameters) the gradient
    the pass holds for it, as it is: no arithmetic, dense or sparse."""

    @staticmethod
    def forward(ctx, grads, *variables):  # noqa: D102
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _grad):  # noqa: D102
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


_torch_dist: list = []  # torch's C++ distributed autograd, its container initialized, or None


def in_torch_context() -> bool:
    """Whether the flush runs in a torch distributed autograd context (see :func:`synced`)."""
    return _torch_dist_autograd() is not None


def _torch_dist_autograd() -> Any:
    """torch's own distributed autograd, its container initialized (None where this
    torch has none, as on Windows: there DDP's reducer only ever writes ``.grad``).

    Taken from ``torch._C._distributed_autograd``, the C++ module that
    ``torch.distributed.autograd`` re-exports, never through the Python name: code
    written for torch often runs with ``sys.modules["torch.distributed.autograd"]``
    set to distgrad's package (imports swapped by module patching, as torch's own
    test suites are run on distgrad), and the flush would then call distgrad's
    ``backward`` from inside distgrad's backward, waiting on the flush lock it
    holds: every DDP pass hung."""
    if not _torch_dist:
        c = getattr(torch._C, "_distributed_autograd", None)
        if c is None and hasattr(torch._C, "_dist_autograd_init"):
            torch._C._dist_autograd_init()  # what importing torch.distributed.autograd does
            c = getattr(torch._C, "_distributed_autograd", None)
        if c is not None:
            try:
                c._init(max(CONTAINER.worker_id, 0))
            except RuntimeError:
                pass  # initialized already (any worker id serves a local context)
        _torch_dist.append(c)
    return _torch_dist[0]


def _refuse_static_graph(variables: list) -> None:
    """DDP(static_graph=True) delays its first all-reduce to a callback queued on the
    engine call that runs DDP's output node, which in a distributed backward ends
    before the gradients reach DDP: it would average nothing. Refused, not wrong."""
    for v in variables:
        module = _owner_of(v)
        if module is not None and getattr(module, "static_graph", False):
            raise RuntimeError(
                "DistributedDataParallel(static_graph=True) is not supported inside a "
                "distgrad distributed backward (its delayed all-reduce would average "
                "nothing); construct the DDP without static_graph")


def _reach_all(variables: list) -> list:
    """DDP instances with ``find_unused_parameters`` (dynamic graph) whose parameters
    are among ``variables`` (this pass's gradients): their reducers prepared again
    with every parameter reached, and the parameters that got no gradient returned,
    to be given zeros. Under a distributed autograd context the reducer reads each
    gradient from the context and asserts it is there, so an unused parameter needs
    one; zeros are what DDP's average counts an unused parameter as, and they are
    not put in distgrad's context (the caller keeps only ``variables``)."""
    have = {id(v) for v in variables}
    unused: list = []
    seen: set = set()
    for v in variables:
        module = _owner_of(v)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        if not (module.find_unused_parameters and not getattr(module, "static_graph", False)
                and module.require_backward_grad_sync):
            continue
        _deferred.pop(id(module.reducer), None)
        params = [p for p in module.module.parameters() if p.requires_grad]
        with torch.enable_grad():
            reached = [p.view_as(p) for p in params]
        _original_prepare(module.reducer, reached)
        unused.extend(p for p in params if id(p) not in have)
    return unused


def synced(leaves: Sequence[Any], grads: Sequence) -> Sequence:
    """``grads`` (one per AccumulateGrad node in ``leaves``) with those of DDP's
    parameters replaced by what DDP makes of them (the average over its group).

    As torch runs DDP under distributed autograd: one run of torch's distributed
    engine, in a context of its own, from a root that hands each parameter its
    held gradient, through their AccumulateGrad nodes. torch's engine captures
    them there (the node's pre-hooks and post-hooks run, DDP's among them, as
    ``DistAccumulateGradCaptureHook`` runs them); DDP's reducer, finding a
    distributed autograd context on the thread, reads and writes the gradients
    in that context (``Reducer::runGradCallbackForVariable``), never ``.grad``,
    and post-accumulate-grad hooks do not run (torch's do not). The leaves' own
    tensor hooks do not run again (the pass applied them when it captured the
    gradients). Where torch has no distributed autograd (Windows), the reducer
    writes ``.grad`` whatever it is given: there ``.grad`` is lent to it for the
    call (:func:`_synced_through_grad`)."""
    idx = held(leaves, grads)
    if not idx:
        return grads
    tda = _torch_dist_autograd()
    out = list(grads)
    variables = [leaves[i].variable for i in idx]
    _refuse_static_graph(variables)
    with _lock:
        unused = _reach_all(variables) if tda is not None else []
        if _deferred:
            _search_unused(variables)
        if tda is None:
            for i, g in zip(idx, _synced_through_grad(leaves, idx, grads, variables)):
                out[i] = g
            return out
        fed = variables + unused
        hooked = [(v, v._backward_hooks) for v in fed if v._backward_hooks]
        for v, _ in hooked:
            v._backward_hooks = None
        try:
            tcid = tda._new_context()._context_id()  # torch.distributed.autograd.context()
            try:
                gs = tuple(grads[i].detach() for i in idx) + tuple(torch.zeros_like(v) for v in unused)
                with torch.enable_grad():
                    root = _Feed.apply(gs, *fed)
                tda.backward(tcid, [root])
                got = tda.get_gradients(tcid)
                for i, v in zip(idx, variables):
                    out[i] = got.get(v)
            finally:
                tda._release_context(tcid)
        finally:
            for v, hooks in hooked:
                v._backward_hooks = hooks
    return out


def _synced_through_grad(leaves: Sequence[Any], idx: list, grads: Sequence,
                         variables: list) -> list:
    """DDP's average where torch has no distributed autograd: the held gradients
    through the AccumulateGrad nodes, ``.grad`` lent to DDP for the call and put
    back after (the caller holds ``_lock``)."""
    saved = [v.grad for v in variables]
    hooked = [(v, v._backward_hooks) for v in variables if v._backward_hooks]
    for v in variables:
        v.grad = None
    for v, _ in hooked:
        v._backward_hooks = None
    try:
        edges = tuple(GradientEdge(leaves[i], 0) for i in idx)
        gs = tuple(grads[i].detach() for i in idx)
        if _engine_run_backward is not None:
            _engine_run_backward(edges, gs, False, False, (), True, accumulate_grad=True)
        else:  # older torch: the public call accumulates the same way
            torch.autograd.backward(edges, gs)
        return [v.grad for v in variables]
    finally:
        for v, s in zip(variables, saved):
            v.grad = s
        for v, hooks in hooked:
            v._backward_hooks = hooks


# -- the native engine (native_pass.py): DDP's parameters captured inside its graph task --

def is_param(v: torch.Tensor) -> bool:
    """Whether ``v`` is a parameter some DDP instance syncs (taking in new instances)."""
    return _take_in() and _is_ddp(v)


def native_ok() -> bool:
    """Whether a native share can take DDP's parameters in (dist_share.cpp, ddp_capture):
    torch's distributed autograd is there (its context holds them, as under torch's
    engine), and no DDP searches for unused parameters (``find_unused_parameters``: the
    forward's search stops at recv functions; the Python engine's flush searches with
    what the pass reached)."""
    if not active[0]:
        return True
    if _torch_dist_autograd() is None:
        return False
    if _pending:
        _adopt()
    owners = {id(m): m for m in (r() for r in list(_owner.values())) if m is not None}
    return not any(m.find_unused_parameters and not getattr(m, "static_graph", False)
                   for m in owners.values())


def native_take(v: torch.Tensor) -> None:
    """A native share is about to capture DDP's parameter ``v``: refused for
    ``static_graph=True`` (:func:`_refuse_static_graph`)."""
    _refuse_static_graph([v])
