"""distgrad.optim: torch.distributed.optim's DistributedOptimizer on distgrad.

Example::

    from distgrad.optim import DistributedOptimizer
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
"""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
