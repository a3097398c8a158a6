"""``async_execution``: the callee returns a Future and replies when it completes."""
from __future__ import annotations

import functools
from collections.abc import Callable


def async_execution(fn: Callable) -> Callable:
    """Mark ``fn`` as returning a ``torch.futures.Future``; the RPC reply is sent
    when that future completes, without holding a thread of the pool meanwhile.

    Example::

        >>> @rpc.functions.async_execution
        ... def add_chain(to, x):
        ...     return rpc.rpc_async(to, torch.add, args=(x, 1)).then(lambda f: f.wait() * 2)
        >>> rpc.rpc_sync("worker1", add_chain, args=("worker2", torch.ones(2)))
        tensor([4., 4.])
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn
    return wrapper
