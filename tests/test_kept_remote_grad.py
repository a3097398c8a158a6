"""A gradient that arrived over the network and that a hook on the leaf kept is
copied when the context takes it, as torch's AccumulateGrad copies a gradient
someone else holds: changing the kept tensor afterwards leaves the context alone
(found by the random programs with threads, seed 519026/2). One nobody kept is
kept as it arrived, without a copy, as torch keeps it."""
import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(120)


def _kept(rank, world):
    import sys

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    context = sys.modules["distgrad.autograd.context"]   # (the package's context() hides it)
    if rank != 0:
        return None
    copies = []
    real_copy = context._copy

    def counting_copy(g, leaf, *a, **k):
        copies.append(tuple(g.shape))
        return real_copy(g, leaf, *a, **k)
    context._copy = counting_copy   # this worker's module only: counts the context's copies
    out = []
    for keep in (False, True):
        w = torch.ones(4, requires_grad=True)
        stash = []
        h = w.register_hook(lambda g, stash=stash: stash.append(g)) if keep else None
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", torch.mul, args=(w, 3.0))
            dist_autograd.backward(cid, [y.sum()])
            if keep:
                stash[0].zero_()  # the user changes the gradient the hook kept
            out.append((dist_autograd.get_gradients(cid)[w].tolist(), len(copies)))
        copies.clear()
        if h is not None:
            h.remove()
    context._copy = real_copy
    # the native engine copies by torch's own AccumulateGrad rules, not context._copy
    native = sys.modules["distgrad.autograd.native_pass"].M is not None
    return out, native


def test_a_kept_received_gradient_is_copied_and_only_that_one():
    out, native = run_workers(_kept, world_size=2, timeout=90)[0]
    assert [v for v, _ in out] == [[3.0] * 4, [3.0] * 4]
    if not native:
        assert [n for _, n in out] == [0, 1]
