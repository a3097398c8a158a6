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
    message = f"On WorkerInfo(id={worker_id}, name={worker_name}):\n{text}\n{tb}"
    exc: BaseException
    try:
        exc_type = pickle.loads(type_blob) if type_blob is not None else None
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise TypeError
        exc = exc_type(message)
    except Exception:
        exc = RemoteError(message, worker_name, qualname, tb)
    try:
        exc.worker_name = worker_name
        exc.remote_traceback = tb
        exc.remote_message = text
    except Exception:
        pass
    return exc
