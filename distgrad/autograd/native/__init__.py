"""distgrad's native share of a distributed backward pass (``dist_share.cpp``).

Built against the installed torch with :mod:`torch.utils.cpp_extension` the first
time it is needed (``python -m distgrad build-native`` does it ahead of time, as the
README's install does), cached under ``$DISTGRAD_NATIVE_CACHE`` or
``~/.cache/distgrad/native``, one build per torch version and source. Where no
compiler exists, or ``DISTGRAD_NATIVE=0`` is set, :func:`load` returns None and the
Python engine (:mod:`distgrad.autograd.share`) runs every pass.
"""
from __future__ import annotations

import hashlib
import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "dist_share.cpp")
_lock = threading.Lock()
_module = None
_tried = False
WHY_NOT: str | None = None


def _cache_dir() -> str:
    import torch
    base = os.environ.get("DISTGRAD_NATIVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "distgrad", "native")
    with open(_SOURCE, "rb") as f:
        # (the build files name the source by its path: one build per checkout)
        digest = hashlib.sha256(f.read() + torch.__version__.encode()
                                + _SOURCE.encode()).hexdigest()[:16]
    return os.path.join(base, f"torch-{torch.__version__}-{digest}")


def built() -> bool:
    """Whether a build for this torch and source is in the cache (loading it is quick)."""
    try:
        where = _cache_dir()
    except Exception:  # noqa: BLE001 - no torch, an unreadable source
        return False
    return os.path.exists(os.path.join(where, "distgrad_native.so")) or any(
        f.startswith("distgrad_native") and f.endswith((".so", ".pyd")) for f in
        (os.listdir(where) if os.path.isdir(where) else ()))


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
            from torch.utils import cpp_extension
            where = _cache_dir()
            os.makedirs(where, exist_ok=True)
            _module = cpp_extension.load(
                name="distgrad_native", sources=[_SOURCE], build_directory=where,
                extra_cflags=["-O2"], verbose=verbose)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the Python engine runs
            WHY_NOT = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            _module = None
        return _module
