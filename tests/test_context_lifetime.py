"""A distributed autograd context's lifetime as torch's: a context this worker
opened survives rpc.shutdown() (torch's container is not the agent's), and a reply
that requires grad made in a context released meanwhile is an error at the
caller, never a tensor cut off from the graph (real workers, spawn)."""
import time

import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.errors import ContextReleasedError

pytestmark = pytest.mark.timeout(120)


def _slow_mul(t):
    time.sleep(0.5)
    return t * 2


def _release_while_running(rank, world):
    if rank != 0:
        return None
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context():
        fut = rpc.rpc_async("worker1", _slow_mul, args=(x,))
    try:
        got = fut.wait()
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "returned", (got.requires_grad, got.grad_fn is None)


def test_reply_for_a_released_context_is_an_error_at_the_caller():
    out = run_workers(_release_while_running, world_size=2)
    kind, what = out[0]
    assert kind == ContextReleasedError.__name__, out[0]
    assert "Couldn't find autograd context data" in what and "worker1" in what


def _context_survives_shutdown(rank, world):
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker0", torch.mul, args=(x, 2))
        dist_autograd.backward(cid, [y.sum()])
        rpc.shutdown()
        grad = dist_autograd.get_gradients(cid)[x].tolist()
        n = int(dist_autograd._get_debug_info()["num_autograd_contexts"])
    return grad, n, int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def test_an_open_context_survives_shutdown():
    out = run_workers(_context_survives_shutdown, world_size=1, init=True, graceful=True)
    assert out[0] == ([2.0, 2.0, 2.0], 1, 0)


def _hooks_see_no_context(rank, world, want):
    import clean_ref
    import context_ref
    if rank != 0:
        return None
    seen = {}

    def hook(name):
        def fn(g):
            try:
                dist_autograd._current_context()
                seen[name + "_current"] = "a context"
            except RuntimeError as e:
                seen[name + "_current"] = str(e)
            try:
                with dist_autograd.context() as own:
                    seen[name + "_own"] = own != cid
            except RuntimeError as e:
                seen[name + "_own"] = str(e)
        return fn

    with dist_autograd.context() as cid:
        (x1, x2), a, b, remote = context_ref.hook_program(
            lambda to, fn, args: rpc.rpc_sync(to, fn, args=args))
        a.register_hook(hook("local"))     # runs in the root's share, on the caller's thread
        b.register_hook(hook("returned"))  # runs once the gradient came back over RPC
        dist_autograd.backward(cid, [a.sum() + remote(b).sum()])
        grads = dist_autograd.get_gradients(cid)
        got = [grads[x1], grads[x2]]
    want = clean_ref.unpack(want)
    return seen, all(torch.equal(g, w) for g, w in zip(got, want))


def test_backward_hooks_run_outside_any_context():
    """torch's engine threads run a pass's hooks with no current distributed autograd
    context: _current_context() raises, and a hook may open a context of its own."""
    import clean_ref
    import context_ref
    want = clean_ref.pack(clean_ref.reference(context_ref.local_grads))
    seen, exact = run_workers(_hooks_see_no_context, world_size=2, args=(want,))[0]
    assert exact
    for where in ("local", "returned"):
        assert "doesn't have a valid autograd context" in seen[f"{where}_current"], seen
        assert seen[f"{where}_own"] is True, seen


def _slow_hook(rank, world, want):
    import clean_ref
    import context_ref
    if rank != 0:
        return None
    with dist_autograd.context() as cid:
        leaves, loss = context_ref.slow_hook_program(
            lambda to, fn, args: rpc.rpc_sync(to, fn, args=args), lambda: time.sleep(3.0))
        t0 = time.monotonic()
        dist_autograd.backward(cid, [loss])
        took = time.monotonic() - t0
        grads = dist_autograd.get_gradients(cid)
        got = [grads[t] for t in leaves]
    return took, all(torch.equal(g, w) for g, w in zip(got, clean_ref.unpack(want)))


def test_a_slow_hook_in_a_shared_pass_does_not_stop_reading():
    """A 3 s hook on the initiator while its shared region runs (heartbeat deadline
    1 s): reports and heartbeats are read meanwhile, so the peer never declares it
    lost; the pass just takes longer, as on torch."""
    import clean_ref
    import context_ref
    want = clean_ref.pack(clean_ref.reference(context_ref.slow_hook_grads))
    took, exact = run_workers(_slow_hook, world_size=2, args=(want,), timeout=90,
                              options={"heartbeat_interval": 0.2, "heartbeat_deadline": 1.0})[0]
    assert exact and took >= 3.0


def _mode_sees_resumed_ops(rank, world, want):
    import clean_ref
    import context_ref
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    if rank != 0:
        return None
    with dist_autograd.context() as cid:
        x, loss = context_ref.sin_program(lambda to, fn, args: rpc.rpc_sync(to, fn, args=args))
        with torch.no_grad(), Recorder() as mode:   # thread-local state the pass must carry
            dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)[x]
    return mode.ops, torch.equal(got, clean_ref.unpack(want)[0])


def test_a_dispatch_mode_around_backward_sees_the_ops_run_after_a_gradient_returns():
    """torch's GraphTask carries the caller's thread-local state (a TorchDispatchMode,
    grad mode...) to every run of the pass on this worker, also one that a gradient
    arriving over RPC starts: the mode sees SinBackward0's cos."""
    import clean_ref
    import context_ref
    want = clean_ref.pack(clean_ref.reference(context_ref.sin_grads))
    ops, exact = run_workers(_mode_sees_resumed_ops, world_size=2, args=(want,))[0]
    assert exact
    assert "aten.cos.default" in ops, ops


def _contexts_here() -> int:
    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _contexts_of_worker1() -> int:
    return rpc.rpc_sync("worker1", _contexts_here)


def _release_rides_or_goes_at_the_tick(rank, world):
    """worker0 leaves contexts that reached worker1: (a) then calls worker1 at once:
    the release goes in the same sendmsg as the call and is handled before it runs;
    (b) then sends worker1 nothing: the transport's tick sends it; worker2 asks."""
    if rank != 0:
        return None
    from distgrad.rpc.pending import agent_or_none
    t = agent_or_none().transport
    x = torch.ones(3, requires_grad=True)
    rides = []
    for _ in range(3):   # (the tick may run between the exit and the call: rarely)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            dist_autograd.backward(cid, [y.sum()])
        before = list(t.batches)
        held = rpc.rpc_sync("worker1", _contexts_here)
        rides.append((held, t.batches[0] - before[0], t.batches[1] - before[1]))
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        dist_autograd.backward(cid, [y.sum()])
    time.sleep(1.0)   # a few ticks (every heartbeat_interval / 2)
    return rides, rpc.rpc_sync("worker2", _contexts_of_worker1)


def test_a_context_release_goes_with_the_next_message_or_at_the_tick():
    """A context's exit sends its releases with the next message to each worker (as
    torch's, nobody waits for them), at the latest at the transport's next tick. Sent
    at once, the release and the next call would be two batches; never sent without
    other traffic, worker1 would still hold the context a second later."""
    rides, later = run_workers(_release_rides_or_goes_at_the_tick, world_size=3)[0]
    assert all(held == 0 for held, _, _ in rides), rides
    assert (0, 1, 2) in rides, rides   # one sendmsg: the release, then the call
    assert later == 0, later
