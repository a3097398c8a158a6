"""Build of distgrad: the package, plus its message path compiled where it can be.

Everything is declared in ``pyproject.toml``; this file adds only the optional
extension modules. The modules listed in ``distgrad/_build.py`` (``COMPILED``) are
compiled with Cython from their own ``.py`` sources; on Linux the C extensions of
``NATIVE`` (the native wait, ``transport/_waitc.c``) are built with them. When that
is not possible (no Cython, no working C compiler, a compiler error) the install
goes on with the interpreted modules and says so in one line. ``distgrad/_compiled.json`` records
the SHA-256 of each source a module was built from: a module whose source changed
since runs from its source (see ``distgrad/_build.py``).

The built modules are also copied beside their sources in this checkout, so that
``python -m pytest`` run from here (which imports the checkout, not the installed
copy) runs the same compiled path.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "distgrad"))
try:
    import _build as _plan  # distgrad/_build.py, read without importing distgrad (torch)
finally:
    sys.path.pop(0)

FALLBACK = "distgrad: installing the interpreted message path: {}"
DIRECTIVES = {
    "language_level": 3,
    "binding": True,             # functions keep __name__, __doc__, signature: introspection as in Python
    "annotation_typing": False,  # annotations stay hints: typed C conversions would change behaviour
    "embedsignature": True,
}


def _say(msg: str) -> None:
    # pip shows a build backend's output only with -v (or on failure): the line is also
    # kept in the manifest, and ``python -m distgrad --version`` repeats it after any install
    print(msg, flush=True)
    print(msg, file=sys.stderr, flush=True)


def _write_manifest(manifest: dict, *dirs: str) -> None:
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, _plan.MANIFEST), "w") as f:
            f.write(text)


def _fall_back(why: str, *dirs: str) -> None:
    """Say why the interpreted path is installed, and record it (no module listed:
    the chooser runs every source, even beside modules built earlier)."""
    _say(FALLBACK.format(why))
    _write_manifest({_plan.FALLBACK_KEY: why}, os.path.join(HERE, "distgrad"), *dirs)


def _extensions():
    if os.environ.get("DISTGRAD_NO_COMPILE", "").strip() not in ("", "0"):
        _fall_back("DISTGRAD_NO_COMPILE is set")
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError as exc:
        _fall_back(f"Cython is not available ({exc})")
        return []
    exts = []
    for name in _plan.COMPILED:
        src = os.path.relpath(_plan.source_path(name), HERE).replace(os.sep, "/")
        exts.append(Extension(name, [src], extra_compile_args=["-O2"] if os.name != "nt" else []))
    try:
        exts = cythonize(exts, compiler_directives=DIRECTIVES, quiet=True,
                         nthreads=os.cpu_count() or 1)
    except Exception as exc:   # a Cython failure must not stop the install
        _fall_back(f"Cython could not translate the message path ({_first_line(exc)})")
        return []
    if sys.platform.startswith("linux"):   # the native wait (epoll, /proc, /dev/shm)
        for name in _plan.NATIVE:
            src = os.path.relpath(_plan.source_path(name), HERE).replace(os.sep, "/")
            if os.path.exists(os.path.join(HERE, src)):
                exts.append(Extension(name, [src], extra_compile_args=["-O2"]))
    return exts


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the interpreted modules on any failure."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self):
        if not self.extensions:
            return
        try:
            super().run()
        except Exception as exc:   # no compiler, or it failed: the .py files serve
            self._discard()
            _fall_back(f"the C compiler failed ({_first_line(exc)})",
                       os.path.join(self.build_lib, "distgrad"))
            return
        self._publish()

    def _discard(self):
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                os.remove(path)

    def _publish(self):
        manifest = {ext.name: _plan.source_digest(_plan.source_path(ext.name))
                    for ext in self.extensions}
        if self.inplace:
            targets = []
        else:   # and beside the sources of this checkout, for tests run from it
            targets = [(self.get_ext_fullpath(ext.name),
                        os.path.join(HERE, self.get_ext_filename(ext.name))) for ext in self.extensions]
        for built, there in targets:
            if os.path.abspath(built) != os.path.abspath(there):
                shutil.copyfile(built, there + ".tmp")
                os.replace(there + ".tmp", there)
        _write_manifest(manifest, os.path.join(self.build_lib, "distgrad"), os.path.join(HERE, "distgrad"))
        _say(f"distgrad: compiled message path ({len(self.extensions)} modules)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
