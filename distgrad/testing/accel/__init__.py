"""``dgtest``: a test accelerator for machines without a GPU.

A PrivateUse1 backend (``accel.cpp``) built against the installed torch with
:mod:`torch.utils.cpp_extension` the first time :func:`load` runs, cached under
``$DISTGRAD_ACCEL_CACHE`` or ``~/.cache/distgrad/accel`` (one build per torch
version and source contents, shared by every copy of distgrad: :mod:`distgrad._cpp_cache`).
Its devices are ``dgtest:0`` .. ``dgtest:N-1`` (N = 2, or
``DISTGRAD_TEST_DEVICES`` = 2..8, read before the first load). Memory is host
memory; every op runs torch's CPU kernel in place on it; streams, events and
``torch.futures.Future(devices=...)`` work through a device guard.

Because the device runs everything synchronously, a missing stream synchronization
would never give a wrong number. The **stream-order checker** (on by default) makes
it an error instead: ``RuntimeError("stream-order violation: ...")`` naming the op,
device, streams and logical times. A free that races a stream (no ``record_stream``)
is found in the deleter, which cannot raise: it raises at the next dgtest op,
synchronize or :func:`check`.

Call :func:`load` before the process's first backward pass: torch's autograd engine
sizes its device threads once, at its first use.

Where no compiler is found :func:`load` raises and ``WHY_NOT`` says why;
:func:`available` answers without raising.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, "accel.cpp")]
_NAME = "distgrad_accel"
BACKEND = "dgtest"
_lock = threading.Lock()
_loaded = False
WHY_NOT: str | None = None
#: set when autograd cannot reach dgtest in this process (the engine started before load)
AUTOGRAD_WHY_NOT: str | None = None


_FLAGS = ["-O1"]


def _cache_dir() -> str:
    from ... import _cpp_cache
    return _cpp_cache.build_dir("accel", _SOURCES, _FLAGS)


def _library(where: str) -> str:
    return os.path.join(where, f"{_NAME}.so")


def built() -> bool:
    """Whether a build for this torch and source is in the cache (loading it is quick)."""
    try:
        return os.path.exists(_library(_cache_dir()))
    except Exception:  # noqa: BLE001 - no torch, an unreadable source
        return False


def _device_count_from_env() -> int:
    raw = os.environ.get("DISTGRAD_TEST_DEVICES", "").strip()
    if not raw:
        return 2
    if not raw.isdigit() or not 2 <= int(raw) <= 8:
        raise ValueError(f"DISTGRAD_TEST_DEVICES={raw!r}: expected a number from 2 to 8")
    return int(raw)


def _build(verbose: bool) -> str:
    """The shared library's path, building it under a file lock if it is not cached."""
    from ... import _cpp_cache
    lib, _ = _cpp_cache.build("accel", _NAME, _SOURCES, _FLAGS, is_python_module=False, verbose=verbose)
    return lib


def load(verbose: bool = False) -> str:
    """Build (first time) and load the ``dgtest`` backend; returns ``"dgtest"``.

    Renames PrivateUse1 to ``dgtest``, adds ``Tensor.dgtest()`` / ``Tensor.is_dgtest``
    (and the module and storage methods) and registers ``torch.dgtest`` (see
    :mod:`distgrad.testing.accel.device`). Idempotent, thread-safe; each process
    (spawned workers too) calls it for itself.

    Example::

        >>> from distgrad.testing import accel
        >>> dev = accel.load()                  # doctest: +SKIP
        >>> x = torch.ones(3, device=f"{dev}:1")  # doctest: +SKIP
        >>> (x * 2).sum().item()                # doctest: +SKIP
        6.0
    """
    global _loaded, WHY_NOT
    if _loaded:
        return BACKEND
    with _lock:
        if _loaded:
            return BACKEND
        import torch
        _device_count_from_env()
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", BACKEND):
            raise RuntimeError(f"dgtest: PrivateUse1 is already taken by {name!r} in this process")
        try:
            lib = _build(verbose)
            try:
                torch.ops.load_library(lib)
            except OSError:   # a cached library that does not load (cut short): build anew
                os.remove(lib)
                lib = _build(verbose)
                torch.ops.load_library(lib)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers
            WHY_NOT = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            raise RuntimeError(f"dgtest cannot be built here: {WHY_NOT}") from exc
        from . import device as _device
        if name != BACKEND:
            torch.utils.rename_privateuse1_backend(BACKEND)
        if not hasattr(torch, BACKEND):
            torch._register_device_module(BACKEND, _device)
        if not hasattr(torch.Tensor, "is_" + BACKEND):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
        _loaded = True
        _probe_autograd()
    return BACKEND


