"""distgrad's native share of a distributed backward pass (``dist_share.cpp``).

Built against the installed torch with :mod:`torch.utils.cpp_extension` the first
time it is needed (``python -m distgrad build-native`` does it ahead of time, as the
README's install does), cached under ``$DISTGRAD_NATIVE_CACHE`` or
``~/.cache/distgrad/native``, one build per torch version and source contents, shared
by every copy of distgrad (:mod:`distgrad._cpp_cache`). Where no
compiler exists, or ``DISTGRAD_NATIVE=0`` is set, :func:`load` returns None and the
Python engine (:mod:`distgrad.autograd.share`) runs every pass.
"""
from __future__ import annotations

import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "dist_share.cpp")
_lock = threading.Lock()
_module = None
_tried = False
WHY_NOT: str | None = None
_FLAGS = ["-O2"]


def _cache_dir() -> str:
    from ... import _cpp_cache
    return _cpp_cache.build_dir("native", [_SOURCE], _FLAGS)


def built() -> bool:
    """Whether a build for this torch and source is in the cache (loading it is quick)."""
    try:
        where = _cache_dir()
    except Exception:  # noqa: BLE001 - no torch, an unreadable source
        return False
    return os.path.isdir(where) and any(
        f.startswith("distgrad_native") and f.endswith((".so", ".pyd")) for f in os.listdir(where))


def wanted() -> bool:
    """Whether the native engine may be used (``DISTGRAD_NATIVE=0`` turns it off)."""
    return os.environ.get("DISTGRAD_NATIVE", "1").strip() not in ("0", "")


def load(build: bool = True, verbose: bool = False):
    """The compiled module, building it if needed (``build``); None where it cannot be
    had (``WHY_NOT`` says why).

    Example::

        >>> from distgrad.autograd import native
        >>> mod = native.load()   # doctest: +SKIP
    """
    global _module, _tried, WHY_NOT
    if _module is not None or (_tried and not build):
        return _module
    if not build and not built():
        return None
    with _lock:
        if _module is not None:
            return _module
        if not wanted():
            WHY_NOT = "DISTGRAD_NATIVE=0"
            return None
        _tried = True
        try:
            from ... import _cpp_cache
            _module, _ = _cpp_cache.build("native", "distgrad_native", [_SOURCE], _FLAGS,
                                          is_python_module=True, verbose=verbose)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the Python engine runs
            WHY_NOT = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            _module = None
        return _module
