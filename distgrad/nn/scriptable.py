"""``torch.jit.script(remote_module)`` for a ``_RemoteModule`` built with ``_module_interface_cls``.

torch's scripted RemoteModule holds a C++ RRef and calls ``rpc.rpc_async`` in
TorchScript, which goes to torch's C++ agent: neither exists for distgrad. So
``torch.jit.script`` is given a twin instead (``_RemoteModule.__prepare_scriptable__``,
torch's hook, called by ``torch.jit.script`` on the module and on its submodules):
a module of a class generated once per interface, with torch's attributes
(``on``, ``device``, ``is_device_map_set``, ``is_scriptable``) and torch's
methods, compiled from source written with the interface's ``forward`` schema,
as torch's ``instantiator`` writes its template:

* ``forward(<the interface's arguments>) -> <its return type>`` and
  ``forward_async(...) -> Future[<return type>]``: each calls a
  ``@torch.jit.ignore`` function, which runs distgrad's ``rpc_async`` of the
  remote module's ``forward`` (the RRef is found from an int key the twin
  carries), so scripted code and TorchScript functions typed with the interface
  call it as they call torch's;
* ``__getstate__``/``__setstate__`` raise torch's errors: ``torch.save`` gives
  ``torch.jit.Error("... can only be pickled when using RPC")`` and, inside an
  RPC's pickling, ``RuntimeError("Passing a script RemoteModule over RPC is not
  supported. ...")``, torch's messages.

The twin's RRef is kept in :data:`_SCRIPTED` for as long as the process lives
(the scripted module's lifetime cannot be observed from Python); one entry per
``torch.jit.script`` call.

Example::

    >>> rm = _RemoteModule("worker1/cpu", make_scripted, _module_interface_cls=MyInterface)
    >>> sm = torch.jit.script(rm)
    >>> sm.forward(torch.ones(1), 2, "3")
    ('3', 2, tensor([1.]))
"""
from __future__ import annotations

import itertools
import linecache
import threading
from typing import Any

import torch
from torch import nn

import distgrad.rpc as rpc

from ..wire.pickler import current_destination

_SCRIPTED: dict[int, tuple] = {}          # key -> (module_rref, device, is_device_map_set)
_keys = itertools.count(1)
_classes: dict[type, type] = {}           # interface -> its twin class
_lock = threading.Lock()

_RPC_REFUSED = ("Passing a script RemoteModule over RPC is not supported. Please create a RemoteModule "
                "in the sender, send the `module_rref` to the receiver, and create a new instance on the "
                "receiver end by passing this `module_rref`.")

_SOURCE = '''\
def forward_async(self, {arg_types}) -> Future[{ret}]:
    return _forward_async(self._distgrad_remote_module, ({args}))


def forward(self, {arg_types}) -> {ret}:
    return _forward(self._distgrad_remote_module, ({args}))


def __getstate__(self):
    _refuse_rpc()
    raise RuntimeError(
        "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC")


def __setstate__(self, state):
    raise RuntimeError(
        "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC")


@torch.jit.ignore
def _forward_async(key: int, args: {args_type}) -> Future[{ret}]:
    return _call_async(key, args)


@torch.jit.ignore
def _forward(key: int, args: {args_type}) -> {ret}:
    return _call_async(key, args).wait()


@torch.jit.ignore
def _refuse_rpc() -> None:
    _check_rpc()
'''


def _call_async(key: int, args: tuple) -> Any:
    from .remote_module import _remote_forward
    rref, device, is_device_map_set = _SCRIPTED[key]
    return rpc.rpc_async(rref.owner(), _remote_forward, (rref, device, is_device_map_set) + tuple(args))


def _check_rpc() -> None:
    if current_destination() is not None:  # pickled for an RPC
        raise RuntimeError(_RPC_REFUSED)


def _forward_schema(interface_cls: Any) -> tuple[list[str], list[str], str]:
    """The names and TorchScript types of ``forward``'s arguments (``self`` left
    out) and its return type, from the compiled interface (as torch's instantiator
    reads them: the schema keeps no default values)."""
    qualified = torch._jit_internal._qualified_name(interface_cls)
    schema = torch.jit._state._python_cu.get_interface(qualified).getMethod("forward")
    if schema is None or len(schema.returns) != 1:
        raise ValueError(f"{interface_cls.__qualname__}.forward: expected one method with one return value")
    args = schema.arguments[1:]
    return [a.name for a in args], [str(a.type) for a in args], str(schema.returns[0].type)


def _twin_class(interface_cls: Any) -> type:
    with _lock:
        cls = _classes.get(interface_cls)
        if cls is not None:
            return cls
        names, types, ret = _forward_schema(interface_cls)
        source = _SOURCE.format(
            arg_types=", ".join(f"{n}: {t}" for n, t in zip(names, types)), ret=ret,
            args="".join(f"{n}, " for n in names),
            args_type=f"Tuple[{', '.join(types)}]" if types else "Tuple[()]")
        filename = f"<distgrad scriptable RemoteModule {len(_classes)}: {interface_cls.__qualname__}>"
        # TorchScript reads the methods' source: keep it where inspect finds it
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        # a module name of its own per interface: TorchScript names functions by it
        namespace: dict[str, Any] = {"__name__": f"{__name__}._interface{len(_classes)}"}
        exec(compile("from typing import *\nimport torch\nfrom torch import Tensor\n"
                     "from torch._jit_internal import Future\n", filename, "exec", dont_inherit=True),
             namespace)
        namespace.update(_call_async=_call_async, _check_rpc=_check_rpc)
        # dont_inherit: real annotations (this module's ``from __future__ import annotations`` would
        # make them strings, which TorchScript resolves in the wrong scope)
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # noqa: S102
        body = {name: torch.jit.export(namespace[name])
                for name in ("forward_async", "__getstate__", "__setstate__")}
        body["forward"] = namespace["forward"]
        body["__module__"] = __name__
        body["__doc__"] = f"A scriptable RemoteModule with {interface_cls.__qualname__}'s forward."
        cls = type(f"ScriptableRemoteModule_{len(_classes)}_{interface_cls.__name__}", (nn.Module,), body)
        _classes[interface_cls] = cls
        return cls


def scriptable_twin(remote_module: Any, interface_cls: Any) -> nn.Module:
    """The module ``torch.jit.script`` compiles in place of ``remote_module``."""
    twin = _twin_class(interface_cls)()
    d = remote_module.__dict__
    key = next(_keys)
    _SCRIPTED[key] = (d["module_rref"], d["device"], d["is_device_map_set"])
    twin.on, twin.device = d["on"], d["device"]
    twin.is_device_map_set, twin.is_scriptable = d["is_device_map_set"], True
    twin._distgrad_remote_module = key
    return twin
