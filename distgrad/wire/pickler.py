"""Pickling with tensors lifted out of the pickle stream.

Every dense CPU tensor met while pickling becomes a persistent id (its index
in a *tensor table*); its bytes travel as a separate out-of-band buffer and are
never copied into the pickle stream. Only the bytes a tensor covers are sent:
a contiguous view of a large tensor sends its own slice, a non-contiguous one
is compacted first. The receiver rebuilds each tensor on the received buffer
without another copy.

The tensor table is exposed so that distributed autograd can see which sent
tensors require grad and can replace the received ones (attach a recv
function) before the object graph is rebuilt.
"""
from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..errors import ProtocolError, SerializationError

_DENSE, _PARAMETER = 0, 1
# Names of dtypes that may travel; the receiver accepts nothing else.
_DTYPES = {str(d): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2,
)}

_local = threading.local()


class TensorSpec(NamedTuple):
    """What the receiver needs to rebuild one tensor from its buffer."""

    dtype: str
    shape: tuple
    requires_grad: bool
    kind: int = _DENSE

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


def current_destination() -> Any:
    """The worker the object being pickled is addressed to (None outside ``dumps``).

    RRef pickling uses it to register the new fork with the owner.
    """
    return getattr(_local, "dest", None)


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view over exactly the bytes of ``t`` (compacting if needed)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8)


def _rebuild_sparse(indices, values, size, coalesced):
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced)
    return t


class _Pickler(pickle.Pickler):
    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=5)
        self.tensors = tensors
        self._index: dict[int, int] = {}  # id(tensor) -> index: a tensor shared twice travels once

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            if obj.device.type != "cpu":
                raise SerializationError(
                    f"cannot send a tensor on device {obj.device}: distgrad moves CPU "
                    "tensors only (move it with .cpu() first)")
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                return None  # subclasses pickle themselves
            idx = self._index.get(id(obj))
            if idx is None:  # ``tensors`` keeps obj alive, so its id stays unique
                idx = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return idx
        return None

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
            if obj.requires_grad:
                raise SerializationError("sending sparse tensors that require grad is not supported")
            return _rebuild_sparse, (obj._indices().detach(), obj._values().detach(),
                                     tuple(obj.shape), obj.is_coalesced())
        return NotImplemented


def dumps(obj: Any, dest: Any = None) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj``; returns the pickle bytes and the tensor table.

    ``dest`` is the destination worker, visible to reducers through
    :func:`current_destination`. Raises :class:`SerializationError` (and sends
    nothing) when something in ``obj`` cannot be pickled.

    Example::

        >>> data, tensors = dumps({"x": torch.ones(2)})
        >>> specs, buffers = tensor_frames(tensors)
        >>> loads(data, specs, buffers)["x"]
        tensor([1., 1.])
    """
    buf = io.BytesIO()
    tensors: list[torch.Tensor] = []
    prev = getattr(_local, "dest", None)
    _local.dest = dest
    try:
        _Pickler(buf, tensors).dump(obj)
    except SerializationError:
        raise
    except Exception as e:  # pickle raises many types: normalise at this boundary
        raise SerializationError(f"cannot pickle {_describe(obj)}: {type(e).__name__}: {e}") from e
    finally:
        _local.dest = prev
    return buf.getvalue(), tensors


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 200 else text[:200] + "..."


def tensor_frames(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorSpec], list]:
    """Specs and zero-copy buffers (numpy uint8 arrays) for a tensor table."""
    specs, buffers = [], []
    for t in tensors:
        kind = _PARAMETER if isinstance(t, torch.nn.Parameter) else _DENSE
        specs.append(TensorSpec(str(t.dtype), tuple(t.shape), bool(t.requires_grad), kind))
        if t.numel():
            buffers.append(_tensor_bytes(t).numpy())
    return specs, buffers


def rebuild_tensors(specs: Sequence[TensorSpec], buffers: Sequence) -> list[torch.Tensor]:
    """Tensors on the received buffers (no copy); checks every size first."""
    out, i = [], 0
    for spec in specs:
        if not isinstance(spec, tuple) or len(spec) != 4 or spec[0] not in _DTYPES \
                or not isinstance(spec[1], tuple):
            raise ProtocolError(f"malformed tensor spec {spec!r}")
        spec = TensorSpec._make(spec)
        if any((not isinstance(s, int)) or s < 0 for s in spec.shape):
            raise ProtocolError(f"malformed tensor shape {spec.shape!r}")
        dtype = _DTYPES[spec.dtype]
        nbytes = spec.nbytes
        if nbytes == 0:
            t = torch.empty(spec.shape, dtype=dtype)
        else:
            if i >= len(buffers):
                raise ProtocolError("fewer tensor buffers than tensor specs")
            buf = buffers[i]
            i += 1
            if len(buf) != nbytes:
                raise ProtocolError(f"tensor buffer holds {len(buf)} bytes, spec needs {nbytes}")
            t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(spec.shape)
        if spec.kind == _PARAMETER:
            t = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
        elif spec.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    if i != len(buffers):
        raise ProtocolError(f"{len(buffers)} tensor buffers for {i} non-empty tensors")
    return out


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid):
        if not isinstance(pid, int) or not 0 <= pid < len(self.tensors):
            raise ProtocolError(f"bad tensor reference {pid!r}")
        return self.tensors[pid]


def loads(data: bytes, specs: Sequence[TensorSpec] = (), buffers: Sequence = (),
          tensor_hook: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
          tensors: list[torch.Tensor] | None = None) -> Any:
    """Rebuild an object pickled by :func:`dumps`.

    ``tensor_hook`` may replace the rebuilt tensors before the object graph is
    built (distributed autograd attaches its recv function there).
    """
    if tensors is None:
        tensors = rebuild_tensors(specs, buffers)
    if tensor_hook is not None:
        tensors = tensor_hook(tensors)
    return _Unpickler(io.BytesIO(data), tensors).load()
