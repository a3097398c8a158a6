"""torch's own multi-process test classes, run with distgrad swapped in for
``torch.distributed.rpc`` and ``torch.distributed.autograd`` (and for
``torch.distributed.nn.RemoteModule`` and ``torch.distributed.optim.DistributedOptimizer``).

Not collected by the suite itself: ``tests/test_torch_suites.py`` runs
``python -m pytest tests/torch_suites.py`` in a subprocess, with the classes to
build in ``DISTGRAD_TORCH_SUITES`` (comma list, names from :data:`SUITES`).

Every worker a ``MultiProcessTestCase`` spawns unpickles its test class by
importing this module by name, so the swap (:func:`torch_swap.install`) happens in
each of them before torch's test module is imported there (as
``../shared/conformance`` does for the RPC and autograd suites; this is the same
approach, self-contained).

Each class is mixed with a fixture that passes ``rpc.TensorPipeRpcBackendOptions(init_method=...)``
(tcp rendezvous on a port from ``mp_utils.free_port``) and a spawn mixin, as torch's
``test_tensorpipe_agent.py`` does with its own fixture.

Only generated classes may be bound at module level: pytest collects every
``unittest.TestCase`` subclass in the module's namespace.
"""
import importlib
import os

import torch_swap
from mp_utils import free_port

SUITES = {
    "DdpUnderDistAutogradTest": "torch.testing._internal.distributed.ddp_under_dist_autograd_test",
    "DdpComparisonTest": "torch.testing._internal.distributed.ddp_under_dist_autograd_test",
    "RemoteModuleTest": "torch.testing._internal.distributed.nn.api.remote_module_test",
    "ThreeWorkersRemoteModuleTest": "torch.testing._internal.distributed.nn.api.remote_module_test",
}

torch_swap.install()

from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture,
)


class _Fixture(RpcAgentTestFixture):
    """What torch's TensorPipeRpcAgentTestFixture is to torch, on distgrad's public API."""

    @property
    def rpc_backend(self):
        import torch.distributed.rpc as rpc
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        import torch.distributed.rpc as rpc
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self):
        return ".*"

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


class _Spawn(MultiProcessTestCase):
    """setUp: a rendezvous port (tcp) and world_size spawned workers (torch's SpawnHelper)."""

    def setUp(self):
        super().setUp()
        os.environ["RPC_INIT_WITH_TCP"] = "1"
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())  # below the ephemeral range (mp_utils)
        self._spawn_processes()

    def tearDown(self):
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
        super().tearDown()


for _suite in [s for s in os.environ.get("DISTGRAD_TORCH_SUITES", ",".join(SUITES)).split(",") if s]:
    _cls = getattr(importlib.import_module(SUITES[_suite]), _suite)
    _generated = type("Distgrad" + _suite, (_cls, _Fixture, _Spawn), {})
    _generated.__module__ = __name__
    globals()[_generated.__name__] = _generated
del _suite, _cls, _generated
