"""Backend options, with torch's names so that code passing them runs unchanged."""
from __future__ import annotations

import os
from typing import Any

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_INIT_METHOD = "env://"
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # torch's: no limit


class RpcBackendOptions:
    """The options every backend has (torch's base class): ``rpc_timeout``
    (seconds, default 60; 0 means no timeout) and ``init_method``.

    Example::

        >>> rpc.RpcBackendOptions(rpc_timeout=10, init_method="env://").rpc_timeout
        10.0
    """

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        _check_timeout(rpc_timeout)
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


def _check_timeout(rpc_timeout: Any) -> None:
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
        raise TypeError("TensorPipeRpcBackendOptions(): incompatible constructor arguments: "
                        f"rpc_timeout must be a number of seconds, got {type(rpc_timeout).__name__}")
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0 (0 means no timeout), got {rpc_timeout!r}")


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Options of distgrad's backend.

    ``rpc_timeout`` (s, default 60; 0 means no timeout), ``init_method``
    (``env://``, ``tcp://host:port`` or ``file://path``), ``num_worker_threads``
    (default 16), ``listen_addr`` (address to bind; default
    ``$DISTGRAD_LISTEN_ADDR``, else the address of the interface
    ``$DISTGRAD_SOCKET_IFNAME`` (or torch's ``$TP_SOCKET_IFNAME``), else the
    local address that routes to ``MASTER_ADDR`` or the ``tcp://`` host, else
    127.0.0.1), ``heartbeat_interval``/``heartbeat_deadline`` (s),
    ``max_message_size`` (bytes per frame a peer may send, default 8 GiB, -1
    for no limit), ``secret`` (the cluster secret; default
    ``$DISTGRAD_SECRET``; all workers need the same one; see the README's
    trust model) and ``encrypt`` (AES-256-GCM encryption of every frame,
    keys derived from the secret and each connection's handshake; default ``$DISTGRAD_ENCRYPT``
    = 1/true/yes, else off; all workers must agree).

    Example::

        >>> opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:29500",
        ...                                        rpc_timeout=20)
        >>> rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)
    """

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD,
                 device_maps: dict | None = None, devices: list | None = None,
                 _transports: list | None = None, _channels: list | None = None,
                 listen_addr: str | None = None, heartbeat_interval: float = 0.5,
                 heartbeat_deadline: float = 4.0, max_message_size: int = 1 << 33,
                 secret: str | bytes | None = None, encrypt: bool | None = None) -> None:
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be a positive int, got {num_worker_threads!r}")
        if heartbeat_interval <= 0 or heartbeat_deadline <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_deadline, got "
                             f"{heartbeat_interval!r} and {heartbeat_deadline!r}")
        super().__init__(rpc_timeout, init_method)
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[Any, Any]] = {}
        self.devices: list = []
        for name, mapping in (device_maps or {}).items():
            self.set_device_map(name, mapping)
        for d in devices or []:
            _check_cpu(d, "devices")
            self.devices.append(d)
        self.listen_addr = listen_addr or os.environ.get("DISTGRAD_LISTEN_ADDR")
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_deadline = heartbeat_deadline
        self.max_message_size = max_message_size
        self.secret = secret.encode() if isinstance(secret, str) else secret
        if encrypt is None:
            encrypt = os.environ.get("DISTGRAD_ENCRYPT", "").strip().lower() in ("1", "true", "yes", "on")
        self.encrypt = bool(encrypt)

    def set_device_map(self, to: str, device_map: dict) -> None:
        """torch's device map setter; distgrad moves CPU tensors only, so only cpu->cpu."""
        for src, dst in device_map.items():
            _check_cpu(src, "device_maps")
            _check_cpu(dst, "device_maps")
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices: list) -> None:
        for d in devices:
            _check_cpu(d, "devices")
        self.devices = list(devices)


def _check_cpu(device: Any, what: str) -> None:
    import torch
    if isinstance(device, int) and not isinstance(device, bool):
        kind = "accelerator index"  # torch.device(0) means an accelerator
    else:
        try:
            kind = torch.device(device).type
        except Exception as e:  # noqa: BLE001 - malformed or unavailable device
            raise ValueError(f"{what}: invalid device {device!r}: {e}") from None
    if kind != "cpu":
        raise ValueError(f"{what}: distgrad supports CPU devices only for now, got {device!r}")

