"""Pickling with tensors lifted out of the pickle stream.

Every CPU tensor met while pickling (dense or sparse COO, an ``nn.Parameter``
too) becomes a reference to its index in a *tensor table* (a reducer in the
pickler's dispatch table, so other objects cost no Python call); its bytes travel
as separate out-of-band buffers (one for a dense tensor; indices and values
for a sparse one) and are never copied into the pickle stream. Only the bytes
a tensor covers are sent: a contiguous view of a large tensor sends its own
slice. A non-contiguous view keeps its strides, as in torch.distributed.rpc:
the span of storage from its first element to its last travels with the
view's strides and the receiver rebuilds it with ``as_strided`` (an expanded,
stride-0 tensor sends only the elements it repeats), unless that span is both
8 KiB or more and at least twice the view's own bytes (a column of a large
matrix): such a view is compacted and arrives contiguous, as torch clones it.
Conjugate and negative views are resolved first. The receiver rebuilds each
tensor on the received buffers without another copy. Sparse compressed layouts (CSR, CSC, BSR, BSC) are
refused at the sender, as torch.distributed.rpc refuses them.

A tensor on an accelerator joins the table too when :func:`dumps` is given a
:class:`~.devices.Route` that maps its device (else it is refused with torch's
TensorPipe message, before anything is sent): the table is then a
:class:`DeviceTable`, whose ``moves`` say where each such tensor goes, and
:func:`tensor_frames` sends it through host memory (see :mod:`.devices`).

The tensor table is exposed so that distributed autograd can see which sent
tensors require grad and can replace the received ones (attach a recv
function) before the object graph is rebuilt.
"""
from __future__ import annotations

import io
import pickle
import pickletools
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import DistgradError, ProtocolError, SerializationError, serialization_error
from .devices import Route, no_map_message, to_host
from .devices import span as _span

# A spec's kind: bit 0 says nn.Parameter, the rest the layout. Sparse tensors go
# through the table too (not reduced to their parts), so that autograd sees them.
_DENSE, _PARAMETER, _SPARSE_COO = 0, 1, 2
_KINDS = (_DENSE, _PARAMETER, _SPARSE_COO, _SPARSE_COO | _PARAMETER)
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
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
    """What the receiver needs to rebuild one tensor from its buffers.

    ``parts`` is empty for a dense tensor; for a sparse COO tensor it is
    ``(sparse_dim, nnz, coalesced)``, from which the shapes of its indices
    (int64, ``(sparse_dim, nnz)``) and values (``(nnz, *dense dims)``) follow.
    ``strides`` is empty for a contiguous tensor (and always for a sparse or an
    empty one); for a strided view it holds the view's strides, and its buffer
    is the span of storage from the view's first element to its last.
    ``devices`` is empty for a tensor that stays on the CPU; for one that moves
    between devices it is ``(source device, target device)``, as strings (the
    target: "cpu" or one of the receiver's devices).
    """

    dtype: str
    shape: tuple
    requires_grad: bool
    kind: int = _DENSE
    parts: tuple = ()
    strides: tuple = ()
    devices: tuple = ()

    def components(self) -> list[tuple[torch.dtype, tuple, tuple]]:
        """(dtype, shape, strides) of each piece that travels as a buffer, in
        order; strides ``()`` means contiguous."""
        if self.kind & ~_PARAMETER == _SPARSE_COO:
            sparse_dim, nnz, _ = self.parts
            return [(torch.int64, (sparse_dim, nnz), ()),
                    (_DTYPES[self.dtype], (nnz,) + tuple(self.shape[sparse_dim:]), ())]
        return [(_DTYPES[self.dtype], self.shape, self.strides)]

    @property
    def nbytes(self) -> int:
        """Bytes that travel (a strided view's span, not its logical size)."""
        return sum(_nbytes(*c) for c in self.components())


def _nbytes(dtype: torch.dtype, shape: tuple, strides: tuple = ()) -> int:
    """Bytes of the buffer a piece travels in: 0 when it has no element; the
    span from the first element to the last for a strided view (strides >= 0)."""
    n = 1
    for s in shape:
        n *= s
    if n and strides:
        n = _span(shape, strides)
    return n * dtype.itemsize


