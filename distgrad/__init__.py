"""distgrad: distributed autograd for PyTorch and the RPC framework under it.

Code written for torch.distributed.rpc / torch.distributed.autograd /
torch.distributed.optim.DistributedOptimizer runs after swapping the imports::

    import distgrad.rpc as rpc
    import distgrad.autograd as dist_autograd
    from distgrad.optim import DistributedOptimizer
"""
from . import _build

_build.install()   # before any module of the message path is imported: compiled or not

from . import (  # noqa: F401,E402
    autograd,  # noqa: F401,E402  (registers its agent extension)
    errors,
    rpc,
    trace,  # distgrad.trace(path): one timeline of a distributed step (callable module)
)

__version__ = "0.1.0"


def info() -> dict:
    """What runs in this process: the version, the message path compiled or interpreted
    (per module: :func:`distgrad._build.message_path`, after importing them all) and the
    distributed backward's engine (``autograd_engine``: ``"native"``, one torch graph task
    a worker a pass, where ``distgrad/autograd/native`` could be built, else ``"python"``
    with ``autograd_engine_why``).

    Example::

        >>> import distgrad
        >>> {'message_path', 'modules', 'pure_forced', 'version'} <= set(distgrad.info())
        True
    """
    import importlib

    for name in _build.COMPILED:
        importlib.import_module(name)
    out = {"version": __version__, **_build.message_path()}
    from .autograd import native
    mod = native.load(build=False) if native.built() else None
    out["autograd_engine"] = "native" if mod is not None else "python"
    if mod is None:
        out["autograd_engine_why"] = native.WHY_NOT or "not built yet (python -m distgrad build-native)"
    return out
