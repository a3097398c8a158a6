"""``distgrad demo``: a model-parallel digits classifier trained with distgrad's
RPC, distributed autograd and DistributedOptimizer on a local cluster.

Run it with ``distgrad demo`` (or ``python -m distgrad demo --help``).
"""
from .train import add_arguments, run

__all__ = ["add_arguments", "run"]
