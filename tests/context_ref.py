"""Local halves of tests/test_context_lifetime.py's programs (imports no distgrad:
tests/clean_ref.py runs them in a process that never imported it)."""
import torch


def hook_program(call):
    """x1 * 2 used here, x2 * 3 sent to worker1 and back (``call`` is a plain call
    locally, rpc_sync distributed); hooks on both halves. Returns the leaves and
    the loss."""
    x1 = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    x2 = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
    a = x1 * 2
    b = x2 * 3
    return (x1, x2), a, b, lambda b_: call("worker1", torch.mul, (b_, b_))


def local_grads():
    (x1, x2), a, b, remote = hook_program(lambda to, fn, args: fn(*args))
    (a.sum() + remote(b).sum()).backward()
    return [x1.grad, x2.grad]
