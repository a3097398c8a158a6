"""TorchScript functions as RPC targets.

A ``torch.jit.ScriptFunction`` cannot be pickled. As torch does, a call names
it by its qualified name (``torch._jit_internal._qualified_name``, e.g.
``__torch__.mymodule.my_script_fn``) and the callee finds the function
compiled under that name: the object ``@torch.jit.script`` left in
``mymodule`` (imported if need be), else the one in the compilation unit
(``torch.jit._state._python_cu``). So, as with torch, the callee must have
compiled the function, normally by importing the module that defines it.

TorchScript's ``RRef[T]`` type is torch's C++ RRef: a compiled function
cannot accept a distgrad RRef. A call whose arguments hold an RRef therefore
runs the Python source of the script function (``_torchdynamo_inline``,
which ``torch.jit.script`` keeps on every compiled function) eagerly: same
code, same result, without TorchScript's interpreter.

Example::

    >>> @torch.jit.script
    ... def double(t: torch.Tensor) -> torch.Tensor:
    ...     return t * 2
    >>> rpc.rpc_sync("worker1", double, args=(torch.ones(2),))
    tensor([2., 2.])

Builtin operators (``torch.add``, ``math.sqrt``: what
``torch.jit._builtins._find_builtin`` names, e.g. ``aten::add``) travel as the
functions they are; the callee runs them through :func:`call`, and when the
argument parser refuses the arguments (TypeError) it asks the operator's
overload packet
(``torch.ops.aten.add``), whose refusal is torch's RPC error for a builtin
called with bad arguments: ``RuntimeError("Overloaded torch operator invoked
from Python failed to match any schema: ...")`` (torch runs builtins through
that lookup).
"""
from __future__ import annotations

import importlib
import threading
from typing import Any

import torch

_lock = threading.Lock()
_resolved: dict[str, Any] = {}


def is_script_function(func: Any) -> bool:
    return isinstance(func, torch.jit.ScriptFunction)


def qualified_name(func: Any) -> str:
    """torch's name of a script function (what the profiler keys and the callee use)."""
    return torch._jit_internal._qualified_name(func)


class ScriptFunctionRef:
    """Stands for a ScriptFunction in a call's payload; calling it on the callee
    runs the function this process compiled under the same qualified name.

    Example::

        >>> ref = ScriptFunctionRef(qualified_name(double))
        >>> ref(torch.ones(2))
        tensor([2., 2.])
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (ScriptFunctionRef, (self.name,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = resolve(self.name)
        if _holds_rref(args) or _holds_rref(tuple(kwargs.values())):
            python_fn = getattr(fn, "_torchdynamo_inline", None)
            if python_fn is not None:
                return python_fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ScriptFunctionRef({self.name})"


def resolve(name: str) -> Any:
    """The ScriptFunction compiled here under ``name``; RuntimeError when none is.

    The object ``@torch.jit.script`` left in the defining module is preferred
    (it keeps the Python source function); otherwise the compilation unit's.
    """
    fn = _resolved.get(name)
    if fn is not None:
        return fn
    with _lock:
        fn = _from_module(name) or _from_compilation_unit(name)
        if fn is None:
            raise RuntimeError(f"Unknown TorchScript function {name}: it was not compiled on this "
                               "worker (define it in a module both workers import)")
        _resolved[name] = fn
    return fn


def _from_compilation_unit(name: str) -> Any:
    try:
        return torch.jit._state._python_cu.find_function(name)
    except RuntimeError:
        return None


def _from_module(name: str) -> Any:
    """``__torch__.a.b.fn``: attribute ``fn`` of the longest importable module ``a.b``."""
    parts = name.split(".")
    if parts and parts[0] == "__torch__":
        parts = parts[1:]
    for end in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attr in parts[end:]:
            obj = getattr(obj, attr, None)
        if is_script_function(obj) and qualified_name(obj) == name:
            return obj
        return None
    return None


def _holds_rref(values: tuple) -> bool:
    from .rref import RRef
    return any(isinstance(v, RRef) for v in values)


_NO_SCHEMA = "Overloaded torch operator invoked from Python failed to match any schema"


BUILTINS: dict = {}  # id(func) -> "aten::..." once builtin_table() ran (torch's own table)


def builtin_table() -> dict:
    """torch's table of builtin operators (``id(func) -> "aten::add"``), built once:
    a hot path looks a function up with ``BUILTINS.get(id(func))``, no Python call."""
    if not BUILTINS:
        BUILTINS.update(torch.jit._builtins._get_builtin_table())
    return BUILTINS


def builtin_name(func: Any) -> str | None:
    """``aten::add`` for ``torch.add``; None for a function that is not a builtin operator."""
    return (BUILTINS or builtin_table()).get(id(func))


class BuiltinOp:
    """Stands for a builtin torch operator in a call's payload (see the module doc).

    Example::

        >>> BuiltinOp("aten::add", torch.add)(torch.ones(2), 1)
        tensor([2., 2.])
        >>> BuiltinOp("aten::add", torch.add)()
        Traceback (most recent call last):
        RuntimeError: Overloaded torch operator invoked from Python failed to match any schema: ...
    """

    __slots__ = ("name", "func")

    def __init__(self, name: str, func: Any) -> None:
        self.name, self.func = name, func

    def __reduce__(self):
        return (BuiltinOp, (self.name, self.func))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.func(*args, **kwargs)
        except TypeError as e:
            return self.retry(args, kwargs, e)

    def retry(self, args: tuple, kwargs: dict, e: TypeError) -> Any:
        """After ``func(*args, **kwargs)`` raised ``e``: torch's result or error."""
        # Only the argument parser's refusal of plain arguments, which ran
        # nothing: a tensor subclass's __torch_function__ may have run code
        if torch.overrides.has_torch_function(args + tuple(kwargs.values())):
            raise e
        packet = self._packet()
        if packet is None:
            raise e
        try:
            # torch's semantics: the operator's schemas decide. Where one matches,
            # this is the only run (the parser ran nothing), and its result is torch's
            return packet(*args, **kwargs)
        except RuntimeError as schema_error:
            if not str(schema_error).startswith(_NO_SCHEMA):
                raise e from None
            raise schema_error from e
        except Exception:  # noqa: BLE001 - any other refusal: the parser's error stands
            raise e from None

    def _packet(self) -> Any:
        ns, _, name = self.name.partition("::")
        try:
            return getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError):
            return None

    def __repr__(self) -> str:
        return f"BuiltinOp({self.name})"


def call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` as the callee of an RPC runs it: a builtin operator
    refusing its arguments raises torch's schema error (see :class:`BuiltinOp`),
    looked up only when that happens.

    Example::

        >>> call(torch.add, (torch.ones(2), 1), {})
        tensor([2., 2.])
    """
    try:
        return func(*args, **kwargs)
    except TypeError as e:
        name = builtin_name(func)
        if name is None:
            raise
        return BuiltinOp(name, func).retry(args, kwargs, e)