# A non-contiguous view travels as its span (with its strides) unless the span is
# at least this many bytes *and* at least _SPAN_FACTOR times the view's own bytes;
# then it is compacted (torch clones such views too: same two thresholds, on the
# whole storage where distgrad looks at the span only).
_SPAN_KEEP_BYTES = 8 * 1024
_SPAN_FACTOR = 2


def current_destination() -> Any:
    """The worker the object being pickled is addressed to (None outside ``dumps``).

    RRef pickling uses it to register the new fork with the owner.
    """
    return getattr(_local, "dest", None)


def current_pins() -> list | None:
    """While pickling a request's payload: the list where an RRef going to its own
    owner puts its id, so that the request itself keeps the value alive there
    (see :mod:`distgrad.rpc.rref`); None elsewhere (replies, control messages)."""
    return getattr(_local, "pins", None)


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view over exactly the bytes of dense ``t`` (compacting if needed)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.stride() != (1,):
        # torch calls a tensor whose only element sits at stride 0 (the gradient of
        # w.sum() for w of shape (1,)) contiguous, so nothing above restrides it; a
        # 1-D contiguous tensor's elements are adjacent, so stride 1 is the same memory
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _kept_span(t: torch.Tensor) -> int | None:
    """The span a non-contiguous view travels as, keeping its strides (None: it is
    compacted, or is contiguous, sparse or empty): the rule of :func:`_pieces`."""
    if t.layout is not torch.strided or not t.numel() or t.is_contiguous():
        return None
    span = _span(t.shape, t.stride())
    if span * t.element_size() < _SPAN_KEEP_BYTES or span < _SPAN_FACTOR * t.numel():
        return span
    return None


def _pieces(t: torch.Tensor) -> tuple[TensorSpec, list[torch.Tensor]]:
    """The spec of a table tensor and the dense pieces whose bytes travel."""
    # the exact type, as everywhere (autograd's recording included): a tensor that
    # only claims to be one (``_is_param``) is a plain tensor, as torch sends it
    kind = _PARAMETER if type(t) is torch.nn.Parameter else _DENSE
    if t.layout == torch.sparse_coo:
        d = t.detach()
        spec = TensorSpec(str(t.dtype), tuple(t.shape), bool(t.requires_grad), kind | _SPARSE_COO,
                          (d.sparse_dim(), d._nnz(), d.is_coalesced()))
        return spec, [d._indices(), d._values()]
    d = t.detach()
    if d.is_conj():
        d = d.resolve_conj()
    if d.is_neg():
        d = d.resolve_neg()
    strides: tuple = ()
    span = _kept_span(d)
    if span is not None:
        strides = tuple(d.stride())
        d = d.as_strided((span,), (1,), d.storage_offset())  # the span, 1-D contiguous
    return TensorSpec(str(t.dtype), tuple(t.shape), bool(t.requires_grad), kind, (), strides), [d]


def _reduce_tensor(obj: torch.Tensor):
    """Reducer of the exact types torch.Tensor and nn.Parameter (the pickler's
    dispatch table: no Python call for any other object): the tensor joins the
    table of the ``dumps`` running on this thread, and the stream keeps its index."""
    layout = obj.layout
    if layout is not torch.strided and layout is not torch.sparse_coo:
        if layout in _COMPRESSED:
            # torch.distributed.rpc cannot send these either (it fails reading their
            # storage); torch's own pickling would lose requires_grad, so refuse here
            raise SerializationError(
                f"cannot send a tensor with layout {layout}: torch.distributed.rpc does not "
                "support sparse compressed tensors (send .to_sparse() or .to_dense() instead)")
        return obj.__reduce_ex__(5)
    tensors, index, route, moves = _local.table
    idx = index.get(id(obj))
    if idx is None:  # ``tensors`` keeps obj alive, so its id stays unique
        if obj.device.type != "cpu":
            _device_move(obj, len(tensors), route, moves)
        idx = index[id(obj)] = len(tensors)
        tensors.append(obj)
    if obj.__dict__ and type(obj) is torch.nn.Parameter:
        # a Parameter's attributes travel with it, as torch's pickling keeps them
        return _table_parameter, (idx, torch._utils._get_obj_state(obj))
    return _table_tensor, (idx,)


