"""RemoteModule: an ``nn.Module`` that lives on another worker, called through RPC.

The same API as ``torch.distributed.nn.api.remote_module.RemoteModule``, built
on distgrad's public RPC calls (``rpc.remote`` creates the module,
``rpc_sync``/``rpc_async`` run its ``forward`` with the module's RRef as an
argument; the only internal used is the wire's ``current_destination``, which
tells pickling inside an RPC from plain pickling, as RRefs do). Every call is an ordinary RPC, so inside
``distgrad.autograd.context()`` it records send/recv functions and a
distributed backward reaches the remote module's parameters; those parameters'
RRefs (:meth:`RemoteModule.remote_parameters`) go to
``distgrad.optim.DistributedOptimizer``.

As in torch:

* ``forward`` and ``forward_async`` are the instance's ``generated_methods``:
  ``(*args, **kwargs)`` for a plain module; with
  ``_module_interface_cls`` (a ``@torch.jit.interface`` class) they take the
  interface's ``forward`` signature (arguments are bound and defaults filled
  in here, so a wrong call fails before anything is sent) and the remote module
  is ``torch.jit.script``-ed. The remote side calls ``module.forward`` (not
  ``module(...)``), so the remote module's own hooks do not run.
* Most ``nn.Module`` methods raise ``ValueError("Method ``<name>`` not supported
  for RemoteModule")``; ``train()``/``eval()`` set the mode on the remote module.
* Errors in creating the module surface at the first call that needs it
  (``forward``, ``remote_parameters``), since creation is asynchronous.
* Pickled by plain ``pickle`` (``torch.save``) it raises; inside an RPC it
  travels as its few attributes plus the module's RRef (a new fork), and the
  receiver can call ``forward`` on it.
* On a device (any accelerator type: ``"worker1/cuda:0"``, ``"worker1/xpu:1"``,
  a PrivateUse1 backend's ``"worker1/dgtest:1"``) the inputs are moved to the
  device; the outputs come back on the device when this worker has a device map
  to the owner (``is_device_map_set``: they travel through its reverse map),
  else they are moved to the CPU there.

Differences: ``forward``/``forward_async`` in the instance's ``__dict__`` are
bound to a weak proxy of it (no reference cycle, so a dropped RemoteModule
releases its RRef at once; ``rm.forward`` itself is bound to ``rm``);
``train()``/``eval()`` return the RemoteModule itself (torch returns a copy of
the remote module, fetched over RPC); ``repr()`` names the worker and device
(torch's raises, since ``extra_repr`` does); calling a received or
:meth:`~RemoteModule.init_from_module_rref` instance as ``rm(x)`` runs
``rm.forward(x)`` (those instances have no ``nn.Module`` state, so torch's
``__call__`` fails on them); a CUDA device on a worker without CUDA (or an
ordinal it lacks) fails with a :class:`~distgrad.errors.DistgradError` naming
the worker and device. ``torch.jit.script(remote_module)`` (with
``_module_interface_cls``) compiles a twin with torch's attributes and typed
methods that call distgrad's RPC (:mod:`.scriptable`).

Example (two processes)::

    # worker0
    import torch, distgrad.rpc as rpc
    from distgrad.nn import RemoteModule
    rpc.init_rpc("worker0", rank=0, world_size=2)
    lin = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
    out = lin.forward(torch.randn(128, 20))            # runs on worker1
    fut = lin.forward_async(torch.randn(128, 20))      # a torch Future
    rpc.shutdown()

    # worker1
    rpc.init_rpc("worker1", rank=1, world_size=2)
    rpc.shutdown()
"""
from __future__ import annotations

import inspect
import threading
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

import distgrad.rpc as rpc

from ..errors import DistgradError
from ..wire.pickler import current_destination
from .device import check_device, parse_remote_device

__all__ = ["RemoteModule"]

# The attributes a RemoteModule carries over RPC (torch's names and order).
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on", "device", "is_device_map_set", "is_scriptable", "generated_methods", "module_rref")

# nn.Module's own state and the installed methods: never pickled.
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = (
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_backward_hooks",
    "_backward_pre_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_modules",
    "forward_async", "forward")

# torch raises ValueError for these nn.Module methods on a RemoteModule.
_UNSUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu", "cpu",
    "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_forward_pre_hook", "register_forward_hook", "state_dict", "load_state_dict",
    "named_parameters", "buffers", "named_buffers", "children", "named_children", "modules",
    "named_modules", "requires_grad_", "zero_grad", "share_memory", "extra_repr")


