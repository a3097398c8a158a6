"""distgrad's error hierarchy.

Every error distgrad raises on its own account derives from
:class:`DistgradError` (itself a ``RuntimeError``, which is what code written
for ``torch.distributed.rpc`` catches). Errors that concern one peer carry its
name in ``.worker_name`` and in the message.

    DistgradError (RuntimeError)
    ├── RPCTimeoutError (also TimeoutError)  a call ran past its deadline
    ├── WorkerLostError                      the peer died or went silent
    ├── RemoteError                          the remote function raised and its
    │                                        exception type could not be rebuilt
    ├── BackwardError                        a node raised during a distributed
    │   │                                    backward ("Error on Node N: ...")
    │   └── AnomalyError                     detect_anomaly(): a node returned NaN/Inf
    ├── ProtocolError                        malformed or unexpected frames (or
    │   │                                    store entries)
    │   └── StoreTamperedError               rendezvous store entries failed their
    │                                        check (forged, replayed, deleted)
    ├── ContextReleasedError                 a reply that requires grad, made in a
    │                                        distributed autograd context released
    │                                        meanwhile (torch's "Couldn't find
    │                                        autograd context data")
    ├── IncarnationsExhaustedError           a dynamic group's rank was held by as
    │                                        many processes as its ids allow
    └── SerializationError (also TypeError)  an argument or result cannot be
                                             pickled; nothing was sent

Example::

    >>> import distgrad.rpc as rpc
    >>> try:
    ...     rpc.rpc_sync("worker1", slow_fn, timeout=0.1)
    ... except rpc.RPCTimeoutError as e:
    ...     print(e.worker_name)
"""
from __future__ import annotations


class DistgradError(RuntimeError):
    """Base class of distgrad's errors; ``worker_name`` names the peer concerned."""

    def __init__(self, message: str, worker_name: str | None = None) -> None:
        super().__init__(message)
        self.worker_name = worker_name


class RPCTimeoutError(DistgradError, TimeoutError):
    """A call, ``to_here`` or backward pass ran past its timeout."""


class WorkerLostError(DistgradError):
    """The peer crashed, went silent past the heartbeat deadline, or shut down."""


class RemoteError(DistgradError):
    """The remote side raised an exception whose type could not be rebuilt here.

    ``remote_type`` is the qualified name of the original type and
    ``remote_traceback`` the formatted traceback from the remote worker.
    """

    def __init__(self, message: str, worker_name: str | None = None,
                 remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message, worker_name)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class BackwardError(DistgradError):
    """A node raised during a distributed backward pass.

    The message starts as torch's does, ``"Error on Node <rank>: <original
    message>"``, and names the autograd node and the worker; ``node_name`` and
    ``cause_type`` (qualified name of the original exception type) are attributes.
    """

    def __init__(self, message: str, worker_name: str | None = None, node_name: str = "",
                 cause_type: str = "") -> None:
        super().__init__(message, worker_name)
        self.node_name = node_name
        self.cause_type = cause_type

    def __reduce__(self):
        return (type(self), (self.args[0], self.worker_name, self.node_name, self.cause_type))


class AnomalyError(BackwardError):
    """Under ``dist_autograd.detect_anomaly()``: a backward function returned NaN or Inf.

    ``worker_name`` and ``node_name`` say where; ``forward_stack`` is where that node
    was created (in the forward, on that worker); ``chains`` lists the ways (worker
    names, from this worker on) the poisoned gradient would have travelled.
    """

    def __init__(self, message: str, worker_name: str | None = None, node_name: str = "",
                 cause_type: str = "", forward_stack: str = "", hops: list | None = None) -> None:
        super().__init__(message, worker_name, node_name, cause_type)
        self.summary = message
        self.forward_stack = forward_stack
        self.hops = list(hops or [])   # (worker id, message id) of the first hops
        self.chains: list[list[str]] = []
        self.set_chains([])

    def set_chains(self, chains: list) -> None:
        """Record the ways the gradient would have gone; the message then shows them."""
        self.chains = [list(c) for c in chains]
        text = self.summary
        if self.chains:
            text += "\nThe poisoned gradient would have travelled: " + "; ".join(
                " -> ".join(c) for c in self.chains)
        if self.forward_stack:
            text += (f"\nTraceback of the forward call that created {self.node_name} on worker "
                     f"{self.worker_name}:\n{self.forward_stack.rstrip()}")
        self.args = (text,)

    def __reduce__(self):
        return (_rebuild_anomaly, (self.summary, self.worker_name, self.node_name, self.forward_stack,
                                   self.hops, self.chains))