# Objects of the engine runs below, kept alive until the interpreter's very end so
# that no autograd thread ever drops the last reference to a Python object.
_KEEP: list = []


def _run_backward_on(index: int) -> None:
    """One tiny backward whose node runs on dgtest:index's autograd thread, through
    the engine directly: unlike ``Tensor.backward`` it stashes no Python object in
    the graph task's thread-local state."""
    import torch
    x = torch.ones(1, device=f"{BACKEND}:{index}", requires_grad=True)
    y = x * 2
    g = torch.ones_like(y)
    _KEEP.append((x, y, g))
    torch.autograd.Variable._execution_engine.run_backward(
        (y,), (g,), False, False, (), True, True)


def _probe_autograd() -> None:
    """Make torch's autograd engine start its device threads now (it sizes them once,
    at its first run), and find out whether it had already started without dgtest."""
    global AUTOGRAD_WHY_NOT
    import atexit
    try:
        _run_backward_on(0)
    except RuntimeError as exc:
        AUTOGRAD_WHY_NOT = ("autograd on dgtest is not available in this process: torch's engine "
                            "started before dgtest was loaded (call load() before any backward); "
                            + str(exc).splitlines()[0][:200])
        return
    atexit.register(_settle_autograd_threads)


def _settle_autograd_threads() -> None:
    """At exit: let each dgtest autograd thread finish what it holds.

    ``Tensor.backward`` (torch 2.13) stashes a Python object in the graph task; a
    device thread that drops the last reference to that task while the interpreter
    is finalizing cannot take the GIL and aborts the process ("terminate called
    without an active exception"). A device thread runs its queue in order, so once
    a backward of our own (with nothing Python in it) has run on every device, the
    earlier tasks are gone. Bounded (30 s): a device thread still held by a
    pass that failed must not keep the process from exiting; the checker is off (a
    violation left pending by that pass is not this run's)."""
    import threading

    def settle() -> None:
        try:
            import torch
            set_checker(False)
            for i in range(torch.dgtest.device_count()):
                _run_backward_on(i)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    t = threading.Thread(target=settle, name="dgtest-settle", daemon=True)
    t.start()
    t.join(30.0)
    if t.is_alive():
        import sys
        print("dgtest: an autograd thread is still busy at exit (a pass that failed?); "
              "exiting without waiting for it", file=sys.stderr)


def available() -> bool:
    """Whether :func:`load` works here (builds on first call). ``WHY_NOT`` says why not.

    Example::

        >>> from distgrad.testing import accel
        >>> if not accel.available(): print(accel.WHY_NOT)   # doctest: +SKIP
    """
    try:
        load()
    except Exception as exc:  # noqa: BLE001
        global WHY_NOT
        WHY_NOT = WHY_NOT or f"{type(exc).__name__}: {exc}"
        return False
    return True


