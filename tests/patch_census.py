"""A census of torch's functions: which of them are torch's own in this process.

``census()`` fingerprints every function, method and class that the modules in
:data:`MODULES` hold, and every attribute of each torch class found there (type,
module, qualified name, and for Python code its file and first line), plus the
size of torch's global module-hook registries. A fingerprint taken in a process
that never imported distgrad (:func:`clean_census`, a subprocess) is the
reference: :func:`replaced` lists what differs and is not torch's own code. A
wrapper that takes the name and docstring of what it wraps still differs (its
code lies elsewhere).

This module imports nothing of distgrad.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings

MODULES = [
    "torch", "torch.autograd", "torch.autograd.function", "torch.autograd.graph",
    "torch.autograd.grad_mode", "torch.autograd.anomaly_mode", "torch.autograd.profiler",
    "torch.autograd.profiler_legacy", "torch.autograd.profiler_util", "torch.utils.checkpoint",
    "torch.utils.hooks", "torch.nn", "torch.nn.modules.module", "torch.nn.parallel",
    "torch.nn.parallel.distributed", "torch.distributed", "torch.distributed.distributed_c10d",
    "torch.distributed.rendezvous",
    "torch.futures", "torch.multiprocessing.reductions", "torch.serialization", "torch._C",
    "torch._C._autograd", "torch._C._distributed_c10d", "torch._C._distributed_rpc",
    "torch._C._distributed_autograd",
]
HOOK_REGISTRIES = "torch.nn.modules.module"  # its _global_*hooks* dicts: sizes
_TORCH_DIR = os.path.dirname(importlib.import_module("torch").__file__)


def _fingerprint(obj) -> str:
    f = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    code = getattr(f, "__code__", None)
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", "")
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{type(obj).__name__}|{getattr(f, '__module__', '')}|{name}|{where}"


def _is_code(obj) -> bool:
    return callable(obj) or isinstance(obj, (staticmethod, classmethod, property))


def census() -> dict[str, str]:
    """Fingerprints of torch's functions, keyed ``module.name`` / ``module.Class.attr``."""
    with warnings.catch_warnings():  # deprecated names warn when read
        warnings.simplefilter("ignore")
        return _census()


def _census() -> dict[str, str]:
    out: dict[str, str] = {}
    classes: dict[str, type] = {}
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, type(sys)) or not _is_code(obj):
                continue
            out[f"{modname}.{name}"] = _fingerprint(obj)
            if isinstance(obj, type) and str(getattr(obj, "__module__", "")).startswith("torch"):
                classes[f"{obj.__module__}.{obj.__qualname__}"] = obj
    for cname, cls in classes.items():
        for name, obj in list(vars(cls).items()):
            if _is_code(obj):
                out[f"{cname}.{name}"] = _fingerprint(obj)
    hooks = importlib.import_module(HOOK_REGISTRIES)
    for name, obj in vars(hooks).items():
        if name.startswith("_global_") and "hooks" in name and isinstance(obj, dict):
            out[f"{HOOK_REGISTRIES}.{name}"] = f"len={len(obj)}"
    return out


def clean_census() -> dict[str, str]:
    """:func:`census` in a fresh interpreter that never imports distgrad."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import patch_census; "
            "print(json.dumps(patch_census.census()))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=True)
    out = json.loads(res.stdout)
    assert not any("distgrad" in v for v in out.values()), "the clean process has distgrad"
    return out


def _foreign(fp: str) -> bool:
    """Whether a fingerprint is not torch's: its code lies outside torch's package, or
    (code-less) it belongs to a module outside torch; a registry's size always counts."""
    if fp.startswith("len="):
        return True
    _, module, _, where = fp.split("|", 3)
    if where:
        return not where.startswith(_TORCH_DIR)
    return not module.startswith("torch")


def replaced(clean: dict[str, str], now: dict[str, str] | None = None) -> list[str]:
    """Keys whose fingerprint differs from ``clean`` and is not torch's own now, sorted
    (torch replaces a few of its own functions when some of its modules load, e.g.
    torch._dynamo's wrappers: those are not counted)."""
    now = census() if now is None else now
    return sorted(k for k, fp in now.items() if clean.get(k) != fp and _foreign(fp))
