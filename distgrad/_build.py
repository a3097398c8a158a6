"""Which message path runs: the compiled modules, or their ``.py`` sources.

The modules of the message path (framing, the fast header, reading and sending,
pending futures, the agent's dispatch; ``COMPILED`` below) are plain Python. Where a
C compiler is present, ``pip install .`` also builds each of them with Cython and
writes ``distgrad/_compiled.json``: for each module, the SHA-256 of the source it was
built from. The ``.py`` files stay the reference; a built module is used only while
its source is unchanged, and never when ``DISTGRAD_PURE=1``.

This module installs one finder on ``sys.meta_path`` (from ``distgrad/__init__``,
before any of those modules is imported) that sends the import of a listed module to
its ``.py`` file whenever the compiled one must not run. Everywhere else the default
finders already prefer the extension module beside the source.

:func:`distgrad.info` reports which runs (:func:`message_path`). This module is on the
lowest floor (tests/test_layers.py): it names the modules of the message path but never
imports them.

Example::

    >>> import distgrad
    >>> distgrad.info()["message_path"] in ("compiled", "interpreted")
    True
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys

#: the modules of the message path that ``setup.py`` compiles where it can
COMPILED = (
    "distgrad.transport.framing",
    "distgrad.transport.auth",
    "distgrad.transport.leader",
    "distgrad.transport.reading",
    "distgrad.transport.sending",
    "distgrad.wire.fast_header",
    "distgrad.wire.messages",
    "distgrad.wire.pickler",
    "distgrad.rpc.pending",
    "distgrad.rpc.fast_path",
    "distgrad.rpc.serving",
    "distgrad.rpc.agent",
)

#: C extensions (not compiled from a .py): module -> its source, relative to the package.
#: Each is recorded in the manifest like the modules above and used only while its
#: source is unchanged; its Python reference form is chosen by the module that loads it.
NATIVE = {
    "distgrad.transport._waitc": "transport/_waitc.c",
}

MANIFEST = "_compiled.json"
#: the manifest's entry, instead of the modules, when setup.py installed the interpreted path
FALLBACK_KEY = "fallback"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _base(module: str) -> str:
    """A module of the package's path without its suffix, in this checkout or install."""
    return os.path.join(_PACKAGE_DIR, *module.split(".")[1:])


def source_path(module: str) -> str:
    """The source of a module of the package (its ``.py`` file, or the C file of one of
    :data:`NATIVE`), in this checkout or install."""
    if module in NATIVE:
        return os.path.join(_PACKAGE_DIR, *NATIVE[module].split("/"))
    return _base(module) + ".py"


def source_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _forced_pure() -> bool:
    return os.environ.get("DISTGRAD_PURE", "").strip().lower() not in ("", "0", "false", "no")


def _manifest() -> dict:
    try:
        with open(os.path.join(_PACKAGE_DIR, MANIFEST)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _extension_path(module: str) -> str | None:
    base = _base(module)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


class _Chooser:
    """Meta-path finder: a listed module whose compiled form must not run is
    imported from its source. Returns None (the default finders decide) otherwise."""

    def __init__(self) -> None:
        self.pure = _forced_pure()
        self.built = _manifest()
        self.chosen: dict[str, str] = {}   # module -> "compiled" | "interpreted" (+ why)

    def must_interpret(self, name: str) -> str | None:
        """Why ``name`` runs from its source, or None where the compiled one may run."""
        if FALLBACK_KEY in self.built:
            return "the install fell back: " + str(self.built[FALLBACK_KEY])
        if _extension_path(name) is None:
            return "not built"
        if self.pure:
            return "DISTGRAD_PURE=1"
        want = self.built.get(name)
        if want is None:
            return "not in the build's manifest"
        try:
            if source_digest(source_path(name)) != want:
                return "source changed since it was built"
        except OSError:
            return "source missing"
        return None

    def find_spec(self, name, path=None, target=None):
        if name not in COMPILED:
            return None
        why = self.must_interpret(name)
        if why is None:
            self.chosen[name] = "compiled"
            return None
        self.chosen[name] = "interpreted (" + why + ")"
        src = source_path(name)
        loader = importlib.machinery.SourceFileLoader(name, src)
        return importlib.util.spec_from_file_location(name, src, loader=loader)


_CHOOSER: _Chooser | None = None


def native_why(name: str) -> str | None:
    """Why the C extension ``name`` (one of :data:`NATIVE`) must not be loaded (the
    same rules as the compiled modules: not built, not in the manifest, built from
    another source, ``DISTGRAD_PURE=1``, the install fell back), or None.

    Example::

        >>> native_why("distgrad.transport._waitc") in (None, "not built", "DISTGRAD_PURE=1")
        True
    """
    chooser = _CHOOSER if _CHOOSER is not None else _Chooser()
    why = chooser.must_interpret(name)
    chooser.chosen[name] = "compiled" if why is None else "interpreted (" + why + ")"
    return why


def install() -> None:
    """Put the chooser first on ``sys.meta_path`` (once per process)."""
    global _CHOOSER
    if _CHOOSER is None:
        _CHOOSER = _Chooser()
        sys.meta_path.insert(0, _CHOOSER)


def _running_compiled(name: str) -> bool:
    mod = sys.modules.get(name)
    origin = getattr(getattr(mod, "__spec__", None), "origin", None) or getattr(mod, "__file__", "")
    return bool(origin) and not str(origin).endswith((".py", ".pyc"))


def message_path() -> dict:
    """The message path as this process runs it, for :func:`distgrad.info` (which
    imports the modules of ``COMPILED`` first; one not imported yet counts as not built).

    ``message_path`` is ``"compiled"`` when every listed module runs compiled,
    ``"interpreted"`` when none does, ``"mixed"`` otherwise; ``modules`` says it per
    module. ``install_fell_back`` is there too, with its reason, when setup.py could not
    compile them.

    Example::

        >>> import distgrad
        >>> set(message_path()) >= {'message_path', 'modules', 'pure_forced'}
        True
    """
    modules = {}
    for name in COMPILED:
        why = _CHOOSER.chosen.get(name, "") if _CHOOSER is not None else ""
        modules[name] = "compiled" if _running_compiled(name) else (why or "interpreted (not built)")
    kinds = {("compiled" if v == "compiled" else "interpreted") for v in modules.values()}
    path = kinds.pop() if len(kinds) == 1 else "mixed"
    out = {"message_path": path, "modules": modules, "pure_forced": _forced_pure()}
    fallback = _CHOOSER.built.get(FALLBACK_KEY) if _CHOOSER is not None else None
    if fallback:
        out["install_fell_back"] = str(fallback)
    return out
