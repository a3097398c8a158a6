"""One pass, two engines: a worker whose share runs on the Python engine (a DDP model
in its process, create_graph, anomaly mode...) and one on the native engine speak one
protocol (gradients with weight, reports, discovery, resume). A nested call back to
the Python worker and an RPC result that is never used (discovery, then the send
functions nobody reached retire on both sides) give local autograd's gradients."""
import pytest
import torch
from mp_utils import run_workers

pytestmark = pytest.mark.timeout(180)


def _inner(t):
    return t * 3


def _outer(t):
    import distgrad.rpc as rpc
    return rpc.rpc_sync("worker1", _inner, args=(t * 2,)) + 1


def _call(rpc):
    fns = {"outer": _outer, "unused": torch.sin}
    return lambda to, name, t: rpc.rpc_sync(to, fns[name], args=(t,))


def _mixed(rank, world, want, python_rank):
    import clean_ref
    import context_ref

    import distgrad.autograd as dist_autograd
    import distgrad.rpc as rpc
    from distgrad.autograd import share
    if rank == python_rank:
        share.native_ok = lambda flags: False   # this worker's shares run on the Python engine
    if rank != 1:
        return None
    out = []
    for _ in range(2):
        with dist_autograd.context() as cid:
            w, loss = context_ref.mixed_program(_call(rpc))
            dist_autograd.backward(cid, [loss])
            got = dist_autograd.get_gradients(cid)[w]
        out.append(torch.equal(got, clean_ref.unpack(want)[0]))
    return out


@pytest.mark.parametrize("python_rank", [0, 1])
def test_python_and_native_shares_in_one_pass(python_rank):
    import clean_ref
    import context_ref
    want = clean_ref.pack(clean_ref.reference(context_ref.mixed_grads))
    res = run_workers(_mixed, world_size=2, args=(want, python_rank))
    assert res[1] == [True, True]
