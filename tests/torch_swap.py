"""Swap distgrad in for torch's RPC in this interpreter, by module patching: code
written for torch (``import torch.distributed.rpc as rpc``,
``from torch.distributed.nn import RemoteModule``, ...) then runs on distgrad
unchanged. The approach of ``../shared/conformance/distgrad_patch.py``, plus
RemoteModule; self-contained so that the suite needs nothing outside the repository.

:func:`install` (idempotent; before the code that imports torch's names):

1. imports torch's real ``torch.distributed.optim`` and ``torch.distributed.nn``
   (they bind the real rpc inside them), then distgrad's packages;
2. takes ``torch.distributed.rpc`` / ``.autograd`` and their submodules out of
   ``sys.modules``; distgrad's packages take their names, and a finder maps any
   later ``torch.distributed.rpc.X`` to ``distgrad.rpc.X`` (same for autograd);
3. makes ``torch.distributed.nn.RemoteModule``, the module
   ``torch.distributed.nn.api.remote_module`` and
   ``torch.distributed.optim.DistributedOptimizer`` distgrad's.

Importing this module with ``DISTGRAD_TORCH_SWAP=1`` in the environment installs
it (a ``sitecustomize`` does so in every process of a program, spawned children
included: see ``tests/test_torch_suites.py``).

Example::

    >>> import torch_swap; torch_swap.install()
    >>> import torch.distributed.rpc as rpc
    >>> rpc.__name__
    'distgrad.rpc'
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys

ALIASES = {"torch.distributed.rpc": "distgrad.rpc", "torch.distributed.autograd": "distgrad.autograd"}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target
        self.spec = None

    def create_module(self, spec):
        mod = importlib.import_module(self.target)  # ModuleNotFoundError names distgrad's
        self.spec = getattr(mod, "__spec__", None)
        return mod

    def exec_module(self, module):
        if self.spec is not None:  # importlib set the alias spec: distgrad's back
            module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        for torch_name, dg_name in ALIASES.items():
            if fullname == torch_name or fullname.startswith(torch_name + "."):
                return importlib.util.spec_from_loader(
                    fullname, _AliasLoader(dg_name + fullname[len(torch_name):]))
        return None


def install():
    """Swap distgrad in (idempotent)."""
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return
    import torch.distributed
    import torch.distributed.nn as real_nn  # imported with torch's rpc
    import torch.distributed.nn.api.remote_module  # noqa: F401
    import torch.distributed.optim as real_optim

    import distgrad.autograd
    import distgrad.nn.remote_module
    import distgrad.optim
    import distgrad.rpc  # noqa: F401

    for name in list(sys.modules):
        if any(name == t or name.startswith(t + ".") for t in ALIASES):
            del sys.modules[name]
    sys.meta_path.insert(0, _AliasFinder())
    for torch_name, dg_name in ALIASES.items():
        sys.modules[torch_name] = sys.modules[dg_name]
        setattr(torch.distributed, torch_name.rsplit(".", 1)[1], sys.modules[dg_name])
        for name, sub in list(sys.modules.items()):
            if name.startswith(dg_name + "."):
                sys.modules[torch_name + name[len(dg_name):]] = sub
    dg_rm = sys.modules["distgrad.nn.remote_module"]
    sys.modules["torch.distributed.nn.api.remote_module"] = dg_rm
    real_nn.api.remote_module = dg_rm
    real_nn.RemoteModule = dg_rm.RemoteModule
    real_optim.DistributedOptimizer = sys.modules["distgrad.optim"].DistributedOptimizer


if os.environ.get("DISTGRAD_TORCH_SWAP") == "1":
    install()
