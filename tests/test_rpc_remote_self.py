"""rpc.remote to one's own worker returns the owner RRef, as torch does (the
trainer / parameter-server pattern: the server creates its parameters with a
remote() to itself and hands the RRef to trainers)."""
import gc
import time

import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc

pytestmark = pytest.mark.timeout(180)

_made = []


def make_param():
    t = torch.ones(3, 3, requires_grad=True)
    _made.append(t)  # to check that to_here() on the owner is this very object
    return t


def boom():
    raise KeyError("remote-self-error")


def trainer_step(param_rref, ps_name):
    # the trainer: forward on the server through the RRef, backward here
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync(ps_name, add_local, args=(param_rref, torch.full((3, 3), 2.0)))
        dist_autograd.backward(cid, [out.sum()])
        return out, cid


def add_local(param_rref, t):
    return param_rref.local_value() + t


def _scenario(rank, world_size):
    if rank != 0:
        return None
    me = rpc.get_worker_info()
    rref = rpc.remote(me, make_param)
    assert rref.is_owner() and rref.owner() == me and rref.confirmed_by_owner()
    value = rref.to_here()
    assert value is _made[-1], "to_here() on the owner returns the value itself"
    assert rref.local_value() is value
    assert rpc.remote("worker0", make_param).local_value() is _made[-1]  # by name too
    assert rref._get_type() is torch.Tensor

    # an error in the function is the RRef's error
    bad = rpc.remote(0, boom)
    with pytest.raises(KeyError, match="remote-self-error"):
        bad.to_here()

    # shared with a trainer: the trainer's forward runs on the value itself,
    # and its gradient comes back here
    out, cid = rpc.rpc_sync(1, trainer_step, args=(rref, "worker0"))
    assert torch.equal(out, torch.full((3, 3), 3.0))

    # the proxies work on it too
    assert rref.rpc_sync().sum().item() == 9.0
    assert rref.remote().sum().to_here().item() == 9.0

    # once every reference is gone, nothing stays owned
    del rref, bad, value
    _made.clear()
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if rpc._rref_context_get_debug_info()["num_owner_rrefs"] == "0":
            break
        time.sleep(0.05)
    assert rpc._rref_context_get_debug_info()["num_owner_rrefs"] == "0"
    return True


def test_remote_to_self_returns_the_owner_rref():
    assert run_workers(_scenario, world_size=2, timeout=150) == [True, None]
