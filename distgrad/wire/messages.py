"""Message framing: a fixed binary header, a small meta pickle, the payload
pickle and the out-of-band tensor buffers, each its own zmq frame.

    frame 0  header   b"DG", version, kind, buffer count, request id (struct)
    frame 1  meta     pickle of (meta, tensor specs): small, read first
    frame 2  payload  pickle of the object, tensors as persistent ids
    frame 3+ buffers  one per non-empty tensor, raw bytes

The header is checked before anything is unpickled; counts must agree.
"""
from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import torch

from ..errors import ProtocolError
from .pickler import check_pickle, tensor_frames

MAGIC = b"DG"
VERSION = 1
HEADER = struct.Struct("!2sBBIQ")
MAX_BUFFERS = 1 << 20


class Kind(IntEnum):
    CALL = 1      # run a function, reply with its result
    REMOTE = 2    # run a function, keep the result in an owner RRef
    REPLY = 3     # result of a CALL/REMOTE
    ERROR = 4     # the CALL/REMOTE raised; payload describes the exception
    CONTROL = 5   # one-way message handled on the I/O thread (RRef forks...)
    GOODBYE = 6   # the sender is shutting down on purpose
    NOTIFY = 7    # run a function on the pool, no reply (distributed autograd's gradients)


class Message:
    """A decoded message; the payload is unpickled later, off the I/O thread."""

    __slots__ = ("kind", "rid", "meta", "specs", "payload", "buffers", "sender", "local")

    def __init__(self, kind, rid, meta, specs, payload, buffers, sender=None):
        self.kind, self.rid, self.meta, self.specs = kind, rid, meta, specs
        self.payload, self.buffers, self.sender = payload, buffers, sender
        self.local = None  # attached on the I/O thread by a pre-dispatch hook


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
    head = HEADER.pack(MAGIC, VERSION, int(kind), len(buffers), rid)
    return [head, pickle.dumps((meta, tuple(tuple(s) for s in specs)), protocol=5),
            payload, *buffers]


def peek_header(frames: Sequence) -> tuple[int, int, int]:
    """(kind, request id, buffer count) after checking magic, version and counts."""
    if len(frames) < 3:
        raise ProtocolError(f"message has {len(frames)} frames, at least 3 expected")
    head = frames[0]
    if len(head) != HEADER.size:
        raise ProtocolError(f"header of {len(head)} bytes, {HEADER.size} expected")
    magic, version, kind, nbuf, rid = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad magic/version {magic!r}/{version}")
    if kind not in Kind._value2member_map_:
        raise ProtocolError(f"unknown message kind {kind}")
    if nbuf != len(frames) - 3 or nbuf > MAX_BUFFERS:
        raise ProtocolError(f"header announces {nbuf} buffers, message has {len(frames) - 3}")
    return kind, rid, nbuf


def request_id(frames: Sequence) -> int | None:
    """The request id of a CALL/REMOTE whose header frame is well formed, even
    when the rest of the message is not (so the sender can get an error
    reply); None otherwise. Never raises."""
    try:
        magic, version, kind, _, rid = HEADER.unpack(frames[0])
    except Exception:  # noqa: BLE001 - no frame, or one of the wrong size or type
        return None
    if magic == MAGIC and version == VERSION and kind in (Kind.CALL, Kind.REMOTE):  # not NOTIFY
        return rid
    return None


def decode(frames: Sequence, sender: Any = None) -> Message:
    """Parse frames (bytes or buffers) into a :class:`Message`.

    Raises ProtocolError and nothing else: wrong frame count, header, magic,
    version or kind; a buffer count other than the header's; a meta frame that
    does not unpickle to ``(meta, specs)`` with ``specs`` a tuple (or declares
    more bytes than it has: nothing is allocated for it). The specs themselves
    and the buffer sizes are checked by :func:`~.pickler.rebuild_tensors`
    (ProtocolError too) and the payload by :func:`~.pickler.loads`
    (SerializationError); decode touches neither.
    """
    kind, rid, _ = peek_header(frames)
    try:
        check_pickle(frames[1])
        meta, specs = pickle.loads(frames[1])
    except Exception as e:
        raise ProtocolError(f"malformed meta frame: {type(e).__name__}: {e}") from e
    if not isinstance(specs, tuple):
        raise ProtocolError("malformed tensor specs")
    return Message(Kind(kind), rid, meta, specs, frames[2], list(frames[3:]), sender)
