"""torch.distributed.rpc.constants' names (defaults of distgrad's backend).

Example::

    >>> from distgrad.rpc.constants import DEFAULT_RPC_TIMEOUT_SEC
    >>> DEFAULT_RPC_TIMEOUT_SEC
    60.0
"""
from datetime import timedelta

from .options import (  # noqa: F401 - torch's names
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
)

DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(milliseconds=2**31 - 1)

__all__: list[str] = []
