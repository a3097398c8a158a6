"""distgrad.nn: torch.distributed.nn's RemoteModule on distgrad's RPC.

Example::

    >>> from distgrad.nn import RemoteModule
    >>> lin = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
    >>> lin.forward(torch.ones(3, 4)).shape
    torch.Size([3, 2])
"""
from .remote_module import RemoteModule

__all__ = ["RemoteModule"]
