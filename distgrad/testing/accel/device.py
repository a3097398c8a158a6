"""``torch.dgtest``: the device module of the dgtest test accelerator.

Registered by :func:`distgrad.testing.accel.load` (``torch._register_device_module``);
it mirrors the parts of ``torch.cuda`` that device code and torch itself use.
Streams and events are ``torch.Stream`` / ``torch.Event`` objects.
"""
from __future__ import annotations

import contextlib

import torch

_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1


def _ops():
    return torch.ops.dgtest


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "dgtest":
        raise ValueError(f"expected a dgtest device, got {d}")
    return current_device() if d.index is None else d.index


def is_available() -> bool:
    """Always True once loaded.

    Example::

        >>> torch.dgtest.is_available()   # doctest: +SKIP
        True
    """
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of dgtest devices (``DISTGRAD_TEST_DEVICES``, 2 by default).

    Example::

        >>> torch.dgtest.device_count()   # doctest: +SKIP
        2
    """
    return int(_ops().device_count())


def current_device() -> int:
    """This thread's current dgtest device index.

    Example::

        >>> torch.dgtest.current_device()   # doctest: +SKIP
        0
    """
    return int(_ops().current_device())


def set_device(device) -> None:
    """Set this thread's current dgtest device.

    Example::

        >>> torch.dgtest.set_device(1)   # doctest: +SKIP
    """
    _ops().set_device(_index(device))


@contextlib.contextmanager
def device(device):
    """Context manager: ``device`` is current inside the block.

    Example::

        >>> with torch.dgtest.device(1): x = torch.ones(2, device="dgtest")   # doctest: +SKIP
    """
    prev = current_device()
    set_device(device)
    try:
        yield
    finally:
        set_device(prev)


def synchronize(device=None) -> None:
    """Order the host after all work queued on the device's streams (``device="all"``:
    every device); raises a pending stream-order violation.

    Example::

        >>> torch.dgtest.synchronize()   # doctest: +SKIP
    """
    _ops().synchronize(-2 if device == "all" else _index(device))


def _stream(stream_id: int, index: int) -> torch.Stream:
    return torch.Stream(stream_id=stream_id, device_index=index, device_type=_PRIVATEUSE1)


def current_stream(device=None) -> torch.Stream:
    """This thread's current stream on ``device``.

    Example::

        >>> torch.dgtest.current_stream(0)   # doctest: +SKIP
        torch.Stream device_type=dgtest, device_index=0, stream_id=0
    """
    i = _index(device)
    return _stream(int(_ops().current_stream(i)), i)


def default_stream(device=None) -> torch.Stream:
    """The device's default stream (id 0).

    Example::

        >>> torch.dgtest.default_stream(1)   # doctest: +SKIP
    """
    return _stream(0, _index(device))


def Stream(device=None, priority: int = 0) -> torch.Stream:  # noqa: N802 - torch.cuda.Stream's spelling
    """A new stream on ``device`` (the current device by default).

    Example::

        >>> s = torch.dgtest.Stream(0)   # doctest: +SKIP
    """
    return torch.Stream(device=torch.device("dgtest", _index(device)), priority=priority)


def Event(enable_timing: bool = False, device=None) -> torch.Event:  # noqa: N802
    """An event for dgtest streams.

    Example::

        >>> e = torch.dgtest.Event(); e.record(torch.dgtest.current_stream())   # doctest: +SKIP
    """
    return torch.Event(device=torch.device("dgtest", _index(device)), enable_timing=enable_timing)


@contextlib.contextmanager
def stream(s):
    """Context manager: ``s`` is its device's current stream (and its device the
    current device) inside the block; ``None`` does nothing.

    Example::

        >>> s = torch.dgtest.Stream(0)                                     # doctest: +SKIP
        >>> with torch.dgtest.stream(s): y = x * 2                         # doctest: +SKIP
        >>> torch.dgtest.current_stream(0).wait_stream(s)                  # doctest: +SKIP
    """
    if s is None:
        yield s
        return
    if torch.device(s.device).type != "dgtest":
        raise ValueError(f"expected a dgtest stream, got one on {s.device}")
    i = s.device_index
    prev_dev = current_device()
    prev = int(_ops().exchange_stream(i, s.stream_id))
    set_device(i)
    try:
        yield s
    finally:
        _ops().exchange_stream(i, prev)
        set_device(prev_dev)


def memory_allocated(device=None) -> int:
    """Bytes of dgtest memory alive on ``device``.

    Example::

        >>> torch.dgtest.memory_allocated(0)   # doctest: +SKIP
        0
    """
    return int(_ops().memory_allocated()[_index(device)])


# random numbers come from the CPU generator (dgtest's ops run CPU kernels)
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def seed_all() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    torch.default_generator.set_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]
