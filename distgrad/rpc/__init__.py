"""distgrad.rpc: torch.distributed.rpc's API on distgrad's transport.

Example::

    import distgrad.rpc as rpc
    rpc.init_rpc("worker0", rank=0, world_size=2)
    print(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))
    rpc.shutdown()
"""
from ..errors import (
                      DistgradError,
                      ProtocolError,
                      RemoteError,
                      RPCTimeoutError,
                      SerializationError,
                      WorkerLostError,
)
from . import functions
from .api import (
                      _get_debug_info,
                      _rref_context_get_debug_info,
                      _set_rpc_timeout,
                      get_rpc_timeout,
                      get_worker_info,
                      init_rpc,
                      is_available,
                      remote,
                      rpc_async,
                      rpc_sync,
                      shutdown,
)
from .options import DEFAULT_RPC_TIMEOUT_SEC as _DEFAULT_RPC_TIMEOUT_SEC
from .options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions
from .rref import RRef
from .worker_info import WorkerInfo

PyRRef = RRef

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
           "WorkerInfo", "RRef", "PyRRef", "functions", "BackendType", "RpcBackendOptions",
           "TensorPipeRpcBackendOptions", "get_rpc_timeout", "is_available", "DistgradError",
           "RPCTimeoutError", "WorkerLostError", "RemoteError", "ProtocolError",
           "SerializationError", "_get_debug_info", "_rref_context_get_debug_info",
           "_set_rpc_timeout", "_DEFAULT_RPC_TIMEOUT_SEC"]
