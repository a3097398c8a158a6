"""The fast path of the wire: the common message with a fixed binary header.

Most messages are a call or its reply carrying dense CPU tensors, with no
autograd context, no RRef bookkeeping and no profiler: their meta is
``(what, None, None)`` (a request) or ``None`` (a reply). For them the
general envelope's meta pickle (``pickle.dumps((meta, specs))`` on one side,
``check_pickle`` + ``pickle.loads`` + the spec checks on the other) is replaced
by fixed binary fields::

    frame 0   envelope  header | what | tensor table | payload
                header  b"DF", version, kind, buffer count, request id,
                        what length, tensor count (struct "!2sBBIQHH")
                what    the function's qualified name, UTF-8 (empty in a reply)
                table   per tensor: dtype code, flags (1: requires grad,
                        2: nn.Parameter), dims (struct "!BBB"), then its
                        shape (u64 each)
                payload pickle of the object, tensors as table references
    frame 1+  buffers   one per non-empty tensor, raw bytes (as the general path)

The magic differs from the general envelope's (b"DG"), so a receiver tells the
two apart by the first two bytes and every later field is read under one
layout only. :func:`decode_fast` checks every field (magic, version, kind,
buffer count, name length and encoding, tensor count, each dtype code, flag,
dimension count and size, the table's end within the envelope, the buffer
sizes) before anything is unpickled, and raises ProtocolError and nothing else;
it builds the tensors on the received buffers (no copy) so the serving thread
unpickles only the payload. Everything parsed lives in frame 0, which the
transport authenticates (or encrypts) in full, as for the general path.

Example::

    >>> data, tensors = dumps((torch.add, (torch.ones(2), 1), {}))
    >>> frames = encode_fast(Kind.CALL, 7, "torch.add", data, tensors)
    >>> decode_fast(frames).meta
    ('torch.add', None, None)
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from ..errors import ProtocolError
from .kinds import Kind, Message
from .pickler import _PARAMETER, MAX_DIMS, SNAPSHOT_BYTES, TensorSpec

FAST_MAGIC = b"DF"
FAST_VERSION = 1
FAST = struct.Struct("!2sBBIQHH")  # magic, version, kind, nbuf, rid, what length, tensors
_ENTRY = struct.Struct("!BBB")     # dtype code, flags, dims
MAX_WHAT = (1 << 16) - 1
MAX_BUFFERS = (1 << 16) - 8        # as the general envelope (the transport's frame limit)
_REQUIRES_GRAD, _PARAM = 1, 2
# The dtypes the fast path carries (those numpy shares: their bytes are the array's);
# a dtype's code is its index here and never changes (the receiver's table)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
_CODES = {d: i for i, d in enumerate(DTYPES)}
_NAMES = tuple(str(d) for d in DTYPES)
_ITEMSIZE = tuple(d.itemsize for d in DTYPES)
_GRADABLE = tuple(d.is_floating_point for d in DTYPES)
_DIMS = [struct.Struct(f"!{n}Q") for n in range(MAX_DIMS + 1)]
_KINDS = {int(k): k for k in (Kind.CALL, Kind.NOTIFY, Kind.REPLY, Kind.GRADS)}
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_strided = torch.strided
_tuple_new = tuple.__new__
# TensorSpec's fields after dtype, shape, requires_grad and kind, at their defaults
_SPEC_REST = tuple(TensorSpec._field_defaults[f] for f in TensorSpec._fields[4:])


def encode_fast(kind: Kind, rid: int, what: str, payload: bytes,
                tensors: Sequence[torch.Tensor] = ()) -> list | None:
    """Frames of a CALL / NOTIFY (``what`` the function's name) or a REPLY
    (``what`` empty) in the fast layout; None when the message does not fit it
    (a tensor that is not a plain dense contiguous CPU tensor of a common dtype,
    too many tensors, too long a name): the general path then sends it."""
    if len(tensors) > MAX_BUFFERS:
        return None
    name = what.encode() if what else b""
    if len(name) > MAX_WHAT:
        return None
    parts = [b"", name]
    buffers = []
    for t in tensors:
        code = _CODES.get(t.dtype)
        cls = type(t)
        if code is None or (cls is not _Tensor and cls is not _Parameter) or t.layout is not _strided \
                or not t.is_contiguous() or t.is_neg():
            return None
        shape = t.shape
        flags = (_REQUIRES_GRAD if t.requires_grad else 0) | (_PARAM if cls is _Parameter else 0)
        parts.append(_ENTRY.pack(code, flags, len(shape)))
        if shape:
            parts.append(_DIMS[len(shape)].pack(*shape))
        if t.numel():
            arr = t.detach().numpy()
            buffers.append(arr.tobytes() if arr.nbytes <= SNAPSHOT_BYTES else arr.reshape(-1).view("u1"))
    parts[0] = FAST.pack(FAST_MAGIC, FAST_VERSION, int(kind), len(buffers), rid, len(name), len(tensors))
    parts.append(payload)
    return [b"".join(parts), *buffers]


def fast_header(frames: Sequence) -> tuple:
    """(kind, rid, nbuf) of a fast envelope after checking magic, version, kind,
    buffer count and the name's length; raises ProtocolError."""
    env = frames[0]
    size = len(env) if isinstance(env, (bytes, bytearray)) else memoryview(env).nbytes
    if size < FAST.size:
        raise ProtocolError(f"envelope of {size} bytes is shorter than the {FAST.size}-byte header")
    magic, version, kind, nbuf, rid, what_len, ntensors = FAST.unpack_from(env)
    if magic != FAST_MAGIC or version != FAST_VERSION:
        raise ProtocolError(f"bad magic/version {magic!r}/{version}")
    k = _KINDS.get(kind)
    if k is None:
        raise ProtocolError(f"message kind {kind} has no fast layout")
    if nbuf != len(frames) - 1 or nbuf > MAX_BUFFERS or nbuf > ntensors:
        raise ProtocolError(f"header announces {nbuf} buffers, message has {len(frames) - 1}")
    if FAST.size + what_len > size:
        raise ProtocolError(f"header announces a {what_len}-byte name, the envelope has "
                            f"{size - FAST.size}")
    if (k is Kind.REPLY or k is Kind.GRADS) and what_len:
        raise ProtocolError(f"a {k.name.lower()} message names no function")
    return k, rid, nbuf


def decode_fast(frames: Sequence, sender=None, header: tuple | None = None) -> Message:
    """Parse a fast envelope and build its tensors on the buffers (no copy);
    raises ProtocolError and nothing else (the payload is not touched).
    ``header``: what :func:`fast_header` returned for these frames, when the
    caller already checked it."""
    kind, rid, nbuf = fast_header(frames) if header is None else header
    env = memoryview(frames[0])
    size = env.nbytes
    _, _, _, _, _, what_len, ntensors = FAST.unpack_from(env)
    pos = FAST.size + what_len
    if kind is Kind.REPLY:
        meta = None
    elif kind is Kind.GRADS:
        meta = ("", None, None)   # (the receiver's gradient function: see grads_args)
    else:
        try:
            meta = (str(env[FAST.size:pos], "utf-8"), None, None)
        except UnicodeDecodeError as e:
            raise ProtocolError(f"malformed function name: {e}") from None
    buffers = list(frames[1:])
    specs, tensors = [], []
    used = 0
    try:
        for _ in range(ntensors):
            if pos + 3 > size:
                raise ProtocolError("tensor table runs past the envelope")
            code, flags, ndim = _ENTRY.unpack_from(env, pos)
            pos += 3
            if code >= len(DTYPES) or flags > 3 or ndim > MAX_DIMS:
                raise ProtocolError(f"malformed tensor entry (dtype {code}, flags {flags}, "
                                    f"{ndim} dims)")
            if flags & _REQUIRES_GRAD and not _GRADABLE[code]:
                raise ProtocolError(f"a {_NAMES[code]} tensor cannot require grad")
            if ndim:
                if pos + 8 * ndim > size:
                    raise ProtocolError("tensor table runs past the envelope")
                shape = _DIMS[ndim].unpack_from(env, pos)
                pos += 8 * ndim
            else:
                shape = ()
            numel = 1
            for n in shape:
                numel *= n
            nbytes = numel * _ITEMSIZE[code]
            dtype = DTYPES[code]
            if nbytes == 0:
                if any(n >= 1 << 62 for n in shape):
                    raise ProtocolError(f"malformed tensor shape {shape}")
                t = torch.empty(shape, dtype=dtype)  # some dimension is 0: no storage
            else:
                if used >= nbuf:
                    raise ProtocolError(f"{nbuf} tensor buffers for more non-empty tensors")
                buf = buffers[used]
                used += 1
                have = len(buf) if isinstance(buf, (bytes, bytearray)) else memoryview(buf).nbytes
                if have != nbytes:
                    raise ProtocolError(f"tensor buffer holds {have} bytes, spec needs {nbytes}")
                t = torch.frombuffer(buf, dtype=dtype)
                if ndim != 1:
                    t = t.view(shape)
            rg = bool(flags & _REQUIRES_GRAD)
            if flags & _PARAM:
                t = _Parameter(t, requires_grad=rg)
            elif rg:
                t.requires_grad_(True)
            # (TensorSpec's fields without its generated __new__: a call less per tensor)
            specs.append(_tuple_new(TensorSpec, (_NAMES[code], shape, rg,
                                                 _PARAMETER if flags & _PARAM else 0) + _SPEC_REST))
            tensors.append(t)
    except ProtocolError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, struct.error) as e:
        raise ProtocolError(f"malformed tensor table: {e}") from e
    if used != nbuf:
        raise ProtocolError(f"{nbuf} tensor buffers for {used} non-empty tensors")
    msg = Message(kind, rid, meta, tuple(specs), env[pos:], buffers, sender)
    msg.tensors = tensors
    return msg