def _device_move(obj: torch.Tensor, idx: int, route: Route | None, moves: dict) -> None:
    """Record where tensor ``idx`` (on an accelerator) goes; SerializationError with
    torch's text when the route has no map for its device (nothing is sent)."""
    device = obj.device
    if route is None:
        dest = getattr(_local, "dest", None)
        raise SerializationError(no_map_message("Request", getattr(dest, "name", dest), device))
    moves[idx] = (str(device), str(route.target(device)))


class DeviceTable(list):
    """A tensor table (see :func:`dumps`) with tensors that move between devices:
    ``moves`` maps a tensor's index to ``(source device, target device)`` (strings).

    Example::

        >>> _, table = dumps(torch.ones(2, device="cuda:0"), route=route)   # {cuda:0: cuda:1}
        >>> table.moves
        {0: ('cuda:0', 'cuda:1')}
    """

    __slots__ = ("moves",)


def _table_tensor(idx: int) -> torch.Tensor:
    """The rebuilt tensor ``idx`` of the ``loads`` running on this thread."""
    tensors = getattr(_local, "rebuilt", None)
    if tensors is None or type(idx) is not int or not 0 <= idx < len(tensors):
        raise ProtocolError(f"bad tensor reference {idx!r}")
    return tensors[idx]


def _table_parameter(idx: int, state: Any) -> torch.Tensor:
    """The rebuilt Parameter ``idx`` with the attributes it was sent with."""
    t = _table_tensor(idx)
    if type(t) is not torch.nn.Parameter:
        raise ProtocolError(f"tensor reference {idx!r} with attributes is not a Parameter")
    return torch._utils._set_obj_state(t, state)


_DISPATCH = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}


class _Pickler(pickle.Pickler):
    dispatch_table = _DISPATCH


_OWN_GLOBALS = {(_table_tensor.__module__, f.__name__): f for f in (_table_tensor, _table_parameter)}


class _Unpickler(pickle.Unpickler):
    """The payload's unpickler (its own class, so that a test can restrict what it loads)."""

    def find_class(self, module, name):
        # the tensor references of every message: what the import would find, without it
        # (the audit event is raised as pickle's own find_class raises it)
        own = _OWN_GLOBALS.get((module, name))
        if own is None:
            return pickle.Unpickler.find_class(self, module, name)
        sys.audit("pickle.find_class", module, name)
        return own

    def persistent_load(self, pid):
        # tensors travel as table references (_table_tensor), never as persistent ids
        raise ProtocolError(f"bad tensor reference {pid!r}")


