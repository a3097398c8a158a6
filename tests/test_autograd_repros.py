"""The programs of ../shared/repros as tests: each runs once with plain local autograd
(the oracle) and once across two real workers, and every gradient must agree in
value, shape and presence.

- broadcast unreduced: a broadcast result both sent by RPC and used locally; the
  leaf of shape (1,) must get a gradient of shape (1,), not (2,).
- zero-stride grad: the receiver's ``sum`` of a one-element tensor hands back an
  expanded (stride-0) gradient, which has to travel back intact.
- None grad not zero-filled: a custom Function returns None for one input; the leaf
  that only feeds that input must have no gradient at all (not zeros).
- unused argument not zero-filled (found by tests/random_programs.py, seed 20082 on
  3 workers, shrunk): two tensors go in one call and the callee returns only one of
  them; the other one comes out of a custom Function, which must not run (it gets no
  gradient), and its leaf must have no gradient (not zeros).
"""
import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)

F64 = torch.float64


# -- functions worker1 runs (module level: they pickle by reference) -------------------
def double(y):
    return y * 2


def total(y):
    return y.sum()


class FirstOnly(torch.autograd.Function):
    """x + y with no gradient for y."""

    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, g):
        return g, None


# -- the programs: ``call(to, fn, args)`` is a plain call locally, rpc_sync distributed --
def broadcast_unreduced(call):
    w = torch.tensor([0.5], dtype=F64, requires_grad=True)
    c = torch.tensor([1.0, -2.0], dtype=F64)
    y = w + c                                   # (1,) + (2,) -> (2,)
    z = call("worker1", double, (y,))
    return [w], z.sum() + y.sum()


def zero_stride_grad(call):
    w = torch.tensor([0.5], dtype=F64, requires_grad=True)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=F64, requires_grad=True)
    z = call("worker1", total, (w,))            # backward of sum: an expanded gradient
    s = call("worker1", total, (v,))            # the same with three elements on one
    return [w, v], z * 3 + s * 5


def none_grad_not_zero_filled(call):
    p = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    q = torch.tensor([2.0, 3.0], dtype=F64, requires_grad=True)
    a, c = p * 2, q * 3
    r = call("worker1", torch.sin, (a,))
    return [p, q], r.sum() + FirstOnly.apply(a, c).sum()


def first(a, b):
    return a


class Twice(torch.autograd.Function):
    """2 * x; counts its backward runs in ``runs``."""
    runs = 0

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        Twice.runs += 1
        return g * 2


def unused_argument_not_zero_filled(call):
    p = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    q = torch.tensor([[2.0], [3.0]], dtype=F64, requires_grad=True)
    r = call("worker1", first, (p * 2, Twice.apply(q)))    # the second travels, unused
    return [p, q], r.sum()


def first_only(a, b):
    return FirstOnly.apply(a, b)


def absent_but_reached(call):
    """Both arguments reach the loss on worker1, but FirstOnly gives the second no
    gradient: locally Twice's backward then runs with zeros (a Function materializes
    absent gradients) and q gets a zero gradient. Reached-but-absent is not unreached."""
    p = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    q = torch.tensor([2.0, 3.0], dtype=F64, requires_grad=True)
    r = call("worker1", first_only, (p * 2, Twice.apply(q)))
    return [p, q], r.sum()


def absent_unreached_and_present(call):
    """One call, three arguments: one used, one reached without a gradient, one the
    callee never uses. Only the second's Function may run (with zeros)."""
    p = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    q = torch.tensor([2.0, 3.0], dtype=F64, requires_grad=True)
    u = torch.tensor([1.0, 4.0], dtype=F64, requires_grad=True)
    r = call("worker1", first_of_three, (p * 2, Twice.apply(q), u.exp()))
    return [p, q, u], r.sum()


def first_of_three(a, b, c):
    return FirstOnly.apply(a, b)


PROGRAMS = {f.__name__: f for f in (broadcast_unreduced, zero_stride_grad, none_grad_not_zero_filled,
                                    absent_but_reached, absent_unreached_and_present,
                                    unused_argument_not_zero_filled)}


def _compare(rank, world_size, name):
    """Worker0: run ``name`` locally and distributed, with one backward and with two
    (retain_graph=True: gradients accumulate, also into a stride-0 one); returns
    ({passes: (oracle, distributed)}, runs of Twice.backward) with each leaf's
    gradient as (shape, values), or None when absent."""
    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    if rank != 0:
        return None
    program = PROGRAMS[name]
    out = {}
    for passes in (1, 2):
        leaves, loss = program(lambda to, fn, args: fn(*args))
        for i in range(passes):
            loss.backward(retain_graph=i + 1 < passes)
        want = [None if t.grad is None else (tuple(t.grad.shape), t.grad.tolist()) for t in leaves]
        with dist_autograd.context() as cid:
            leaves, loss = program(lambda to, fn, args: rpc.rpc_sync(to, fn, args=args))
            for i in range(passes):
                dist_autograd.backward(cid, [loss], retain_graph=i + 1 < passes)
            grads = dist_autograd.get_gradients(cid)
            got = [None if t not in grads else (tuple(grads[t].shape), grads[t].tolist()) for t in leaves]
        out[passes] = (want, got)
    return out, Twice.runs


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_repro_matches_local_autograd(name):
    results, twice_runs = run_workers(_compare, world_size=2, timeout=90, args=(name,))[0]
    for passes, (want, got) in results.items():
        where = f"{name}, {passes} backward pass(es)"
        for i, (w, g) in enumerate(zip(want, got)):
            if w is None:
                assert g is None, f"{where}: leaf {i} must have no gradient (as locally), got {g}"
            else:
                assert g is not None, f"{where}: leaf {i} has no gradient, expected {w}"
                assert g[0] == w[0], f"{where}: leaf {i} gradient shape {g[0]} != {w[0]}"
                assert torch.allclose(torch.tensor(g[1], dtype=F64), torch.tensor(w[1], dtype=F64),
                                      rtol=1e-12, atol=1e-12), f"{where}: leaf {i} gradient {g[1]} != {w[1]}"
    if name.startswith("absent_"):  # reached (with zeros) once per backward pass, as locally
        assert twice_runs == 2 * 3, f"{name}: Twice.backward ran {twice_runs} time(s), locally 6"
    else:
        assert twice_runs == 0, f"{name}: Twice.backward ran {twice_runs} time(s); no gradient reaches it"
