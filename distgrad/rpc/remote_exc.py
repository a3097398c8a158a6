"""Exceptions across the wire: packed on the callee, rebuilt on the caller with
their original type where possible, their message, the remote traceback text
and the worker's name."""
from __future__ import annotations

import pickle
import traceback

from ..errors import RemoteError


def pack_exception(exc: BaseException, worker_name: str, worker_id: int) -> bytes:
    """Bytes describing ``exc`` raised on this worker (never raises)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        type_blob = pickle.dumps(type(exc))
        pickle.loads(type_blob)
    except Exception:
        type_blob = None
    qualname = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return pickle.dumps((type_blob, qualname, repr(exc), tb, worker_name, worker_id))


def unpack_exception(data) -> BaseException:
    """The exception to raise on the caller for bytes from :func:`pack_exception`.

    Its message is ``"On WorkerInfo(id=1, name=worker1):\\n<repr>\\n<remote traceback>"``,
    as torch formats it; ``worker_name`` and ``remote_traceback`` are attributes.
    """
    type_blob, qualname, text, tb, worker_name, worker_id = pickle.loads(data)
    message = _unescape(f"On WorkerInfo(id={worker_id}, name={worker_name}):\n{text}\n{tb}")
    exc: BaseException
    try:
        exc_type = pickle.loads(type_blob) if type_blob is not None else None
    except Exception:
        exc_type = None
    if isinstance(exc_type, type) and issubclass(exc_type, BaseException):
        try:
            exc = exc_type(message)
        except Exception as e:  # e.g. a constructor that takes more than a message
            exc = RemoteError(f"Failed to create original exception type. Error msg was {e} Original "
                              f"exception on remote side was {message}", worker_name, qualname, tb)
    else:
        exc = RemoteError(message, worker_name, qualname, tb)
    try:
        exc.worker_name = worker_name
        exc.remote_traceback = tb
        exc.remote_message = text
    except Exception:
        pass
    return exc


def _unescape(message: str) -> str:
    """The exception's repr escapes newlines and quotes; show them as they were
    (as torch does), for messages that are plain ASCII."""
    try:
        return message.encode("ascii").decode("unicode_escape")
    except (UnicodeError, ValueError):
        return message
