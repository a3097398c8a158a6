"""Tensors on accelerators through the wire: where each one goes, its copy to host
memory at the sender and its copy onto the mapped device at the receiver.

A message's tensors travel as host bytes. A tensor on an accelerator (``cuda``,
``xpu``, ``mps``, a PrivateUse1 backend such as the test device ``dgtest``) is
copied to host memory (pinned where the accelerator offers it) on the sender's
current stream of its device; the host reads the bytes only after an event
recorded on that stream has completed, so they hold what the stream wrote before
the call. Its spec records ``(source device, target device)``: the target is the
source through the sender's device map for that destination (a request: the
caller's own map; a reply: the reverse of the caller's map, see
:mod:`distgrad.rpc.devices`). The receiver checks the target is one of its
devices, builds the tensor on the received bytes and copies it there on its
current stream of that device; the call's future, created with ``devices=``,
then orders every waiter after that copy.

A :class:`Route` answers "where does a tensor on this device go" for one
destination and direction, and refuses a device without a map with torch's
TensorPipe message, at the sender, before anything is sent.

Example::

    >>> route = Route({torch.device("cuda:0"): torch.device("cuda:1")}, "worker1")
    >>> route.target(torch.device("cuda:0"))
    device(type='cuda', index=1)
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import ProtocolError, SerializationError

_BASE = ("TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
         "CPU before sending them over RPC, or call `set_device_map` on "
         "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. ")
_CPU = torch.device("cpu")


def no_map_message(what: str, dest: Any, device: Any) -> str:
    """torch's text for a tensor on ``device`` sent to ``dest`` with no device map to it
    at all (``what``: "Request" or "Response").

    Example::

        >>> no_map_message("Request", "worker1", "cuda:0")[-52:]
        'destination worker1, but found tensor on device: cuda:0'
    """
    return f"{_BASE}{what} device mapping is not available for destination {dest}, but found " \
           f"tensor on device: {device}"


def no_entry_message(what: str, dest: Any, device: Any) -> str:
    """torch's text for a tensor on ``device`` that a map to ``dest`` does not name.

    torch builds it from its own message twice over (TensorPipeAgent passes its
    message where the helper expects the destination's name), so the text repeats
    itself; it is kept word for word, so that code matching torch's text matches.

    Example::

        >>> no_entry_message("Response", "worker0", "cuda:1").endswith(
        ...     "worker0 for device cuda:1 but received a tensor on that device.")
        True
    """
    outer = f"{_BASE}{what} device mapping is not available for destination {dest}"
    return f"{_BASE}Request device mapping is not available for destination {outer} for device " \
           f"{device} but received a tensor on that device."


def not_input_device_message(device: Any, devices: Iterable) -> str:
    """torch's text for a reply tensor on a device that is not one of the callee's devices.

    Example::

        >>> not_input_device_message("cuda:1", ["cuda:0"])[:60]
        'RPC detected that a user-function output tensor on device c'
    """
    listed = "".join(f"{d}, " for d in devices)
    return (f"RPC detected that a user-function output tensor on device {device}. This device is not "
            f"one of the input tensor devices: {listed}which is not yet supported. Please file a "
            "feature request issue in PyTorch GitHub repo.")


class Route:
    """Where tensors go when sent to one worker in one direction.

    ``mapping`` is this worker's device map for that destination (``None``: none
    is configured), ``what`` "Request" (a call's arguments, the caller's own map) or
    "Response" (a reply, the reverse of the caller's map), ``devices`` (replies only)
    the callee's devices, which a reply tensor's device must be one of.

    Example::

        >>> r = Route(None, "worker1")
        >>> r.target(torch.device("cuda:0"))
        Traceback (most recent call last):
        SerializationError: TensorPipe RPC backend only supports CPU tensors by default, ...
    """

    __slots__ = ("mapping", "dest", "what", "devices", "cpu_target")

    def __init__(self, mapping: dict | None, dest: str, what: str = "Request",
                 devices: Iterable | None = None) -> None:
        self.mapping = dict(mapping) if mapping else None
        self.dest, self.what = dest, what
        self.devices = None if devices is None else frozenset(devices)
        # torch maps CPU tensors too when the map names "cpu" (e.g. {"cpu": "cuda:0"})
        target = self.mapping.get(_CPU) if self.mapping else None
        self.cpu_target = target if target is not None and target != _CPU else None

    def target(self, device: torch.device) -> torch.device:
        """The destination's device for a tensor on ``device`` (not the CPU);
        SerializationError with torch's text when there is none."""
        if self.mapping is None:
            raise SerializationError(no_map_message(self.what, self.dest, device))
        out = self.mapping.get(device)
        if out is None:
            raise SerializationError(no_entry_message(self.what, self.dest, device))
        if self.devices is not None and device not in self.devices:
            raise SerializationError(not_input_device_message(device, sorted(self.devices, key=str)))
        return out

    def __repr__(self) -> str:
        return f"Route({self.what} to {self.dest}: {self.mapping})"


# ---------------------------------------------------------------- streams and events

def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device`` (any accelerator type).

    Example::

        >>> current_stream(torch.device("cuda:0"))    # doctest: +SKIP
        <torch.cuda.Stream device=cuda:0 cuda_stream=0x0>
    """
    try:
        return torch.accelerator.current_stream(device)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return torch.get_device_module(device.type).current_stream(device)


_PIN: dict[str, bool] = {}   # device type -> whether pinned host memory works with it

#: bytes of device tensors staged through host memory in this process: per direction
#: ("to_host": sent, "from_host": received) and device (``rpc._get_debug_info()``)
STAGED: dict[str, dict[str, int]] = {"to_host": {}, "from_host": {}}
_STAGED_LOCK = threading.Lock()
#: set while a trace records (distgrad/trace/recorder.py): called with (direction,
#: device, stream, bytes, start_ns, end_ns) for every staged copy
ON_STAGE: Any = None


def _nbytes(t: torch.Tensor) -> int:
    if t.layout is torch.sparse_coo:
        t = t.coalesce() if not t.is_coalesced() else t
        return _nbytes(t._indices()) + _nbytes(t._values())
    return t.numel() * t.element_size()


def _count(direction: str, device: torch.device, n: int) -> None:
    key = str(device)
    with _STAGED_LOCK:
        table = STAGED[direction]
        table[key] = table.get(key, 0) + n


def _now_ns() -> int:
    import time
    return time.perf_counter_ns()   # (the trace's clock before its test skew: trace/clock.py)


def span(shape, strides) -> int:
    """Elements from a non-empty view's first element to its last, inclusive (a view
    travels as this span with its strides: :func:`to_host`, :func:`place`, the pickler).

    Example::

        >>> span((3, 4), (1, 3))
        12
    """
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _host_like(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous CPU tensor of ``t``'s shape and dtype, pinned when the
    accelerator of ``t`` offers pinned memory."""
    kind = t.device.type
    if _PIN.get(kind, True):
        try:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            _PIN[kind] = True
            return out
        except (RuntimeError, ValueError):   # no pinned-memory allocator for it
            _PIN[kind] = False
    return torch.empty(t.shape, dtype=t.dtype)