def dumps(obj: Any, dest: Any = None, pins: list | None = None,
          route: Route | None = None) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj``; returns the pickle bytes and the tensor table.

    ``dest`` is the destination worker, visible to reducers through
    :func:`current_destination`, and ``pins`` through :func:`current_pins`.
    ``route`` (a :class:`~.devices.Route`; a nested ``dumps`` inherits the
    enclosing one) says where tensors on accelerators go: with one that maps them
    the table is a :class:`DeviceTable`; without, such a tensor is refused with
    torch's TensorPipe message. Raises :class:`SerializationError` (and sends
    nothing) when something in ``obj`` cannot be pickled.

    Example::

        >>> data, tensors = dumps({"x": torch.ones(2)})
        >>> specs, buffers = tensor_frames(tensors)
        >>> loads(data, specs, buffers)["x"]
        tensor([1., 1.])
    """
    buf = io.BytesIO()
    tensors: list[torch.Tensor] = []
    saved = (getattr(_local, "dest", None), getattr(_local, "pins", None),
             getattr(_local, "table", None))  # dumps nests when a reducer pickles
    if route is None and saved[2] is not None:
        route = saved[2][2]
    moves: dict = {}
    _local.dest, _local.pins, _local.table = dest, pins, (tensors, {}, route, moves)
    try:
        _Pickler(buf, protocol=5).dump(obj)
    except SerializationError:
        raise
    except Exception as e:  # pickle raises many types: one of ours that is also theirs
        to = f" for worker {dest.name}" if getattr(dest, "name", None) else ""
        raise serialization_error(f"cannot pickle {_describe(obj)}{to}: {type(e).__name__}: {e}", e,
                                  getattr(dest, "name", None)) from e
    finally:
        _local.dest, _local.pins, _local.table = saved
    if moves or (route is not None and route.cpu_target is not None):
        return buf.getvalue(), _device_table(tensors, moves, route)
    return buf.getvalue(), tensors


def _device_table(tensors: list, moves: dict, route: Route) -> DeviceTable:
    """The table as a :class:`DeviceTable`; a map that names "cpu" moves CPU tensors too."""
    if route.cpu_target is not None:
        target = str(route.cpu_target)
        for i, t in enumerate(tensors):
            if i not in moves and t.device.type == "cpu":
                moves[i] = ("cpu", target)
    table = DeviceTable(tensors)
    table.moves = moves
    return table


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 200 else text[:200] + "..."


# Tensors of at most this many bytes are copied when the message is built, on the
# calling thread: the message then holds their values at call time even if the
# caller (or an optimizer on another thread) changes them in place right after,
# and the transport's MAC covers exactly the bytes that leave (a write racing the
# copy itself can still tear it, as in torch). Larger tensors go zero-copy, as
# in torch: do not modify them until the call completes.
SNAPSHOT_BYTES = 64 * 1024


def tensor_frames(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorSpec], list]:
    """Specs and buffers for a tensor table: bytes copies of small tensors,
    zero-copy numpy uint8 views of large ones (a :class:`DeviceTable`'s tensors
    on accelerators: of their copies in host memory, see :mod:`.devices`)."""
    if type(tensors) is DeviceTable:
        return _device_frames(tensors)
    specs, buffers = [], []
    for t in tensors:
        name = _NUMPY_DTYPES.get(t.dtype)
        if name is not None and t.layout is torch.strided and t.is_contiguous() \
                and not t.is_neg():
            # the common case, without the general path's views: a dense, contiguous
            # tensor whose dtype numpy knows (its bytes are the array's)
            specs.append(TensorSpec(name, tuple(t.shape), t.requires_grad,
                                    _PARAMETER if type(t) is torch.nn.Parameter else _DENSE))
            if t.numel():
                arr = t.detach().numpy()
                buffers.append(arr.tobytes() if arr.nbytes <= SNAPSHOT_BYTES
                               else arr.reshape(-1).view("u1"))
            continue
        spec, pieces = _pieces(t)
        specs.append(spec)
        for piece in pieces:
            if piece.numel():
                view = _tensor_bytes(piece).numpy()
                buffers.append(view.tobytes() if view.nbytes <= SNAPSHOT_BYTES else view)
    return specs, buffers


def _device_frames(table: DeviceTable) -> tuple[list[TensorSpec], list]:
    """tensor_frames of a table with tensors that move: each on an accelerator goes
    through its host copy; its spec keeps the original's flags and records where it
    goes."""
    moves = table.moves
    host = to_host(table, moves, {i: sp for i in moves if (sp := _kept_span(table[i])) is not None})
    specs, buffers = tensor_frames(host)
    for i, (src, dst) in moves.items():
        t = table[i]
        kind = specs[i].kind | (_PARAMETER if type(t) is torch.nn.Parameter else 0)
        specs[i] = specs[i]._replace(requires_grad=bool(t.requires_grad), kind=kind, devices=(src, dst))
    return specs, buffers


# dtypes numpy shares (complex ones may carry a conjugate bit: the general path)
_NUMPY_DTYPES = {d: str(d) for d in (
    torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool)}
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
# Specs already checked (a training loop sends the same shapes again and again)
_CHECKED: dict = {}
_CHECKED_MAX = 4096


def check_specs(specs: Any, nbuffers: int | None = None) -> tuple[TensorSpec, ...]:
    """Validate received tensor specs (types, dtypes, shapes, flags, sparse parts)
    and, when ``nbuffers`` is given, that exactly that many buffers are needed;
    raises ProtocolError. Sizes are computed with Python integers (no overflow)
    and nothing is allocated here.
    """
    if not isinstance(specs, tuple):
        raise ProtocolError("malformed tensor specs")
    out, nonempty = [], 0
    cache = _CHECKED
    for spec in specs:
        # a spec seen before was checked then; repr tells 5 from 5.0 and True from 1
        # (and the checked spec is the one used: its values, not the new object)
        key = repr(spec)
        known = cache.get(key)
        if known is not None:
            out.append(known[0])
            nonempty += known[1]
            continue
        if not isinstance(spec, tuple) or len(spec) not in (4, 5, 6, 7) or not isinstance(spec[0], str) \
                or spec[0] not in _DTYPES or not isinstance(spec[1], tuple):
            raise ProtocolError(f"malformed tensor spec {_describe(spec)}")
        spec = TensorSpec(*spec)
        if len(spec.shape) > MAX_DIMS or any(type(s) is not int or s < 0 for s in spec.shape):
            raise ProtocolError(f"malformed tensor shape {_describe(spec.shape)}")
        if type(spec.requires_grad) is not bool or type(spec.kind) is not int \
                or spec.kind not in _KINDS or not _parts_ok(spec):
            raise ProtocolError(f"malformed tensor spec {_describe(tuple(spec))}")
        if spec.strides != () and not _strides_ok(spec):
            raise ProtocolError(f"malformed tensor strides {_describe(tuple(spec))}")
        if spec.devices != () and not _devices_ok(spec.devices):
            raise ProtocolError(f"malformed tensor devices {_describe(tuple(spec))}")
        dtype = _DTYPES[spec.dtype]
        if spec.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise ProtocolError(f"a {spec.dtype} tensor cannot require grad")
        count = sum(1 for c in spec.components() if _nbytes(*c))
        nonempty += count
        out.append(spec)
        if len(cache) >= _CHECKED_MAX:
            cache.clear()
        cache[key] = (spec, count)
    if nbuffers is not None and nonempty != nbuffers:
        raise ProtocolError(f"{nbuffers} tensor buffers for {nonempty} non-empty tensors")
    return tuple(out)


def _devices_ok(devices: Any) -> bool:
    """``(source, target)``: two short device strings."""
    return isinstance(devices, tuple) and len(devices) == 2 and all(
        type(d) is str and 0 < len(d) <= 64 for d in devices)


def _parts_ok(spec: TensorSpec) -> bool:
    if spec.kind & ~_PARAMETER == _DENSE:
        return spec.parts == ()
    parts = spec.parts
    return (isinstance(parts, tuple) and len(parts) == 3 and type(parts[0]) is int
            and 0 <= parts[0] <= len(spec.shape) and type(parts[1]) is int and parts[1] >= 0
            and type(parts[2]) is bool)


_INT64_MAX = (1 << 63) - 1


def _strides_ok(spec: TensorSpec) -> bool:
    """Strides of a dense, non-empty view: one int in [0, 2**63) per dimension,
    with the view's logical size (elements times item size) and its span within
    int64 (torch's own limits; the span must then match the buffer)."""
    strides, shape = spec.strides, spec.shape
    if not isinstance(strides, tuple) or spec.kind & ~_PARAMETER != _DENSE \
            or len(strides) != len(shape) \
            or any(type(s) is not int or not 0 <= s <= _INT64_MAX for s in strides):
        return False
    numel = 1
    for n in shape:
        numel *= n
    return 0 < numel * _DTYPES[spec.dtype].itemsize <= _INT64_MAX \
        and _span(shape, strides) * _DTYPES[spec.dtype].itemsize <= _INT64_MAX


def rebuild_tensors(specs: Sequence[TensorSpec], buffers: Sequence,
                    place: Callable[[torch.Tensor, str], torch.Tensor] | None = None
                    ) -> list[torch.Tensor]:
    """Tensors on the received buffers (no copy); raises ProtocolError.

    A tensor whose spec names a target device other than the CPU is copied there
    by ``place(tensor, target)`` (the receiving agent's, which checks the target is
    one of its devices); without ``place`` such a spec is a ProtocolError.

    Every spec and every buffer size is checked before a tensor is built, so a
    spec declaring a huge shape never makes this allocate: a non-empty piece
    only ever views its received buffer, and an empty one holds no storage. A
    sparse tensor's indices are checked against its shape (and its coalesced
    flag against its indices) before anyone can index memory with them.
    """
    specs = check_specs(tuple(specs), len(buffers))
    out, i = [], 0
    for spec in specs:
        try:
            pieces = []
            for dtype, shape, strides in spec.components():
                nbytes = _nbytes(dtype, shape, strides)
                if nbytes == 0:
                    pieces.append(torch.empty(shape, dtype=dtype))  # some dimension is 0: no storage
                    continue
                buf = buffers[i]
                i += 1
                have = memoryview(buf).nbytes
                if have != nbytes:
                    raise ProtocolError(f"tensor buffer holds {have} bytes, spec needs {nbytes}")
                flat = torch.frombuffer(buf, dtype=dtype)
                # the span's last element is the buffer's last (checked above): in bounds
                pieces.append(flat.as_strided(shape, strides, 0) if strides else flat.view(shape))
            if spec.kind & ~_PARAMETER == _SPARSE_COO:
                t = torch.sparse_coo_tensor(pieces[0], pieces[1], spec.shape,
                                            is_coalesced=spec.parts[2], check_invariants=True)
            else:
                t = pieces[0]
            if spec.devices and spec.devices[1] != "cpu":
                if place is None:
                    raise ProtocolError(f"a tensor sent to device {spec.devices[1]!r}, and this "
                                        "worker has no device maps")
                t = place(t, spec.devices[1])
            if spec.kind & _PARAMETER:
                t = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
            elif spec.requires_grad:
                t.requires_grad_(True)
        except ProtocolError:
            raise
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(f"cannot rebuild tensor {_describe(tuple(spec))}: {e}") from e
        out.append(t)
    return out


# CPython's unpickler allocates the length a BINBYTES / BINBYTES8 / BYTEARRAY8
# opcode declares before it reads the bytes (other opcodes check the length
# against the data first), so ``b"\x8e" + 8-byte length`` makes it allocate up to
# 2**63 bytes; and it sizes its memo (8 bytes an entry, doubled) by the index a
# LONG_BINPUT / PUT names, so ``b"r" + 4 bytes`` makes it allocate up to 64 GiB.
# check_pickle refuses such pickles without allocating.
_SUSPECT = re.compile(rb"[Bpr\x8e\x96]")  # bytes that could be one of those opcodes
_ALLOC_CODES = frozenset(b"B\x8e\x96")
CHECK_PICKLE_LIMIT = 1 << 20  # bytes; larger pickles are not scanned (cost)
_SOUND: set = set()     # pickles that needed the walk and passed it
_SOUND_MAX, _SOUND_MAX_BYTES = 2048, 2048
# How the unpickler reads each opcode's argument, by opcode byte (None: not an
# opcode, the unpickler stops there): (kind, width) with kind one of
_NOARG, _FIXED, _LINE, _LINES2, _COUNTED, _STOP = range(6)
# and width the fixed argument's bytes (_FIXED) or the length prefix's (_COUNTED).
_NO_ARG = (_NOARG, 0)


def _opcode_table() -> list:
    counted = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    table: list = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if op.name == "STOP":
            how = (_STOP, 0)
        elif arg is None:
            how = _NO_ARG
        elif arg.n >= 0:
            how = (_FIXED, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:  # GLOBAL and INST read two lines
            how = (_LINES2 if arg.name == "stringnl_noescape_pair" else _LINE, 0)
        else:
            how = (_COUNTED, counted[arg.n])
        table[ord(op.code)] = how
    return table


_OPCODES = _opcode_table()


def _walk(data: bytes) -> None:
    """Read ``data`` opcode by opcode as the unpickler would (up to STOP, an
    unknown opcode or a truncated argument: where it stops too); ValueError at an
    allocating opcode declaring more bytes than follow, or at a LONG_BINPUT / PUT
    index larger than the pickle (a pickle of n bytes memoizes fewer than n objects)."""
    n, i, table, from_bytes = len(data), 0, _OPCODES, int.from_bytes
    while i < n:
        code = data[i]
        how = table[code]
        i += 1
        if how is _NO_ARG:  # the most common case first
            continue
        if how is None:
            return
        kind, width = how
        if kind == _COUNTED:
            size = from_bytes(data[i:i + width], "little")
            i += width + size
            if i > n:
                if code in _ALLOC_CODES:
                    raise ValueError(f"opcode {chr(code)!r} declares {size} bytes, "
                                     f"{n - i + size} follow")
                return
        elif kind == _FIXED:
            if code == 0x72 and from_bytes(data[i:i + 4], "little") > n:  # LONG_BINPUT
                raise ValueError(f"memo index {from_bytes(data[i:i + 4], 'little')} in a pickle "
                                 f"of {n} bytes")
            i += width
        elif kind == _STOP:
            return
        else:
            j = data.find(b"\n", i)
            if j >= 0 and kind == _LINES2:
                j = data.find(b"\n", j + 1)
            if j < 0:
                return
            if code == 0x70:  # PUT: a decimal index (int() refuses what it cannot read)
                index = int(data[i:j])
                if index > n:
                    raise ValueError(f"memo index {index} in a pickle of {n} bytes")
            i = j + 1


def check_pickle(data: Any) -> None:
    """Raise ValueError when ``data`` (up to CHECK_PICKLE_LIMIT bytes) holds an
    opcode declaring more bytes than the pickle has, or a memo index beyond what
    a pickle of that size can need.

    Fast path: a pickle without any byte that could be such an opcode (a regex
    search) passes at once. Otherwise the pickle is walked opcode by opcode
    (:func:`_walk`, a table-driven loop that reads nothing but lengths: 2-9 us
    for a message's pickles, 15-40 ns a byte for large ones; "r" is in most
    names, so most pickles get there), and one of at most ``_SOUND_MAX_BYTES``
    that passed is remembered by its bytes: a training loop sends the same ones
    again (then the whole check costs about 1 us, as the old fast path did).
    """
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    if n > CHECK_PICKLE_LIMIT or _SUSPECT.search(mv) is None:
        return
    key = bytes(mv)
    if n <= _SOUND_MAX_BYTES:
        if key in _SOUND:
            return
        _walk(key)
        if len(_SOUND) >= _SOUND_MAX:
            _SOUND.clear()
        _SOUND.add(key)
    else:
        _walk(key)


def loads(data: bytes, specs: Sequence[TensorSpec] = (), buffers: Sequence = (),
          tensor_hook: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
          tensors: list[torch.Tensor] | None = None,
          place: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> Any:
    """Rebuild an object pickled by :func:`dumps`.

    ``tensor_hook`` may replace the rebuilt tensors before the object graph is
    built (distributed autograd attaches its recv function there); ``place``
    puts a tensor sent to a device there (see :func:`rebuild_tensors`).

    Raises ProtocolError (malformed specs, buffers or tensor references);
    ImportError / AttributeError as pickle raised them when the payload names a
    module or attribute this process lacks (as torch does); a DistgradError a
    reducer raised on purpose; SerializationError for every other unpickling
    failure (the original error is its ``__cause__``). Never allocates for a
    size a frame declares beyond the received bytes.
    """
    if tensors is None:
        tensors = rebuild_tensors(specs, buffers, place)
    if tensor_hook is not None:
        tensors = tensor_hook(tensors)
    saved = getattr(_local, "rebuilt", None)  # loads nests when a reducer unpickles
    _local.rebuilt = tensors
    try:
        check_pickle(data)
        return _Unpickler(io.BytesIO(data)).load()
    except (DistgradError, ImportError, AttributeError):
        # ProtocolError (bad tensor reference), an error a reducer raised on purpose, or a
        # module/attribute the sender has and this process lacks (torch raises these as is)
        raise
    except Exception as e:  # a garbled pickle raises any of pickle's many error types
        raise SerializationError(f"cannot unpickle the payload: {type(e).__name__}: {e}") from e
    finally:
        _local.rebuilt = saved
