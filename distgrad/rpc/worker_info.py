"""WorkerInfo: a worker's name and id (its rank)."""
from __future__ import annotations

import re

from ..errors import DistgradError

_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]*$")
MAX_NAME_LEN = 128


class WorkerInfo:
    """A worker's globally unique name and its id (the rank).

    Example::

        >>> info = rpc.get_worker_info("worker1")
        >>> info.name, info.id
        ('worker1', 1)
    """

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:
        if not isinstance(name, str) or not name:
            raise DistgradError("Worker name must be non-empty")
        if not _NAME_RE.match(name):
            raise DistgradError(f"Worker name must match ^[A-Za-z0-9-_:]*$, got {name!r}")
        if len(name) >= MAX_NAME_LEN:
            raise DistgradError(f"Worker name must be shorter than {MAX_NAME_LEN} chars, got {name!r}")
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))
