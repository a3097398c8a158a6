"""TorchScript functions as RPC targets: rpc_sync, rpc_async and remote send the
function's qualified name; the callee runs the function it compiled under it."""
import pytest
import torch
from mp_utils import run_workers

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.rpc import RRef

pytestmark = pytest.mark.timeout(180)


@torch.jit.script
def script_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


@torch.jit.script
def script_fail(msg: str) -> torch.Tensor:
    raise ValueError(msg)


@torch.jit.script
def script_ref_add(ref: RRef[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    # TorchScript's RRef is torch's C++ type: with a distgrad RRef this runs eagerly
    return torch.add(ref.to_here(), t)


def make_ones():
    return torch.ones(2)


def _scenario(rank, world_size):
    if rank != 0:
        return None
    ones = torch.ones(2)
    assert isinstance(script_add, torch.jit.ScriptFunction)
    assert torch.equal(rpc.rpc_sync(1, script_add, args=(ones, ones)), ones * 2)
    assert torch.equal(rpc.rpc_async("worker1", script_add, args=(ones, 3 * ones)).wait(), ones * 4)
    assert torch.equal(rpc.rpc_sync(1, script_add, kwargs={"a": ones, "b": ones}), ones * 2)
    rref = rpc.remote(1, script_add, args=(ones, ones))
    assert torch.equal(rref.to_here(), ones * 2)
    assert torch.equal(rpc.remote(0, script_add, args=(ones, ones)).local_value(), ones * 2)
    with pytest.raises(Exception, match="script-error"):
        rpc.rpc_sync(1, script_fail, args=("script-error",))

    # an RRef argument: on the owner and on another worker
    held = rpc.remote(1, make_ones)
    assert torch.equal(rpc.rpc_sync(1, script_ref_add, args=(held, ones)), ones * 2)
    assert torch.equal(rpc.rpc_sync(0, script_ref_add, args=(held, ones)), ones * 2)

    # gradients flow through a script function called over RPC
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync(1, script_add, args=(x, 2 * ones))
        dist_autograd.backward(cid, [out.sum()])
        assert torch.equal(dist_autograd.get_gradients(cid)[x], ones)
    return True


def test_script_functions_over_rpc():
    assert run_workers(_scenario, world_size=2, timeout=150) == [True, None]


def test_unknown_script_function_name_is_an_error():
    from distgrad.rpc.script import ScriptFunctionRef
    with pytest.raises(RuntimeError, match="Unknown TorchScript function"):
        ScriptFunctionRef("__torch__.no_such_module.no_such_fn")(1)
    ref = ScriptFunctionRef(torch._jit_internal._qualified_name(script_add))
    assert torch.equal(ref(torch.ones(1), torch.ones(1)), torch.full((1,), 2.0))
