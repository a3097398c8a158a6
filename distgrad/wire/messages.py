"""Message framing: one *envelope* frame (a fixed binary header, a small meta
pickle and the payload pickle) followed by the out-of-band tensor buffers.

    frame 0   envelope  header | meta | payload
                header  b"DG", version, kind, buffer count, request id, meta length (struct)
                meta    pickle of (meta, tensor specs): small, read first
                payload pickle of the object, tensors as persistent ids
    frame 1+  buffers   one per non-empty tensor, raw bytes

Everything that is ever parsed lives in frame 0, which the transport
authenticates in full; the buffers are raw bytes, never parsed (see
:mod:`distgrad.transport.auth`). One envelope instead of three frames saves
two zmq frames per message on each side. The header is checked before
anything is unpickled; counts and lengths must agree. The common message
(dense tensors, no autograd context, no RRef bookkeeping) travels in the fast
layout instead (:mod:`.fast_header`: magic b"DF", no meta pickle);
:func:`decode` and :func:`peek_header` read both.
"""
from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ProtocolError, SerializationError
from .fast_header import FAST_MAGIC, decode_fast, fast_header
from .kinds import _KINDS, Kind, Message
from .pickler import check_pickle, tensor_frames

MAGIC = b"DG"
VERSION = 2
HEADER = struct.Struct("!2sBBIQI")
MAX_BUFFERS = (1 << 16) - 8  # the transport carries at most 65536 frames a message


def encode(kind: Kind, rid: int, meta: Any, payload: bytes = b"",
           tensors: Sequence[torch.Tensor] = ()) -> list:
    """Frames for one message; tensor buffers are not copied.

    Example::

        >>> data, tensors = dumps((torch.add, (torch.ones(2), 1), {}))
        >>> frames = encode(Kind.CALL, 7, None, data, tensors)
        >>> decode(frames).rid
        7
    """
    specs, buffers = tensor_frames(tensors) if tensors else ((), ())
    if len(buffers) > MAX_BUFFERS:
        raise SerializationError(f"a message of {len(buffers)} tensor buffers (at most "
                                 f"{MAX_BUFFERS}): send fewer, larger tensors (torch.stack)")
    # a spec's ``devices`` travels only when set (a CPU tensor's spec is what it was)
    meta_bytes = pickle.dumps((meta, tuple(tuple(s) if s[6] else s[:6] for s in specs)), protocol=5)
    head = HEADER.pack(MAGIC, VERSION, int(kind), len(buffers), rid, len(meta_bytes))
    return [b"".join((head, meta_bytes, payload)), *buffers]


def _header(frames: Sequence) -> tuple:
    if len(frames) < 1:
        raise ProtocolError("message has no frames")
    env = frames[0]
    size = memoryview(env).nbytes
    if size < HEADER.size:
        raise ProtocolError(f"envelope of {size} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, kind, nbuf, rid, meta_len = HEADER.unpack_from(env)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad magic/version {magic!r}/{version}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if nbuf != len(frames) - 1 or nbuf > MAX_BUFFERS:
        raise ProtocolError(f"header announces {nbuf} buffers, message has {len(frames) - 1}")
    if HEADER.size + meta_len > size:
        raise ProtocolError(f"header announces {meta_len} meta bytes, the envelope has "
                            f"{size - HEADER.size}")
    return kind, rid, nbuf, meta_len


def _is_fast(frames: Sequence) -> bool:
    env = frames[0] if frames else b""
    if isinstance(env, (bytes, bytearray)):
        return env[:2] == FAST_MAGIC
    try:
        return memoryview(env).cast("B")[:2] == FAST_MAGIC
    except (TypeError, ValueError):
        return False


def peek_header(frames: Sequence) -> tuple[int, int, int]:
    """(kind, request id, buffer count) after checking magic, version, counts and
    lengths (of either layout: the fast one, :mod:`.fast_header`, or this one)."""
    if _is_fast(frames):
        return fast_header(frames)
    return _header(frames)[:3]


def request_id(frames: Sequence) -> int | None:
    """The request id of a CALL/REMOTE whose header frame is well formed, even
    when the rest of the message is not (so the sender can get an error
    reply); None otherwise. Never raises."""
    try:
        if _is_fast(frames):
            kind, rid, _ = fast_header(frames)
            return rid if kind == Kind.CALL else None
        magic, version, kind, _, rid, _ = HEADER.unpack_from(frames[0])
    except Exception:  # noqa: BLE001 - no frame, or one of the wrong size or type
        return None
    if magic == MAGIC and version == VERSION and kind in (Kind.CALL, Kind.REMOTE):  # not NOTIFY
        return rid
    return None


def decode(frames: Sequence, sender: Any = None) -> Message:
    """Parse frames (bytes or buffers) into a :class:`Message`.

    Raises ProtocolError and nothing else: no frame, a short header, wrong magic,
    version or kind; a buffer count other than the header's; a meta length
    beyond the envelope; meta bytes that do not unpickle to ``(meta, specs)``
    with ``specs`` a tuple (or declare more bytes than they have: nothing is
    allocated for it). The specs themselves
    and the buffer sizes are checked by :func:`~.pickler.rebuild_tensors`
    (ProtocolError too) and the payload by :func:`~.pickler.loads`
    (SerializationError); decode touches neither. A fast envelope (magic
    b"DF") is parsed by :func:`~.fast_header.decode_fast`, which checks its
    table and builds its tensors here.
    """
    env = frames[0] if frames else b""
    if (env[:2] == FAST_MAGIC) if type(env) is bytearray else _is_fast(frames):
        return decode_fast(frames, sender)
    kind, rid, _, meta_len = _header(frames)
    env = memoryview(frames[0])
    meta_end = HEADER.size + meta_len
    try:
        meta_bytes = env[HEADER.size:meta_end]
        check_pickle(meta_bytes)
        meta, specs = pickle.loads(meta_bytes)
    except Exception as e:
        raise ProtocolError(f"malformed meta: {type(e).__name__}: {e}") from e
    if not isinstance(specs, tuple):
        raise ProtocolError("malformed tensor specs")
    return Message(_KINDS[kind], rid, meta, specs, env[meta_end:], list(frames[1:]), sender)