def _rebuild_anomaly(summary, worker, node, stack, hops, chains) -> AnomalyError:
    err = AnomalyError(summary, worker, node, "", stack, hops)
    err.set_chains(chains)
    return err


class ProtocolError(DistgradError):
    """A peer sent bytes that do not form a valid distgrad message (or the
    rendezvous store holds an entry that is not a valid distgrad entry)."""


class StoreTamperedError(ProtocolError):
    """Entries distgrad needs in the rendezvous store failed authentication (forged,
    altered, replayed from another key or attempt, written without the cluster
    secret), or were deleted or rolled back, so the start could not complete.
    ``keys`` maps each such key to what was wrong with it."""

    def __init__(self, message: str, worker_name: str | None = None,
                 keys: dict | None = None) -> None:
        super().__init__(message, worker_name)
        self.keys = dict(keys or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.worker_name, self.keys))


class IncarnationsExhaustedError(DistgradError):
    """``init_rpc`` of a dynamic group: the rank asked for (or, with ``rank=None``,
    every rank) already had as many incarnations (processes, one after another) as
    the id layout gives a rank (see :mod:`distgrad.ids`). ``rank`` and ``limit``
    are attributes."""

    def __init__(self, message: str, worker_name: str | None = None, rank: int = -1,
                 limit: int = 0) -> None:
        super().__init__(message, worker_name)
        self.rank = rank
        self.limit = limit

    def __reduce__(self):
        return (type(self), (self.args[0], self.worker_name, self.rank, self.limit))


class ContextReleasedError(DistgradError):
    """A message that requires grad, made inside a distributed autograd context that
    was released meanwhile (its ``with`` block ended on the caller while the call
    still ran): torch's "Couldn't find autograd context data for current autograd
    context id". The caller's ``wait()`` raises it; nothing is sent cut off from
    the graph.

    Example::

        >>> with dist_autograd.context():
        ...     fut = rpc.rpc_async("worker1", slow_mul, args=(x,))   # block ends first
        >>> fut.wait()   # raises ContextReleasedError (a RuntimeError)
    """


class SerializationError(DistgradError, TypeError):
    """An object could not be pickled (caller side) or unpickled (callee side)."""


_SERIALIZATION_TYPES: dict[type, type] = {}


def _serialization_type(base: type) -> type:
    """``SerializationError`` combined with ``base``, one class per base, reachable as
    ``distgrad.errors.SerializationError_<base name>`` (so it pickles by reference and a
    remote error of this type comes back as itself)."""
    cls = _SERIALIZATION_TYPES.get(base)
    if cls is None:
        name = f"SerializationError_{base.__name__}"
        try:
            cls = type(name, (SerializationError, base),
                       {"__module__": __name__, "__qualname__": name, "__doc__": SerializationError.__doc__})
        except TypeError:  # a base whose layout cannot be combined
            cls = SerializationError
        _SERIALIZATION_TYPES[base] = cls
    return cls


def __getattr__(name: str) -> type:
    """``SerializationError_<base>`` for bases from builtins and pickle (unpickling a
    remote error made before this process made the class)."""
    if name.startswith("SerializationError_"):
        import builtins
        import pickle
        base_name = name[len("SerializationError_"):]
        base = getattr(builtins, base_name, None) or getattr(pickle, base_name, None)
        if isinstance(base, type) and issubclass(base, Exception):
            cls = _serialization_type(base)
            if cls.__qualname__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serialization_error(message: str, cause: BaseException,
                        worker_name: str | None = None) -> SerializationError:
    """A :class:`SerializationError` that is also an instance of ``cause``'s type, so code
    written for torch (which raises pickle's own error: ``TypeError`` for an object that
    cannot be pickled, ``AttributeError`` for a local function, ``PicklingError``...)
    catches it as before.

    Example::

        >>> e = serialization_error("cannot pickle", AttributeError("local object"))
        >>> isinstance(e, AttributeError), isinstance(e, TypeError)
        (True, True)
    """
    base = type(cause)
    cls = SerializationError
    if not issubclass(SerializationError, base) and isinstance(cause, Exception):
        cls = _serialization_type(base)
    try:
        err = cls(message, worker_name)
    except TypeError:  # a base whose constructor insists on its own arguments
        err = SerializationError(message, worker_name)
    err.__cause__ = cause
    return err


__all__ = ["AnomalyError", "BackwardError", "DistgradError", "RPCTimeoutError", "WorkerLostError",
           "RemoteError", "ProtocolError", "StoreTamperedError", "IncarnationsExhaustedError",
           "SerializationError", "serialization_error"]
