"""torch.distributed.rpc.internal's names, on distgrad's wire pickler.

``_internal_rpc_pickler.serialize(obj)`` gives ``(bytes, tensors)``: the
pickle with every dense tensor lifted out into the tensor list (the format of
:func:`distgrad.wire.pickler.dumps`), and ``deserialize(bytes, tensors)``
rebuilds the object. ``PythonUDF`` is the ``(func, args, kwargs)`` triple a
call carries; ``RPCExecMode`` and :func:`_build_rpc_profiling_key` name RPCs
the way torch's profiler keys do.

Example::

    >>> from distgrad.rpc.internal import _internal_rpc_pickler, PythonUDF
    >>> data, tensors = _internal_rpc_pickler.serialize(PythonUDF(torch.add, (torch.ones(2), 1), None))
    >>> _internal_rpc_pickler.deserialize(data, tensors).args[0]
    tensor([1., 1.])
"""
from __future__ import annotations

import collections
import copyreg
import enum
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ..errors import SerializationError, serialization_error
from ..wire import pickler as wire

__all__ = ["RPCExecMode", "serialize", "deserialize", "PythonUDF", "RemoteException"]


class RPCExecMode(enum.Enum):
    """How an RPC was made (torch's values: they appear in profiling keys)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])


class _InternalRPCPickler:
    """Pickles to ``(bytes, tensor list)`` and back, as torch's RPC pickler does.

    ``_register_reducer(cls, reducer)`` adds a ``copyreg``-style reducer for
    ``cls`` (torch's hook for classes such as RemoteModule); the first
    registration for a class wins.

    Example::

        >>> p = _InternalRPCPickler()
        >>> data, tensors = p.serialize([torch.zeros(3), "x"])
        >>> len(tensors), p.deserialize(data, tensors)[1]
        (1, 'x')
    """

    def __init__(self) -> None:
        self._class_reducer_dict: dict[type, Callable] = {}

    def _register_reducer(self, obj_class: type, reducer: Callable) -> None:
        self._class_reducer_dict.setdefault(obj_class, reducer)

    def serialize(self, obj: Any) -> tuple[bytes, list[torch.Tensor]]:
        """``obj`` as pickle bytes plus the list of tensors lifted out of it."""
        if not self._class_reducer_dict:
            # Inside a call (e.g. a __getstate__ run while a payload is pickled) RRefs
            # fork for the same destination as the enclosing message.
            # (a plain list: a DeviceTable's moves belong to the enclosing message)
            data, tensors = wire.dumps(obj, dest=wire.current_destination())
            return data, list(tensors)
        buf = io.BytesIO()
        tensors: list[torch.Tensor] = []
        p = _ReducingPickler(buf, tensors, self._class_reducer_dict)
        try:
            p.dump(obj)
        except SerializationError:
            raise
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise serialization_error(f"cannot pickle {type(obj).__name__}: {type(e).__name__}: {e}",
                                      e) from e
        return buf.getvalue(), tensors

    def deserialize(self, binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
        """Rebuild what :meth:`serialize` produced. A function or class missing
        here comes back as an AttributeError object (as in torch), which the
        call then raises."""
        try:
            return wire.loads(binary_data, tensors=list(tensor_table))
        except AttributeError as e:
            err = AttributeError(f"{e} Default RPC pickler does not serialize function code. Ensure "
                                 "that UDFs are defined on both caller and callee modules.")
            err.__cause__ = e
            return err


class _ReducingPickler(pickle.Pickler):
    """Tensors out of band (as the wire pickler does) plus registered reducers."""

    def __init__(self, file, tensors: list, reducers: dict) -> None:
        super().__init__(file, protocol=5)
        self.tensors = tensors
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(reducers)

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided \
                and type(obj) in (torch.Tensor, torch.nn.Parameter):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


_internal_rpc_pickler = _InternalRPCPickler()


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``_internal_rpc_pickler.serialize(obj)``.

    Example::

        >>> data, tensors = serialize({"w": torch.ones(2)})
    """
    return _internal_rpc_pickler.serialize(obj)


def deserialize(binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
    """``_internal_rpc_pickler.deserialize(binary_data, tensor_table)``.

    Example::

        >>> deserialize(*serialize({"w": torch.ones(2)}))["w"]
        tensor([1., 1.])
    """
    return _internal_rpc_pickler.deserialize(binary_data, tensor_table)


def _run_serialized(binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
    """Runs on the callee: the PythonUDF a custom ``_default_pickler`` produced."""
    udf = _internal_rpc_pickler.deserialize(binary_data, tensor_table)
    if isinstance(udf, AttributeError):
        raise udf
    return udf.func(*udf.args, **(udf.kwargs or {}))


def _build_rpc_profiling_key(exec_type: RPCExecMode, func_name: str, current_worker_name: str,
                             dst_worker_name: str) -> str:
    """The name an RPC is profiled under: ``rpc_<mode>#<func>(<from> -> <to>)``.

    Example::

        >>> _build_rpc_profiling_key(RPCExecMode.SYNC, "foo", "worker0", "worker1")
        'rpc_sync#foo(worker0 -> worker1)'
    """
    return f"rpc_{exec_type.value}#{func_name}({current_worker_name} -> {dst_worker_name})"