# ---------------------------------------------------------------------------
# run on the owner (module-level: pickled by reference)
# ---------------------------------------------------------------------------
def _create_module(module_cls, args, kwargs, device):
    check_device(device)
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
                         f"but it returns an instance of {type(module)}.")
    module.to(device)
    return module


def _create_script_module(module_cls, args, kwargs, device):
    module = _create_module(module_cls, args, kwargs, device)
    return module if isinstance(module, torch.jit.ScriptModule) else torch.jit.script(module)


def _param_rrefs(module_rref, recurse):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref, mode):
    module_rref.local_value().train(mode)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (tuple, list)):
        moved = [_to_cpu(v) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    return value


def _remote_forward(module_rref, device, is_device_map_set, *args, **kwargs):
    module = module_rref.local_value()
    dev = torch.device(device)
    if dev.type == "cpu":
        return module.forward(*args, **kwargs)
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = module.forward(*args, **kwargs)
    return out if is_device_map_set else _to_cpu(out)


# ---------------------------------------------------------------------------
# the generated methods
# ---------------------------------------------------------------------------
def forward_async(self, *args, **kwargs):
    """Run the remote module's ``forward(*args, **kwargs)``; returns a ``torch.futures.Future``."""
    return rpc.rpc_async(self.module_rref.owner(), _remote_forward,
                         (self.module_rref, self.device, self.is_device_map_set) + args, kwargs)


def forward(self, *args, **kwargs):
    """Run the remote module's ``forward(*args, **kwargs)`` and return its result."""
    return rpc.rpc_sync(self.module_rref.owner(), _remote_forward,
                        (self.module_rref, self.device, self.is_device_map_set) + args, kwargs)


_PLAIN_METHODS = [forward_async, forward]
_interface_methods_cache: dict[type, list] = {}
_interface_lock = threading.Lock()


def _methods_for(interface_cls) -> list:
    """The generated methods: the plain pair, or a pair with ``interface_cls.forward``'s signature."""
    if interface_cls is None:
        return _PLAIN_METHODS
    if not getattr(interface_cls, "__torch_script_interface__", False):
        raise ValueError(f"module_interface_cls {interface_cls} must be a type object decorated by "
                         "@torch.jit.interface")
    with _interface_lock:
        methods = _interface_methods_cache.get(interface_cls)
        if methods is None:
            methods = _interface_methods_cache[interface_cls] = _typed_methods(interface_cls)
        return methods


def _typed_methods(interface_cls) -> list:
    fwd = getattr(interface_cls, "forward", None)
    if not callable(fwd):
        raise ValueError(f"module_interface_cls {interface_cls.__qualname__} has no forward method")
    sig = inspect.signature(fwd)

    def _bind(self, args, kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return bound.args[1:], bound.kwargs

    def typed_forward_async(self, *args, **kwargs):
        args, kwargs = _bind(self, args, kwargs)
        return forward_async(self, *args, **kwargs)

    def typed_forward(self, *args, **kwargs):
        args, kwargs = _bind(self, args, kwargs)
        return forward(self, *args, **kwargs)

    out = []
    for fn, name in ((typed_forward_async, "forward_async"), (typed_forward, "forward")):
        fn.__name__ = fn.__qualname__ = name
        fn.__signature__ = sig
        fn.__doc__ = f"``{interface_cls.__qualname__}.forward`` run on the remote module" + (
            " (returns a Future)." if name == "forward_async" else ".")
        fn._module_interface_cls = interface_cls  # what travels over RPC instead of the function
        out.append(fn)
    return out


class _GeneratedMethod:
    """``forward``/``forward_async`` of a RemoteModule: the instance's generated method of
    that name. As in torch, the instance's ``__dict__`` holds them as bound methods
    (set by :func:`_install_methods`, on the instance that was built, received over
    RPC or made by ``init_from_module_rref``), so code that inspects or copies
    ``__dict__`` finds them. Those are bound to a weak proxy of the instance (no
    reference cycle: a dropped RemoteModule, and its RRef fork, goes at once, not at
    the next garbage collection); reading the attribute gives a method bound to the
    instance itself (this is a data descriptor, so it comes before ``__dict__``)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.__doc__ = doc

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        for method in obj.__dict__.get("generated_methods", ()):
            if method.__name__ == self.name:
                return types.MethodType(method, obj)
        raise AttributeError(f"RemoteModule has no generated ``{self.name}``")

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value


def _install_methods(m) -> None:
    """Put the generated methods into ``m.__dict__``, as torch's RemoteModule does."""
    me = weakref.proxy(m)
    for method in m.__dict__["generated_methods"]:
        m.__dict__[method.__name__] = types.MethodType(method, me)


def _raise_not_supported(name: str):
    def method(self, *args, **kwargs):
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")
    method.__name__ = name
    method.__qualname__ = f"_RemoteModule.{name}"
    method.__doc__ = "Not supported on a RemoteModule: raises ValueError (as torch does)."
    return method


# ---------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------
class _RemoteModule(nn.Module):
    """A module created on another worker; see :class:`RemoteModule`.

    This base class also takes ``_module_interface_cls``, torch's experimental
    argument: a ``@torch.jit.interface`` class whose ``forward`` signature the
    generated ``forward``/``forward_async`` take; the remote module is then
    ``torch.jit.script``-ed and ``is_scriptable`` is True.

    Example::

        >>> m = _RemoteModule("worker1", MyModule, args=(1,), _module_interface_cls=MyInterface)
        >>> m.forward(torch.ones(1), 2)        # the interface's defaults fill in the rest
    """

    def __init__(self, remote_device: str, module_cls: type[nn.Module], args: tuple | None = None,
                 kwargs: dict[str, Any] | None = None, _module_interface_cls: Any = None) -> None:
        super().__init__()
        self._prepare_init(remote_device)
        args = tuple(args) if args is not None else ()
        kwargs = dict(kwargs) if kwargs is not None else {}
        self.is_scriptable = _module_interface_cls is not None
        self.generated_methods = _methods_for(_module_interface_cls)
        create = _create_script_module if self.is_scriptable else _create_module
        self.module_rref = rpc.remote(self.on, create, (module_cls, args, kwargs, self.device))
        _install_methods(self)
        self._check_attribute_picklability()

    forward = _GeneratedMethod("forward", "``forward(*args, **kwargs)`` of the remote module, run "
                               "there (blocking); returns its result.")
    forward_async = _GeneratedMethod("forward_async", "``forward(*args, **kwargs)`` of the remote "
                                     "module, run there; returns a ``torch.futures.Future``.")

    # -- torch's public methods --------------------------------------------------
    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs to the remote module's parameters (for ``DistributedOptimizer``).

        ``recurse=False`` gives only the parameters that are direct members of the module.

        Example::

            >>> opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.05)
        """
        return rpc.rpc_sync(self.module_rref.owner(), _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        """The RRef (``RRef[nn.Module]``) of the remote module.

        Example::

            >>> rm.get_module_rref().to_here()     # a copy of the module, fetched
        """
        return self.module_rref

    def train(self, mode: bool = True) -> _RemoteModule:
        """Set the remote module's training mode (one ``rpc_sync``); returns ``self``.

        Example::

            >>> rm.train(False)    # the module on the owner is now in eval mode
        """
        rpc.rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, bool(mode)))
        object.__setattr__(self, "training", bool(mode))
        return self

    def eval(self) -> _RemoteModule:
        """``train(False)``.

        Example::

            >>> rm.eval()
        """
        return self.train(False)

    def parameters(self, recurse: bool = True):
        """Not supported: use :meth:`remote_parameters` (raises ValueError, as torch does)."""
        raise ValueError("Method ``parameters`` not supported for RemoteModule. "
                         "Please use ``remote_parameters`` instead.")

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule over an existing module RRef (no new module is created).

        Several RemoteModules can share one remote module this way. ``remote_device``
        names the owner of ``module_rref`` ("<workername>/<device>" or
        "rank:<rank>/<device>"); calls always go to the RRef's owner.

        Example::

            >>> rm2 = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
            >>> rm2.forward(x)     # the same module as rm's
        """
        remote_module = object.__new__(RemoteModule)
        remote_module._prepare_init(remote_device)
        remote_module.is_scriptable = _module_interface_cls is not None
        remote_module.generated_methods = _methods_for(_module_interface_cls)
        remote_module.module_rref = module_rref
        _install_methods(remote_module)
        remote_module._check_attribute_picklability()
        return remote_module

    # -- TorchScript ----------------------------------------------------------------
    def __prepare_scriptable__(self):
        """What ``torch.jit.script`` compiles for this module (torch's hook): with
        ``_module_interface_cls``, a twin with torch's attributes and typed
        ``forward``/``forward_async`` (:mod:`.scriptable`); otherwise the module
        itself, which does not compile (its methods take ``*args``), as in torch."""
        methods = self.__dict__.get("generated_methods") or [None]
        interface_cls = getattr(methods[0], "_module_interface_cls", None)
        if interface_cls is None:
            return self
        from .scriptable import scriptable_twin
        return scriptable_twin(self, interface_cls)

    # -- calling and printing --------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if "_parameters" not in self.__dict__:  # received over RPC / init_from_module_rref
            return self.forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __repr__(self) -> str:
        d = self.__dict__
        return f"{type(self).__name__}(on={d.get('on')!r}, device={d.get('device')!r})"

    # -- pickling -------------------------------------------------------------------
    def __getstate__(self):
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
                           "pickled when using RPC")

    def __setstate__(self, state):
        raise RuntimeError("Cannot unpickle RemoteModule in python pickler. RemoteModule can only be "
                           "unpickled when using RPC")

    def __reduce_ex__(self, protocol):
        if current_destination() is None:  # not inside an RPC's pickling
            self.__getstate__()
        attrs = {}
        for k, v in self.__dict__.items():
            if k == "generated_methods":
                attrs[k] = getattr(v[0], "_module_interface_cls", None)
            elif k in _REMOTE_MODULE_PICKLED_ATTRIBUTES:
                attrs[k] = v
            elif k not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING:
                warnings.warn(f"The attribute ``{k}`` of RemoteModule is not sent over RPC: only "
                              f"{', '.join(_REMOTE_MODULE_PICKLED_ATTRIBUTES)} are", stacklevel=2)
        return (_remote_module_receiver, (type(self), attrs))

    # -- internals --------------------------------------------------------------------
    def _prepare_init(self, remote_device: str) -> None:
        if not rpc._is_current_rpc_agent_set():
            raise DistgradError("RemoteModule only works in RPC: call distgrad.rpc.init_rpc first")
        self.on, self.device = parse_remote_device(remote_device)
        # as torch: a device map to the owner brings the outputs back on the device
        agent = rpc.api._get_current_rpc_agent()
        try:
            owner = agent.get_worker_info(self.on)
        except Exception:  # noqa: BLE001 - an unknown worker: rpc.remote says so next
            owner = None
        self.is_device_map_set = bool(owner is not None and agent._get_device_map(owner))

    def _check_attribute_picklability(self) -> None:
        known = _REMOTE_MODULE_PICKLED_ATTRIBUTES + _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
        for k in self.__dict__:
            if k not in known:
                raise AttributeError(f"Attribute {k} must be either in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` "
                                     "or ``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``.")


