"""RPC backends by name, as torch.distributed.rpc.backend_registry keeps them.

distgrad has one backend of its own, reachable as ``BackendType.TENSORPIPE``
(what code written for torch passes) or ``BackendType.DISTGRAD``.
:func:`register_backend` adds another: ``init_rpc(backend=...)`` then builds
its agent with the registered ``init_backend_handler(store, name, rank,
world_size, rpc_backend_options)``.

Example::

    >>> from distgrad.rpc import backend_registry
    >>> backend_registry.backend_registered("TENSORPIPE")
    True
"""
from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import Any

from .options import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC, TensorPipeRpcBackendOptions

__all__ = ["init_backend", "backend_registered", "construct_rpc_backend_options", "register_backend",
           "BackendType", "BackendValue"]

BackendValue = collections.namedtuple(
    "BackendValue", ["construct_rpc_backend_options_handler", "init_backend_handler"])


def _construct_options(rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                       init_method: str = DEFAULT_INIT_METHOD, **kwargs: Any) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _init_distgrad(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("distgrad's own backend is started by init_rpc")  # never called: see api


_BUILTIN = BackendValue(_construct_options, _init_distgrad)


def _repr(self) -> str:
    return "BackendType." + self.name


def _make(members: dict) -> type:
    cls = enum.Enum("BackendType", members)
    cls.__repr__ = _repr
    cls.__module__ = __name__
    return cls


# DISTGRAD is an alias of TENSORPIPE (same value): one backend, either name.
BackendType = _make({"TENSORPIPE": _BUILTIN, "DISTGRAD": _BUILTIN})


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` names a backend.

    Example::

        >>> backend_registered("TENSORPIPE")
        True
    """
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Callable,
                     init_backend_handler: Callable):
    """Add a backend and return its new ``BackendType`` member (the enum is
    rebuilt, as torch does); RuntimeError when the name is taken.

    Example::

        >>> stub = register_backend("stub", make_options, make_agent)
        >>> rpc.init_rpc("worker0", backend=stub, rank=0, world_size=1)
    """
    global BackendType
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    members = {backend_name: BackendValue(construct_rpc_backend_options_handler, init_backend_handler)}
    members.update({name: m.value for name, m in BackendType.__members__.items()})
    BackendType = _make(members)
    return BackendType[backend_name]


def is_builtin(backend: Any) -> bool:
    """Whether ``backend`` is distgrad's own (None, TENSORPIPE, DISTGRAD)."""
    return backend is None or getattr(backend, "value", None) is _BUILTIN


def is_backend(backend: Any) -> bool:
    """Whether ``backend`` is a member of BackendType (of any of its versions)."""
    return isinstance(backend, enum.Enum) and type(backend).__name__ == "BackendType" \
        and backend_registered(backend.name)


def construct_rpc_backend_options(backend: Any, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = DEFAULT_INIT_METHOD, **kwargs: Any) -> Any:
    """Options for ``backend`` built by its registered handler.

    Example::

        >>> construct_rpc_backend_options(BackendType.TENSORPIPE, init_method="tcp://127.0.0.1:29500")
    """
    return backend.value.construct_rpc_backend_options_handler(
        rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def init_backend(backend: Any, *args: Any, **kwargs: Any) -> Any:
    """The agent of a registered (non-distgrad) backend."""
    return backend.value.init_backend_handler(*args, **kwargs)
