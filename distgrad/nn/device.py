"""Remote device strings ("<workername>/<device>", "rank:<rank>/<device>") and
the owner-side check of the device, for :class:`~distgrad.nn.RemoteModule`."""
from __future__ import annotations

import torch

from ..errors import DistgradError


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """``(worker name or rank, device string)`` for a RemoteModule's ``remote_device``.

    A missing device means ``"cpu"``. Malformed strings raise ValueError
    ("Could not parse remote_device: ..."), bad devices torch.device's RuntimeError,
    a bare local device ("cpu", "cuda:0") ValueError since it names no worker.

    Example::

        >>> parse_remote_device("ps/cuda:0"), parse_remote_device("rank:1")
        (('ps', 'cuda:0'), (1, 'cpu'))
    """
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    error = (f"Could not parse remote_device: {remote_device}. The valid format is "
             "'<workername>/<device>' or 'rank:<rank>/<device>'")
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1 and not _is_device(fields[0]):
        worker, device = fields[0], "cpu"
    elif len(fields) == 1:
        raise ValueError(f"remote_device {remote_device!r} is a device but names no worker: "
                         "use '<workername>/<device>' or 'rank:<rank>/<device>'")
    else:
        raise ValueError(error)
    if not worker:
        raise ValueError(error)
    device = str(torch.device(device))  # torch's own errors for a bad device string
    parts = worker.split(":")
    if len(parts) == 1:
        return worker, device
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1]), device
    raise ValueError(error)


def check_device(device: str) -> None:
    """On the owner: fail with a clear error if ``device`` does not exist here
    (any accelerator type: ``cuda``, ``xpu``, ``mps``, a PrivateUse1 backend).

    Example::

        >>> check_device("cpu")        # fine anywhere
        >>> check_device("cuda:0")     # DistgradError on a worker without CUDA
    """
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return
    import distgrad.rpc as rpc
    me = rpc.get_worker_info().name
    try:
        mod = torch.get_device_module(dev.type)
        available, count = bool(mod.is_available()), int(mod.device_count())
    except Exception:  # noqa: BLE001 - no device module for that type here
        available, count = False, 0
    if not available:
        name = "CUDA" if dev.type == "cuda" else dev.type
        raise DistgradError(f"RemoteModule: device {device!r} requested on worker {me}, but {name} is not "
                            f"available there (torch.{dev.type}.is_available() is False); use "
                            f"'{me}/cpu'", me)
    if dev.index is not None and dev.index >= count:
        what = "CUDA error: invalid device ordinal" if dev.type == "cuda" else \
            f"{dev.type}: invalid device index"
        raise DistgradError(f"{what}: RemoteModule device {device!r} requested on worker {me}, which has "
                            f"{count} {dev.type.upper() if dev.type == 'cuda' else dev.type} device(s)", me)
