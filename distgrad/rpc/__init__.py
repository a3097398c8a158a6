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
from . import api, backend_registry, constants, functions, internal
from .agent import RpcAgent
from .api import (
                      _delete_all_user_and_unforked_owner_rrefs,
                      _get_current_rpc_agent,
                      _init_rpc_backend,
                      _is_current_rpc_agent_set,
                      _set_rpc_timeout,
                      get_rpc_timeout,
                      get_worker_info,
                      init_rpc,
                      is_available,
                      membership_events,
                      remote,
                      rpc_async,
                      rpc_sync,
                      shutdown,
)
from .backend_registry import BackendType
from .debug import _get_debug_info, _rref_context_get_debug_info, enable_gil_profiling
from .options import DEFAULT_RPC_TIMEOUT_SEC as _DEFAULT_RPC_TIMEOUT_SEC
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions
from .profiling import _server_process_global_profile
from .rref import RRef
from .worker_info import WorkerInfo

PyRRef = RRef
TensorPipeAgent = RpcAgent  # torch's name of the agent class

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info", "membership_events",
           "WorkerInfo", "RRef", "PyRRef", "functions", "BackendType", "RpcBackendOptions",
           "TensorPipeRpcBackendOptions", "TensorPipeAgent", "get_rpc_timeout", "is_available",
           "enable_gil_profiling", "DistgradError", "RPCTimeoutError", "WorkerLostError", "RemoteError",
           "ProtocolError", "SerializationError", "api", "backend_registry", "constants", "internal",
           "_get_debug_info", "_rref_context_get_debug_info", "_set_rpc_timeout",
           "_DEFAULT_RPC_TIMEOUT_SEC", "_get_current_rpc_agent", "_is_current_rpc_agent_set",
           "_init_rpc_backend", "_delete_all_user_and_unforked_owner_rrefs",
           "_server_process_global_profile"]