def to_host(tensors: list, moves: dict, spans: dict | None = None) -> list:
    """``tensors`` with each one on an accelerator that ``moves`` names (index ->
    (source, target)) replaced by its copy in host memory.

    Every copy is queued on the current stream of its device (after the work
    already queued there, which wrote the tensor); then, per device, the host
    waits for an event recorded after the copies. The copies are read only after
    that. The originals are not changed (autograd keeps them). A view whose index
    ``spans`` names (index -> elements from its first to its last) is copied as
    that span and keeps its strides (the wire sends the span, as for a CPU view).

    Example::

        >>> host = to_host([torch.ones(2, device="cuda:0")], {0: ("cuda:0", "cuda:1")})
        >>> host[0].device
        device(type='cpu')
    """
    out = list(tensors)
    streams: dict[torch.device, Any] = {}
    staged: dict[torch.device, int] = {}
    hook = ON_STAGE
    t0 = _now_ns() if hook is not None else 0
    for i in moves:
        t = tensors[i]
        dev = t.device
        if dev.type == "cpu":
            continue
        n = spans.get(i) if spans else None
        staged[dev] = staged.get(dev, 0) + (_nbytes(t) if n is None else n * t.element_size())
        with torch.no_grad():
            d = t.detach()
            if d.layout is torch.sparse_coo:
                host = d.to("cpu")   # a blocking copy: the host is synchronized with the stream
            else:
                src = d if n is None else d.as_strided((n,), (1,), d.storage_offset())
                host = _host_like(src)
                host.copy_(src, non_blocking=host.is_pinned())
                if n is not None:   # the view, rebuilt on its span
                    host = host.as_strided(d.shape, d.stride(), 0)
        out[i] = host
        if dev not in streams:
            streams[dev] = current_stream(dev)
    for stream in streams.values():
        stream.record_event().synchronize()
    for dev, n in staged.items():
        _count("to_host", dev, n)
        if hook is not None:
            hook("to_host", dev, streams[dev], n, t0, _now_ns())
    return out


def place(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received CPU tensor ``t`` copied onto ``device`` on the current stream there
    (no autograd history: the receiver sets its flags after).

    Example::

        >>> place(torch.ones(2), torch.device("cuda:1")).device
        device(type='cuda', index=1)
    """
    hook = ON_STAGE
    t0 = _now_ns() if hook is not None else 0
    with torch.no_grad():
        d = t.detach()
        if d.layout is torch.strided and d.numel() and not d.is_contiguous():
            # a view sent as its span: the span goes over, the view is rebuilt on it
            k = span(d.shape, d.stride())
            flat = d.as_strided((k,), (1,), d.storage_offset()).to(device, non_blocking=True)
            out = flat.as_strided(d.shape, d.stride(), 0)
            n = k * d.element_size()
        else:
            out = d.to(device, non_blocking=True)
            n = _nbytes(out)
    _count("from_host", device, n)
    if hook is not None:
        hook("from_host", device, current_stream(device), n, t0, _now_ns())
    return out


def parse_target(text: str, allowed: dict) -> torch.device | None:
    """The device a received spec names as its target: None for the CPU, else one of
    ``allowed`` (str -> device, this worker's devices); ProtocolError otherwise.

    Example::

        >>> parse_target("cuda:1", {"cuda:1": torch.device("cuda:1")})
        device(type='cuda', index=1)
    """
    if text == "cpu":
        return None
    dev = allowed.get(text)
    if dev is None:
        where = ", ".join(allowed) or "none"
        raise ProtocolError(f"a tensor sent to device {text!r}, which is not one of this worker's "
                            f"devices ({where}): no device map sends it there")
    return dev
