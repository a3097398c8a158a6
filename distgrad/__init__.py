"""distgrad: distributed autograd for PyTorch and the RPC framework under it.

Code written for torch.distributed.rpc / torch.distributed.autograd /
torch.distributed.optim.DistributedOptimizer runs after swapping the imports::

    import distgrad.rpc as rpc
    import distgrad.autograd as dist_autograd
    from distgrad.optim import DistributedOptimizer
"""
from . import _build

_build.install()   # before any module of the message path is imported: compiled or not

from . import (  # noqa: F401,E402
    autograd,  # noqa: F401,E402  (registers its agent extension)
    errors,
    rpc,
    trace,  # distgrad.trace(path): one timeline of a distributed step (callable module)
)
from ._build import info  # noqa: E402,F401  (distgrad.info())

__version__ = "0.1.0"
