"""Builtin torch operators over RPC: bad arguments raise torch's RPC error
(TensorPipeAgentRpcTest.test_op_with_invalid_args), everything else unchanged."""
import math
import pickle

import pytest
import torch
from mp_utils import run_workers

import distgrad.rpc as rpc
from distgrad.rpc.script import BuiltinOp, builtin_name

pytestmark = pytest.mark.timeout(120)

NO_SCHEMA = "Overloaded torch operator invoked from Python failed to match any schema"


def test_builtin_op_unit():
    assert builtin_name(torch.add) == "aten::add" and builtin_name(math.sqrt) == "aten::sqrt"
    assert builtin_name(lambda x: x) is None and builtin_name(len) is None
    op = pickle.loads(pickle.dumps(BuiltinOp("aten::add", torch.add)))
    assert torch.equal(op(torch.ones(2), 1, alpha=2), torch.full((2,), 3.))
    with pytest.raises(RuntimeError, match=NO_SCHEMA) as ei:
        op()
    assert isinstance(ei.value.__cause__, TypeError)  # the parser's own error is kept
    with pytest.raises(RuntimeError, match=NO_SCHEMA):
        op(torch.ones(2), "x")
    # errors that are not a schema mismatch stay what they are
    with pytest.raises(RuntimeError, match="size of tensor"):
        op(torch.ones(2), torch.ones(3))
    # an operator torch.ops does not know: the parser's TypeError stands
    with pytest.raises(TypeError):
        BuiltinOp("aten::no_such_op_here", torch.add)()


class Logged(torch.Tensor):
    """A tensor subclass whose __torch_function__ runs code: never retried."""
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Logged.calls += 1
        raise TypeError("refused by the subclass")


def test_builtin_op_does_not_retry_tensor_subclasses():
    t = torch.ones(2).as_subclass(Logged)
    with pytest.raises(TypeError, match="refused by the subclass"):
        BuiltinOp("aten::add", torch.add)(t, 1)
    assert Logged.calls == 1


def raises_type_error(x):
    return torch.add(x)  # a user function: its TypeError is not rewritten


def _invalid_args(rank, world_size):
    if rank != 0:
        return None
    with pytest.raises(RuntimeError, match=NO_SCHEMA):
        rpc.rpc_sync("worker1", torch.add, args=())
    with pytest.raises(RuntimeError, match=NO_SCHEMA):
        rpc.rpc_async("worker1", torch.mul, args=(torch.ones(2), "x")).wait()
    with pytest.raises(RuntimeError, match=NO_SCHEMA):
        rpc.remote("worker1", torch.add, args=()).to_here()
    with pytest.raises(TypeError, match="invalid combination"):
        rpc.rpc_sync("worker1", raises_type_error, args=(torch.ones(1),))
    out = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1), kwargs={"alpha": 3})
    assert torch.equal(out, torch.full((2,), 4.))
    assert rpc.rpc_sync("worker1", math.sqrt, args=(16.0,)) == 4.0
    assert torch.equal(rpc.remote("worker1", torch.nn.functional.relu, args=(-torch.ones(2),)).to_here(),
                       torch.zeros(2))
    return True


def test_builtin_op_invalid_args_over_rpc():
    assert run_workers(_invalid_args, world_size=2, timeout=90) == [True, None]
