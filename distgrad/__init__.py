"""distgrad: distributed autograd for PyTorch and the RPC framework under it.

Code written for torch.distributed.rpc / torch.distributed.autograd /
torch.distributed.optim.DistributedOptimizer runs after swapping the imports::

    import distgrad.rpc as rpc
    import distgrad.autograd as dist_autograd
    from distgrad.optim import DistributedOptimizer
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

_HELP = ("-h", "--help")


def _command_asks_only_for_help() -> bool:
    """Whether this process is the ``distgrad`` command asked for its top-level help
    (``distgrad --help``, ``python -m distgrad -h``): it prints and exits, so it needs
    neither torch nor the layers below (about 1-8 s of imports). Anything else, a
    program of the user's included, gets the whole package."""
    argv = _sys.argv
    if len(argv) < 2 or argv[1] not in _HELP:
        return False
    if argv[0] == "-m":   # runpy is importing the package to run `python -m <module>`
        orig = getattr(_sys, "orig_argv", [])
        tail = len(argv) - 1
        return len(orig) > tail and orig[-tail - 1] in ("distgrad", "-mdistgrad")
    # the console script pip writes: `from distgrad.cli import main` in a file named distgrad
    if _os.path.basename(argv[0]).removesuffix(".exe") not in ("distgrad", "distgrad-script.py"):
        return False
    main = _sys.modules.get("__main__")
    try:
        with open(getattr(main, "__file__", None) or "", encoding="utf-8", errors="replace") as f:
            return "from distgrad.cli import main" in f.read(4096)
    except OSError:
        return False


if not _command_asks_only_for_help():
    from . import _build

    _build.install()   # before any module of the message path is imported: compiled or not

    from . import (  # noqa: F401,E402
        autograd,  # noqa: F401,E402  (registers its agent extension)
        errors,
        rpc,
        trace,  # distgrad.trace(path): one timeline of a distributed step (callable module)
    )


def info() -> dict:
    """What runs in this process: the version, the message path compiled or interpreted
    (per module: :func:`distgrad._build.message_path`, after importing them all) and the
    distributed backward's engine (``autograd_engine``: ``"native"``, one torch graph task
    a worker a pass, where ``distgrad/autograd/native`` could be built, else ``"python"``
    with ``autograd_engine_why``), and whether the transport waits in C with the GIL
    released (``native_wait``: ``"native"``, else ``"python (<why>)"``, see
    :mod:`distgrad.transport.waiting`).

    Example::

        >>> import distgrad
        >>> {'message_path', 'modules', 'pure_forced', 'version'} <= set(distgrad.info())
        True
    """
    import importlib

    from . import _build

    for name in _build.COMPILED:
        importlib.import_module(name)
    out = {"version": __version__, **_build.message_path()}
    from .transport import waiting
    out["native_wait"] = waiting.native_state()   # "native", or "python (why)"
    from .autograd import native
    mod = native.load(build=False) if native.built() else None
    out["autograd_engine"] = "native" if mod is not None else "python"
    if mod is None:
        out["autograd_engine_why"] = native.WHY_NOT or "not built yet (python -m distgrad build-native)"
    return out
