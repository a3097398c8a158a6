"""The message kinds and the decoded message, shared by both envelope layouts
(the general one, :mod:`.messages`, and the fast one, :mod:`.fast_header`)."""
from __future__ import annotations

from enum import IntEnum


class Kind(IntEnum):
    CALL = 1      # run a function, reply with its result
    REMOTE = 2    # run a function, keep the result in an owner RRef
    REPLY = 3     # result of a CALL/REMOTE
    ERROR = 4     # the CALL/REMOTE raised; payload describes the exception
    CONTROL = 5   # one-way message handled in order by the reading thread (RRef forks...)
    GOODBYE = 6   # the sender is shutting down on purpose
    NOTIFY = 7    # run a function on the pool, no reply (distributed autograd's gradients)
    GRADS = 8     # a NOTIFY of shipped gradients in the fixed binary layout (fast layout only)


# the kinds of the general envelope (a gradient message has the fast layout only)
_KINDS = {int(k): k for k in Kind if k is not Kind.GRADS}


class Message:
    """A decoded message; the payload is unpickled later, by the thread that serves it."""

    __slots__ = ("kind", "rid", "meta", "specs", "payload", "buffers", "sender", "local", "handed_off",
                 "tensors", "call")

    def __init__(self, kind, rid, meta, specs, payload, buffers, sender=None):
        self.kind, self.rid, self.meta, self.specs = kind, rid, meta, specs
        self.payload, self.buffers, self.sender = payload, buffers, sender
        self.local = None  # attached in order by a pre-dispatch hook
        self.handed_off = None  # perf_counter() at the hand-off to the pool (GIL profiling)
        self.tensors = None  # built by the fast path's decode (its specs already checked)
        self.call = None  # (func, args, kwargs) of a gradient message, decoded without a pickle
