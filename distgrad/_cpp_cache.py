"""Where a C++ extension built at first use lives: one build per torch version, flags
and source *contents*, whichever copy of distgrad asks for it.

The native autograd engine (:mod:`distgrad.autograd.native`) and the test
accelerator (:mod:`distgrad.testing.accel`) are built with
:mod:`torch.utils.cpp_extension` against the installed torch. A build names its
sources by path, so building them where they lie would make one build per copy of
distgrad (a checkout, ``site-packages``, a worktree): ``python -m distgrad
build-native`` run in a checkout would not serve the installed package, and each
would build on its first use. Instead the sources are copied into a directory named
by their contents, and built there, under a file lock: every copy with the same
sources shares one build.

Example::

    >>> from distgrad import _cpp_cache
    >>> where = _cpp_cache.build_dir("native", ["dist_share.cpp"], ["-O2"])  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile


def _base(kind: str) -> str:
    env = {"native": "DISTGRAD_NATIVE_CACHE", "accel": "DISTGRAD_ACCEL_CACHE"}[kind]
    return os.environ.get(env) or os.path.join(os.path.expanduser("~"), ".cache", "distgrad", kind)


def build_dir(kind: str, sources: list[str], flags: list[str]) -> str:
    """The build directory for ``sources`` (paths) with compiler ``flags``: named by the
    torch version and a digest of the flags and each source's name and contents."""
    import torch
    h = hashlib.sha256(torch.__version__.encode() + b"\0" + " ".join(flags).encode())
    for src in sources:
        with open(src, "rb") as f:
            h.update(b"\0" + os.path.basename(src).encode() + b"\0" + f.read())
    return os.path.join(_base(kind), f"torch-{torch.__version__}-{h.hexdigest()[:16]}")


@contextlib.contextmanager
def _locked(where: str):
    """One process at a time builds in ``where`` (the others wait, then find it built).
    Without ``fcntl`` (Windows) torch's own lock file in the build directory serves."""
    try:
        import fcntl
    except ImportError:   # pragma: no cover - not POSIX
        yield
        return
    with open(os.path.join(where, ".build-lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _copy_sources(where: str, sources: list[str]) -> list[str]:
    """The sources' copies in ``where/src`` (written only where missing or different,
    atomically, so that a build never sees half a file and ninja sees no change)."""
    out_dir = os.path.join(where, "src")
    os.makedirs(out_dir, exist_ok=True)
    copies = []
    for src in sources:
        dst = os.path.join(out_dir, os.path.basename(src))
        with open(src, "rb") as f:
            data = f.read()
        try:
            with open(dst, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dst)
        copies.append(dst)
    return copies


def build(kind: str, name: str, sources: list[str], flags: list[str], *,
          is_python_module: bool, verbose: bool = False):
    """Build (or find built) extension ``name`` from ``sources`` in its cache directory;
    returns what :func:`torch.utils.cpp_extension.load` returns (the module, or the
    library's path with ``is_python_module=False``), and the directory."""
    from torch.utils import cpp_extension
    where = build_dir(kind, sources, flags)
    os.makedirs(where, exist_ok=True)
    with _locked(where):
        copies = _copy_sources(where, sources)
        if not is_python_module:
            lib = os.path.join(where, f"{name}.so")
            if not os.path.exists(lib):
                cpp_extension.load(name=name, sources=copies, build_directory=where,
                                   extra_cflags=flags, is_python_module=False, verbose=verbose)
            return lib, where
        return cpp_extension.load(name=name, sources=copies, build_directory=where,
                                  extra_cflags=flags, verbose=verbose), where

