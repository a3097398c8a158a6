"""Backend options, with torch's names so that code passing them runs unchanged."""
from __future__ import annotations

import os
from typing import Any

from ..transport.detector import DEFAULT_THRESHOLD, HEARTBEAT_DEADLINE, HEARTBEAT_INTERVAL, default_limit
from .devices import to_device, to_device_map

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


def _env_seconds(name: str, default: float) -> float:
    """A positive number from environment variable ``name``, else ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


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
    127.0.0.1), ``heartbeat_interval`` (s, default 0.5), ``heartbeat_deadline``,
    ``heartbeat_limit`` and ``heartbeat_phi`` (when a silent peer is lost: never
    before ``heartbeat_deadline`` s of silence (default 10, or
    ``$DISTGRAD_HEARTBEAT_DEADLINE``), always after ``heartbeat_limit`` s (default
    three times the deadline, or ``$DISTGRAD_HEARTBEAT_LIMIT``), in between once
    the silence is unlikely past ``heartbeat_phi`` (default 8, or
    ``$DISTGRAD_HEARTBEAT_PHI``) given the pauses seen from that peer: see
    :mod:`distgrad.transport.detector`; a peer whose process ends is lost at once),
    ``max_message_size`` (bytes per frame a peer may send, default 8 GiB, -1
    for no limit), ``secret`` (the cluster secret; default
    ``$DISTGRAD_SECRET``; all workers need the same one; see the README's
    trust model) and ``encrypt`` (AES-256-GCM encryption of every frame,
    keys derived from the secret and each connection's handshake; default ``$DISTGRAD_ENCRYPT``
    = 1/true/yes, else off; all workers must agree).

    ``device_maps`` ({callee name: {this worker's device: the callee's device}})
    and ``devices`` (this worker's accelerator devices) are torch's, for any
    accelerator type (``cuda``, ``xpu``, ``mps``, a PrivateUse1 backend): a tensor
    on a mapped device arrives on the callee's device, and a reply comes back
    through the reverse map. See :meth:`set_device_map` and
    :mod:`distgrad.rpc.devices`.

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
                 listen_addr: str | None = None, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 heartbeat_deadline: float | None = None, max_message_size: int = 1 << 33,
                 secret: str | bytes | None = None, encrypt: bool | None = None,
                 heartbeat_limit: float | None = None, heartbeat_phi: float | None = None) -> None:
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be a positive int, got {num_worker_threads!r}")
        if heartbeat_deadline is None:
            heartbeat_deadline = _env_seconds("DISTGRAD_HEARTBEAT_DEADLINE", HEARTBEAT_DEADLINE)
        if heartbeat_limit is None:
            heartbeat_limit = _env_seconds("DISTGRAD_HEARTBEAT_LIMIT",
                                           default_limit(heartbeat_deadline))
        if heartbeat_phi is None:
            heartbeat_phi = _env_seconds("DISTGRAD_HEARTBEAT_PHI", DEFAULT_THRESHOLD)
        if not 0 < heartbeat_interval < heartbeat_deadline <= heartbeat_limit:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_deadline <= heartbeat_limit, "
                             f"got {heartbeat_interval!r}, {heartbeat_deadline!r} and "
                             f"{heartbeat_limit!r}")
        if not heartbeat_phi > 0:
            raise ValueError(f"heartbeat_phi must be > 0, got {heartbeat_phi!r}")
        super().__init__(rpc_timeout, init_method)
        self.num_worker_threads = num_worker_threads
        # torch's: each map converted and checked on its own (no merging across keys)
        self.device_maps: dict[str, dict[Any, Any]] = {
            name: to_device_map(mapping) for name, mapping in (device_maps or {}).items()}
        self.devices: list = [] if devices is None else [to_device(d) for d in devices]
        self.listen_addr = listen_addr or os.environ.get("DISTGRAD_LISTEN_ADDR")
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_deadline = heartbeat_deadline
        self.heartbeat_limit = heartbeat_limit
        self.heartbeat_phi = heartbeat_phi
        self.max_message_size = max_message_size
        self.secret = secret.encode() if isinstance(secret, str) else secret
        if encrypt is None:
            encrypt = os.environ.get("DISTGRAD_ENCRYPT", "").strip().lower() in ("1", "true", "yes", "on")
        self.encrypt = bool(encrypt)

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Map this worker's devices to those of worker ``to`` (torch's): a tensor on
        a key device arrives on ``to`` on the value device, and replies come back
        through the reverse map. Called again, it adds to the map; a device mapped
        to two targets raises ValueError. Devices are ints (the accelerator's
        index), strings or torch.device, of any accelerator type.

        Example::

            >>> opts = rpc.TensorPipeRpcBackendOptions()
            >>> opts.set_device_map("worker1", {0: 1})          # my cuda:0 -> worker1's cuda:1
            >>> opts.set_device_map("worker1", {"cuda:1": "cuda:0"})
            >>> opts.device_maps["worker1"][torch.device("cuda:1")]
            device(type='cuda', index=0)
        """
        full = to_device_map(device_map)
        current = self.device_maps.get(to)
        if current is not None:
            for k, v in full.items():
                if k in current and v != current[k]:
                    raise ValueError("`set_device_map` only supports 1-to-1 mapping, trying"
                                     f" to map {k} to {v} and {current[k]}")
            current.update(full)
        else:
            self.device_maps[to] = full

    def set_devices(self, devices: list) -> None:
        """The accelerator devices this worker's RPC uses (torch's): the streams of
        these devices are synchronized for calls, and every map must stay within
        them. By default, the devices of this worker's maps and of its peers' maps
        to it.

        Example::

            >>> opts = rpc.TensorPipeRpcBackendOptions()
            >>> opts.set_devices(["cuda:0", 1])
            >>> opts.devices
            [device(type='cuda', index=0), device(type='cuda', index=1)]
        """
        self.devices = [to_device(d) for d in devices]