def device_under_test() -> str:
    """The device type that device tests run on: ``"cuda"`` where
    ``DISTGRAD_TEST_DEVICE=cuda`` (or the variable is unset and CUDA is available),
    else ``"dgtest"`` (loading it). The one switch that runs the same tests on a GPU.

    Example::

        >>> from distgrad.testing.accel import device_under_test
        >>> dev = device_under_test()            # doctest: +SKIP
        >>> torch.zeros(2, device=f"{dev}:0")    # doctest: +SKIP
    """
    want = os.environ.get("DISTGRAD_TEST_DEVICE", "").strip().lower()
    if want == "cuda":
        return "cuda"
    if want in ("", "auto"):
        import torch
        if torch.cuda.is_available():
            return "cuda"
    elif want != BACKEND:
        raise ValueError(f"DISTGRAD_TEST_DEVICE={want!r}: expected 'cuda' or 'dgtest'")
    return load()


# ------------------------------------------------------------------ checker control

def _ops():
    load()
    import torch
    return torch.ops.dgtest


def checker_enabled() -> bool:
    """Whether the stream-order checker is on (it is by default).

    Example::

        >>> accel.checker_enabled()   # doctest: +SKIP
        True
    """
    return bool(_ops().checker_state()[0])


def set_checker(on: bool, *, raise_errors: bool = True) -> None:
    """Turn the stream-order checker on or off; with ``raise_errors=False`` it only
    logs (see :func:`violations`). Turning it back on forgets what happened while off.

    Example::

        >>> accel.set_checker(False)   # doctest: +SKIP
        >>> accel.set_checker(True)    # doctest: +SKIP
    """
    _ops().set_checker(bool(on), bool(raise_errors))


def violations() -> list[str]:
    """The last (up to 200) violations found, raised or not, oldest first.

    Example::

        >>> accel.clear_violations(); accel.violations()   # doctest: +SKIP
        []
    """
    return list(_ops().violations())


def clear_violations() -> None:
    """Forget the logged violations (and a free's violation not raised yet).

    Example::

        >>> accel.clear_violations()   # doctest: +SKIP
    """
    _ops().clear_violations()


def check() -> None:
    """Raise a violation found in a free (deleters cannot raise) if there is one.

    Example::

        >>> del t; accel.check()   # doctest: +SKIP
    """
    _ops().check()


class _Expected:
    def __init__(self) -> None:
        self.message: str | None = None


@contextlib.contextmanager
def expect_violation(match: str | None = None):
    """Expect a stream-order violation inside the block: the raising op's error (or a
    racing free's, checked at the end of the block) is caught; none, or one whose text
    does not match the regex ``match``, fails with AssertionError. The caught text is
    on the yielded object's ``message``.

    Example::

        >>> with accel.expect_violation("reads") as v:        # doctest: +SKIP
        ...     with torch.dgtest.stream(s2): y = x + 1        # x written on s1, no wait
        >>> v.message.startswith("stream-order violation:")   # doctest: +SKIP
        True
    """
    out = _Expected()
    before = int(_ops().checker_state()[2])
    try:
        yield out
        check()
    except RuntimeError as exc:
        text = str(exc)
        if not text.startswith("stream-order violation:"):
            raise
        out.message = text
    if out.message is None and int(_ops().checker_state()[2]) > before:  # log-only mode
        out.message = violations()[-1]
    if out.message is None:
        raise AssertionError("expected a stream-order violation; none happened")
    if match is not None and not re.search(match, out.message):
        raise AssertionError(f"stream-order violation {out.message!r} does not match {match!r}")


@contextlib.contextmanager
def checker_off():
    """The checker off inside the block (what happens there is forgotten after).

    Example::

        >>> with accel.checker_off(): racy_code()   # doctest: +SKIP
    """
    state = _ops().checker_state()
    set_checker(False)
    try:
        yield
    finally:
        set_checker(bool(state[0]), raise_errors=bool(state[1]))


__all__ = ["BACKEND", "WHY_NOT", "AUTOGRAD_WHY_NOT", "load", "available", "built", "device_under_test",
           "checker_enabled", "set_checker", "violations", "clear_violations", "check",
           "expect_violation", "checker_off"]