# -- shipped gradients (Kind.GRADS) ----------------------------------------------------
# A recv function's gradients going back to their sender, a NOTIFY of the receiver's
# gradient function (``engine._propagate``), in the fast layout with a fixed binary
# block where the payload pickle would be (no pickle either way, and no function name:
# the receiver runs its one gradient function):
#   block   context id, pass id (initiator rank, n), initiator, flags, autograd message
#           id, weight exponent (struct "!qqqqqqQ"), gradient count, unreached count
#           (struct "!HH"), then one byte per gradient (1: the table's next tensor,
#           0: None), then the unreached slots (u16 each, each below the count)
GRADS_BLOCK = struct.Struct("!qqqqqqQHH")
_SLOT = struct.Struct("!H")
_MAX_SLOTS = (1 << 16) - 1
_I64 = 1 << 63


def encode_grads(rid: int, args: tuple) -> list | None:
    """Frames of a gradient message (``Kind.GRADS``) for the receiver's gradient
    function called with ``args`` = (context id, pass id, initiator, flags, message id,
    grads, exp, unreached); None when they do not fit this layout (a field of another
    type or range, a gradient that requires grad, a tensor the fast table cannot
    carry): the sender then uses the general NOTIFY, whose receiver runs the same call.

    Example::

        >>> frames = encode_grads(9, (5, (0, 1), 0, 0, 7, [torch.ones(2), None], 2, [1]))
        >>> grads_args(decode_fast(frames))[5]
        [tensor([1., 1.]), None]
    """
    if len(args) != 8:
        return None
    context_id, pass_id, initiator, flags, msg_id, grads, exp, unreached = args
    if type(pass_id) is not tuple or len(pass_id) != 2 or type(grads) is not list \
            or type(unreached) is not list or len(grads) > _MAX_SLOTS or len(unreached) > _MAX_SLOTS:
        return None
    fields = (context_id, pass_id[0], pass_id[1], initiator, flags, msg_id)
    for v in fields:
        if type(v) is not int or not -_I64 <= v < _I64:
            return None
    if type(exp) is not int or not 0 <= exp < 1 << 64:
        return None
    n = len(grads)
    for i in unreached:
        if type(i) is not int or not 0 <= i < n:
            return None
    # the tensor table as encode_fast writes it, with fewer calls per tensor: a gradient
    # is a plain tensor that requires no grad (else: the general path)
    parts = [b""]
    buffers = []
    present = bytearray(n)
    for i, g in enumerate(grads):
        if g is None:
            continue
        code = _CODES.get(g.dtype)
        if code is None or type(g) is not _Tensor or g.requires_grad or g.layout is not _strided \
                or g.device.type != "cpu" or not g.is_contiguous() or g.is_neg():
            return None
        present[i] = 1
        shape = g.shape
        parts.append(_ENTRY.pack(code, 0, len(shape)))
        if shape:
            parts.append(_DIMS[len(shape)].pack(*shape))
        arr = g.numpy()
        if arr.nbytes:
            buffers.append(arr.tobytes() if arr.nbytes <= SNAPSHOT_BYTES else arr.reshape(-1).view("u1"))
    if len(buffers) > MAX_BUFFERS:
        return None
    parts[0] = FAST.pack(FAST_MAGIC, FAST_VERSION, int(Kind.GRADS), len(buffers), rid, 0, sum(present))
    parts.append(GRADS_BLOCK.pack(*fields, exp, n, len(unreached)))
    parts.append(bytes(present))
    parts.extend(_SLOT.pack(i) for i in unreached)
    return [b"".join(parts), *buffers]