for _name in _UNSUPPORTED:
    setattr(_RemoteModule, _name, _raise_not_supported(_name))
del _name


class RemoteModule(_RemoteModule):
    """An ``nn.Module`` created on another worker; ``forward`` runs there through RPC.

    ``RemoteModule(remote_device, module_cls, args=None, kwargs=None)`` builds
    ``module_cls(*args, **kwargs)`` on the worker that ``remote_device`` names and
    moves it to that worker's device:

    * ``"<workername>/<device>"``, e.g. ``"ps/cpu"``, ``"trainer0/cuda:0"``;
    * ``"rank:<rank>/<device>"``, e.g. ``"rank:1/cpu"``;
    * ``"<workername>"`` or ``"rank:<rank>"`` alone: the device is ``"cpu"``.

    RPC must be initialized. The instance gets ``forward(*args, **kwargs)``
    (blocking) and ``forward_async(*args, **kwargs)`` (a ``torch.futures.Future``),
    both running the remote module's ``forward``; inside
    ``distgrad.autograd.context()`` the call is recorded, so ``backward`` reaches
    the remote parameters. Local modules should sit beside it in a hybrid model,
    not inside it (``add_module`` and most ``nn.Module`` methods raise ValueError).

    Example::

        >>> import distgrad.autograd as dist_autograd
        >>> from distgrad.optim import DistributedOptimizer
        >>> emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
        >>> opt = DistributedOptimizer(torch.optim.SGD, emb.remote_parameters(), lr=0.05)
        >>> with dist_autograd.context() as cid:
        ...     loss = emb(indices, offsets).sum()
        ...     dist_autograd.backward(cid, [loss])
        ...     opt.step(cid)
    """

    def __init__(self, remote_device: str, module_cls: type[nn.Module], args: tuple | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


def _remote_module_receiver(cls, attrs: dict):
    """Rebuild a RemoteModule sent over RPC (the RRef arrived as a new fork)."""
    m = object.__new__(cls)
    for k in _REMOTE_MODULE_PICKLED_ATTRIBUTES:
        value = attrs[k]
        object.__setattr__(m, k, _methods_for(value) if k == "generated_methods" else value)
    _install_methods(m)
    return m
