"""References computed in a process that never imported distgrad.

distgrad patches torch when it is imported (tensor and node hook registration,
``set_materialize_grads``, checkpointing, ``torch.autograd.backward``, DDP's constructor
and reducer). A single-process reference computed in a process that imported distgrad
shares whatever such a patch changes in local autograd with the run it judges, so a
patch that broke local autograd would be invisible to every oracle. The suite's
oracles (random programs, random DDP, hooks, checkpoint, torch after import) compute
their references here instead::

    want = clean_ref.shared().call(random_programs.run_local, prog)

The reference process is a plain ``python -c`` subprocess (no multiprocessing main-
module import, allowed in daemonic workers too) that imports nothing of this suite
but this module; the function is pickled by its qualified name, so it must live in a
module whose import never touches distgrad. Before and after every call the process
checks that no ``distgrad`` module is loaded, and fails the call if one is. Arguments
and results travel as plain pickles (tensors as bytes) over its stdin / a duplicate of
its stdout (its fd 1 goes to stderr, so a print cannot corrupt a reply).

Also here: :func:`pack` / :func:`unpack` (tensors through multiprocessing arguments
without shared-memory file descriptors) and :func:`break_register_hook`, the
deliberate fault the oracle's own tests apply to show that a broken patch is caught.
"""
from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
import traceback

_HEAD = struct.Struct("<Q")


class CleanReferenceError(RuntimeError):
    """The reference function raised (the message starts with its type and text and
    carries its traceback), or the reference process failed or was contaminated."""


def distgrad_modules() -> list:
    """The distgrad modules loaded in this process (``distgrad`` or ``distgrad.*``)."""
    return sorted(m for m in sys.modules if m == "distgrad" or m.startswith("distgrad."))


def pack(obj) -> bytes:
    """``obj`` as a plain pickle (tensors as bytes, no shared-memory handles)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes):
    """The object :func:`pack` packed."""
    return pickle.loads(data)


def _read_exact(f, n: int) -> bytes:
    buf = f.read(n)
    if buf is None or len(buf) != n:
        raise EOFError
    return buf


def _serve() -> None:
    """The reference process's loop: requests from stdin, replies to the old stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                      # prints of reference code go to stderr
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    import torch
    torch.set_num_threads(1)           # as the suite's workers (tests/mp_utils.py)
    while True:
        try:
            (n,) = _HEAD.unpack(_read_exact(inp, _HEAD.size))
            msg = _read_exact(inp, n)
        except EOFError:
            return
        contaminated = False
        try:
            fn, args, kwargs = pickle.loads(msg)
            loaded = distgrad_modules()
            contaminated = bool(loaded)
            if loaded:
                raise CleanReferenceError(f"the reference process imported distgrad ({loaded[:5]}) "
                                          f"while loading {getattr(fn, '__module__', fn)}")
            result = fn(*args, **kwargs)
            loaded = distgrad_modules()
            contaminated = bool(loaded)
            if loaded:
                raise CleanReferenceError(f"the reference process imported distgrad ({loaded[:5]}) "
                                          f"while running {fn.__module__}.{fn.__qualname__}")
            reply = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            first = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
            status = "contaminated" if contaminated else "error"
            reply = pickle.dumps((status, first + "\n" + traceback.format_exc()))
        out.write(_HEAD.pack(len(reply)) + reply)
        out.flush()
        if contaminated:   # no later call may run in it
            return


class CleanProcess:
    """One reference process (see the module's docstring); calls are serialized."""

    def __init__(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        path = [here] + [p for p in sys.path if p and p != here]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        code = f"import sys; sys.path[:0] = {path!r}; import clean_ref; clean_ref._serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()

    def call(self, fn, *args, timeout: float = 600.0, **kwargs):
        """``fn(*args, **kwargs)`` in the reference process; its result, or
        :class:`CleanReferenceError` with the reference's traceback."""
        msg = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            if self.proc.poll() is not None:
                raise CleanReferenceError(f"the reference process exited ({self.proc.returncode})")
            box: dict = {}
            reader = threading.Thread(target=self._exchange, args=(msg, box), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                self.close()
                raise CleanReferenceError(f"the reference process gave no answer within {timeout:g} s "
                                          f"({getattr(fn, '__qualname__', fn)})")
        if "exc" in box:
            raise CleanReferenceError(f"the reference process failed: {box['exc']!r} (exit status "
                                      f"{self.proc.poll()})")
        status, value = box["reply"]
        if status == "contaminated":   # it exits: shared() starts a new one
            self.close()
        if status != "ok":
            raise CleanReferenceError(value)
        return value

    def _exchange(self, msg: bytes, box: dict) -> None:
        try:
            self.proc.stdin.write(_HEAD.pack(len(msg)) + msg)
            self.proc.stdin.flush()
            (n,) = _HEAD.unpack(_read_exact(self.proc.stdout, _HEAD.size))
            box["reply"] = pickle.loads(_read_exact(self.proc.stdout, n))
        except BaseException as e:  # noqa: BLE001 - reported by call()
            box["exc"] = e

    def close(self) -> None:
        """End the process (it ends by itself when its stdin closes)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> CleanProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SHARED: list = []
_SHARED_LOCK = threading.Lock()


def shared() -> CleanProcess:
    """This process's reference process, started on first use (again after a failure)
    and ended at exit."""
    with _SHARED_LOCK:
        if not _SHARED or _SHARED[0].proc.poll() is not None:
            if not _SHARED:
                atexit.register(lambda: _SHARED and _SHARED[0].close())
            _SHARED[:] = [CleanProcess()]
        return _SHARED[0]


def reference(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in :func:`shared`'s process."""
    return shared().call(fn, *args, **kwargs)


def break_register_hook(factor: float) -> None:
    """A deliberate fault for the oracles' own tests: from now on, in this process,
    every hook registered with ``Tensor.register_hook`` (whatever patch is in place)
    also multiplies the gradient it returns by ``factor``, as a broken patch of
    ``register_hook`` would. Local autograd in this process sees it too, so only a
    reference computed elsewhere notices."""
    import torch
    register = torch.Tensor.register_hook

    def register_hook(self, hook):
        def scaled(g):
            out = hook(g)
            out = g if out is None else out
            return None if out is None else out * factor
        return register(self, scaled)

    torch.Tensor.register_hook = register_hook