def grads_args(msg: Message) -> tuple:
    """The gradient function's arguments from a decoded ``Kind.GRADS`` message (its
    tensors already built by :func:`decode_fast`), as :func:`encode_grads` took them;
    raises ProtocolError (a short or long block, a presence byte other than 0 or 1,
    present gradients other than the table's tensors, a slot out of range) and
    nothing else."""
    block = msg.payload
    size = len(block)
    if size < GRADS_BLOCK.size:
        raise ProtocolError(f"gradient block of {size} bytes is shorter than its "
                            f"{GRADS_BLOCK.size}-byte header")
    context_id, rank, n, initiator, flags, msg_id, exp, count, nslots = GRADS_BLOCK.unpack_from(block)
    pos = GRADS_BLOCK.size
    if size != pos + count + 2 * nslots:
        raise ProtocolError(f"gradient block of {size} bytes for {count} gradients and "
                            f"{nslots} unreached slots")
    tensors = msg.tensors
    grads: list = [None] * count
    used = 0
    for i in range(count):
        b = block[pos + i]
        if b == 1:
            if used >= len(tensors):
                raise ProtocolError("more present gradients than tensors")
            grads[i] = tensors[used]
            used += 1
        elif b != 0:
            raise ProtocolError(f"gradient presence byte {b}")
    if used != len(tensors):
        raise ProtocolError(f"{len(tensors)} tensors for {used} present gradients")
    for spec in msg.specs:   # (decode_fast's: no call on the tensors)
        if spec[2] or spec[3]:
            raise ProtocolError("a shipped gradient is a plain tensor that requires no grad")
    pos += count
    unreached = []
    for _ in range(nslots):
        (i,) = _SLOT.unpack_from(block, pos)
        pos += 2
        if i >= count:
            raise ProtocolError(f"unreached slot {i} of {count} gradients")
        unreached.append(i)
    return (context_id, (rank, n), initiator, flags, msg_id, grads, exp, unreached)
