"""Rank 0's store in a process of its own: the keeper.

torch's TCPStore server runs inside the process that hosts it, accepts every
connection and keeps it. Hosted in rank 0 (as torch does it), 1,100 idle
connections from anyone who reaches the port take every file descriptor rank 0
has: its ``open()`` calls fail, its worker port cannot accept. Nothing in the
server (C++) can be capped from Python. So rank 0 hosts its store in a small
child process, the keeper:

* rank 0 binds the address the user named (:func:`.listen.bound_socket`) and
  hands the socket to the keeper, which serves torch's TCPStore on a loopback
  port of its own behind a front that caps connections in all and per peer
  address and closes silent ones (:mod:`.front`). A crowd exhausts the keeper's
  descriptors at worst, never rank 0's; the keeper raises its own open-file limit
  and sizes its caps to it (three descriptors a relayed connection).
* rank 0 is a client of the server directly (loopback, past the front: no relay
  on its operations, no cap on it).
* the keeper ignores Ctrl-C (rank 0 decides when the store goes) and exits when
  rank 0 lets go of it (:func:`let_go`: the end of ``rpc.shutdown``) or exits,
  however it exits: it watches a pipe whose other end only rank 0 holds.
* torch's ``init_process_group`` on rank 0, on the port of a keeper of this
  process (the sharing torch does with ``multi_tenant``), gets a client of the
  keeper: while a keeper lives, ``torch.distributed.rendezvous._create_c10d_store``
  is a pass-through wrapper that says so; that keeper then lives as long as this
  process (nobody can tell when torch lets go of its store).

What it costs (this 2-core machine): the keeper's start, about 1.4 s (a Python
that imports torch; distgrad itself is not imported), once per hosting rank 0;
its memory (torch's libraries, mostly shared pages); and for the other ranks one
more process hop per store operation, through the front (``get`` 32-60 us direct,
105-235 us relayed). ``DISTGRAD_STORE_PROCESS=0`` hosts the store in rank 0 as
before (no cap: for a network only the cluster reaches). Where there is no
``fork``/``exec`` with inherited descriptors (Windows), the store stays in rank 0.

Example::

    >>> store = host("127.0.0.1", 29500, 2, timedelta(seconds=60))   # a client of the keeper
    >>> store.set("k", b"v")
    >>> let_go(store)                  # the keeper exits (unless torch shares it)
"""
from __future__ import annotations

import functools
import logging
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import DistgradError

log = logging.getLogger(__name__)

DEFAULT_TOTAL, DEFAULT_PER_ADDRESS, SILENT_S = 1024, 256, 30.0
_PER_RELAYED = 3      # descriptors a relayed connection costs the keeper
_RESERVED = 64        # the keeper's own (libraries, the server's, the spare)

_lock = threading.Lock()
_live: dict[int, _Keeper] = {}       # public port -> a serving keeper of this process
_leaving: dict[int, _Keeper] = {}    # public port -> a keeper let go, maybe not gone yet
_served: list = []                   # fronts serve_here started in this process


def wanted() -> bool:
    """Whether a hosting rank 0 puts its store in a keeper: unless
    ``DISTGRAD_STORE_PROCESS=0``, wherever descriptors can be handed to a child.

    Example::

        >>> os.environ["DISTGRAD_STORE_PROCESS"] = "0"; wanted()
        False
    """
    return os.environ.get("DISTGRAD_STORE_PROCESS", "1") != "0" and os.name == "posix" \
        and bool(sys.executable)


def _forget_keepers_in_child() -> None:
    """In a child forked from rank 0 (a fork-based DataLoader worker, a multiprocessing
    pool): close its copies of the keepers' control pipes, so that a keeper exits when
    rank 0 lets go of it or exits, not when the last such child does."""
    for keeper in list(_live.values()) + list(_leaving.values()):
        try:
            os.close(keeper.control)
        except OSError:
            pass
    _live.clear()
    _leaving.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_keepers_in_child)


class _Keeper:
    def __init__(self, proc: subprocess.Popen, control: int, host: str, port: int,
                 backend: int) -> None:
        self.proc, self.control = proc, control
        self.host, self.port, self.backend = host, port, backend
        self.clients: list = []    # rank 0's stores on it, held until let go
        self.pinned = False        # torch shares it: it lives as long as this process

    def client(self, world_size: int | None, timeout: timedelta, pin: bool = False) -> dist.TCPStore:
        store = dist.TCPStore("127.0.0.1", self.backend, world_size, is_master=False,
                              timeout=timeout, wait_for_workers=False)
        if pin:   # torch's: held by torch, for as long as it likes
            with _lock:
                self.pinned = True
        return store

    def stop(self) -> None:
        """Close the control pipe: the keeper closes every connection and exits."""
        try:
            os.close(self.control)
        except OSError:
            pass

    def wait_gone(self, seconds: float) -> None:
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def host(host: str, port: int, world_size: int | None, timeout: timedelta) -> dist.TCPStore:
    """A client of the keeper serving ``host``:``port`` for this process: the live
    one on that port (shared, as torch shares a ``multi_tenant`` store), else a new
    one. Raises OSError (EADDRINUSE: another program holds the port) or
    DistgradError (the keeper did not start).

    Example::

        >>> store = host("127.0.0.1", 29500, 2, timedelta(seconds=60))
        >>> store.set("worker/0", b"...")   # the other ranks reach it at 127.0.0.1:29500
    """
    from .listen import bound_socket
    with _lock:
        keeper = _live.get(port)
    if keeper is not None and keeper.proc.poll() is None:
        store = keeper.client(world_size, timeout)
        with _lock:
            keeper.clients.append(store)
        return store
    _reap(port)
    sock = bound_socket(host, port)
    try:
        keeper = _start(sock, host, port, timeout.total_seconds())
    finally:
        sock.close()   # the keeper holds it now (or nobody)
    try:
        store = keeper.client(world_size, timeout)
    except BaseException:
        keeper.stop()
        keeper.wait_gone(10.0)
        raise
    with _lock:
        keeper.clients.append(store)
        _live[port] = keeper
        _route_torch()
    return store


def let_go(store) -> None:
    """Rank 0 no longer uses ``store`` (a store :func:`host` returned): once the
    keeper serves none of this process's stores and torch does not share it, it
    exits. Anything else is left alone.

    Example::

        >>> store = host("127.0.0.1", 29500, 2, timedelta(seconds=60))
        >>> let_go(dist.PrefixStore("distgrad/0.1", store))   # the keeper exits
    """
    store = _unprefixed(store)
    with _lock:
        for port, keeper in list(_live.items()):
            if not any(s is store for s in keeper.clients):
                continue
            keeper.clients = [s for s in keeper.clients if s is not store]
            if keeper.clients or keeper.pinned:
                return
            del _live[port]
            _leaving[port] = keeper
            if not _live:
                _unroute_torch()
            keeper.stop()
            return


def pin(store) -> None:
    """Keep the keeper of ``store`` serving as long as this process lives (a
    dynamic group's hosting member leaves first and the others after it).

    Example::

        >>> pin(agent.store)   # let_go(agent.store) then leaves it serving
    """
    store = _unprefixed(store)
    with _lock:
        for keeper in _live.values():
            if any(s is store for s in keeper.clients):
                keeper.pinned = True


def _unprefixed(store):
    """The store under any PrefixStores (the same Python object as the one :func:`host`
    returned: it is held, so torch hands back that one)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def public_of(port: int) -> str | None:
    """``host:port`` where the keeper whose server is on loopback ``port`` listens
    (what a message about rank 0's store should name), or None.

    Example::

        >>> public_of(store.port)     # store: rank 0's client, on 127.0.0.1:41234
        '10.0.0.1:29500'
    """
    with _lock:
        for keeper in _live.values():
            if keeper.backend == port:
                return f"{keeper.host}:{keeper.port}"
    return None


def _reap(port: int) -> None:
    """Wait for a keeper let go on ``port`` to be gone (its port free); collect the
    others that are."""
    with _lock:
        gone = [p for p, k in _leaving.items() if k.proc.poll() is not None]
        for p in gone:
            del _leaving[p]
        leaving = _leaving.pop(port, None)
    if leaving is not None:
        leaving.wait_gone(10.0)


# -- starting one ------------------------------------------------------------------
_BOOT = """\
import os, sys, types
root, torch_dir = sys.argv[1], sys.argv[2]
for d in (torch_dir, root):
    if d not in sys.path:
        sys.path.insert(0, d)
for name in ("distgrad", "distgrad.launch", "distgrad.transport"):   # without their __init__
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = mod
from distgrad.launch.keeper import child_main
child_main(sys.argv[3:])
"""


def _start(sock: socket.socket, host: str, port: int, timeout: float) -> _Keeper:
    import torch
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    read_end, control = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "DISTGRAD_SECRET"}
    total = _env_int("DISTGRAD_STORE_MAX_CONNECTIONS", DEFAULT_TOTAL)
    per_address = _env_int("DISTGRAD_STORE_MAX_PER_ADDRESS", DEFAULT_PER_ADDRESS)
    cmd = [sys.executable, "-c", _BOOT, root, torch_dir, str(sock.fileno()), str(read_end),
           str(total), str(per_address), f"{host}:{port}"]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(), read_end), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, env=env, close_fds=True)
    except OSError as e:
        os.close(control)
        raise DistgradError(f"cannot start the process that serves the store on {host}:{port}: "
                            f"{e} (DISTGRAD_STORE_PROCESS=0 serves it in this process)") from e
    finally:
        os.close(read_end)
    try:
        backend = _ready(proc, max(10.0, min(timeout, 600.0)))
    except BaseException:
        os.close(control)
        proc.kill()
        proc.wait(10)
        raise
    finally:
        proc.stdout.close()
    log.debug("rank 0's store on %s:%d is served by process %d (server on 127.0.0.1:%d)",
              host, port, proc.pid, backend)
    return _Keeper(proc, control, host, port, backend)


def _ready(proc: subprocess.Popen, seconds: float) -> int:
    """The keeper's server port, from its first line ("ready <port>")."""
    deadline = time.monotonic() + seconds
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise DistgradError(f"the process that serves rank 0's store (pid {proc.pid}) was "
                                    f"not ready within {seconds:.0f} s")
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                code = proc.wait(10)
                raise DistgradError(f"the process that serves rank 0's store exited ({code}) "
                                    "before it served (its error is above; "
                                    "DISTGRAD_STORE_PROCESS=0 serves it in this process)")
            line += chunk
    word, _, port = line.decode(errors="replace").strip().partition(" ")
    if word != "ready" or not port.isdigit():
        raise DistgradError(f"the process that serves rank 0's store said {line!r}")
    return int(port)


def _env_int(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistgradError(f"{var}={raw!r} is not an integer") from None
    if value < 1:
        raise DistgradError(f"{var}={raw!r}: at least 1")
    return value


# -- torch's own rendezvous on rank 0 ----------------------------------------------
def _route_torch() -> None:
    """(under _lock) Install the wrapper of torch's ``_create_c10d_store``."""
    import torch.distributed.rendezvous  # noqa: F401 - the module (its name is a function too)
    mod = sys.modules["torch.distributed.rendezvous"]
    original = mod._create_c10d_store
    if getattr(original, "_distgrad_keeper", False):
        return

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if rank == 0 and not agent_store:
            with _lock:
                keeper = _live.get(port)
            if keeper is not None and keeper.proc.poll() is None:
                # rank 0 would host it with multi_tenant=True, sharing this process's
                # server on that port: the keeper is that server now
                return keeper.client(world_size, timeout, pin=True)
        return original(hostname, port, rank, world_size, timeout, *args, **kwargs)

    # torch's name, docstring and signature (__wrapped__); the module stays distgrad's,
    # so it never passes for torch's
    functools.update_wrapper(_create_c10d_store, original, ("__name__", "__qualname__", "__doc__"),
                             ())
    _create_c10d_store._distgrad_keeper = True
    mod._create_c10d_store = _create_c10d_store


def _unroute_torch() -> None:
    """(under _lock) Put torch's own function back, unless replaced since."""
    mod = sys.modules.get("torch.distributed.rendezvous")
    current = getattr(mod, "_create_c10d_store", None) if mod is not None else None
    if getattr(current, "_distgrad_keeper", False):
        mod._create_c10d_store = current.__wrapped__


# -- the keeper process -------------------------------------------------------------
def child_main(argv: list[str]) -> None:
    """The keeper's life (``argv``: listening descriptor, control descriptor, cap in
    all, cap per address, ``host:port`` for messages): serve until the control
    pipe's end, then exit. Run by :func:`host` through ``_BOOT``, never imported
    into a worker.

    Example (what :func:`host` runs, with descriptors 5 and 6 inherited)::

        >>> child_main(["5", "6", "1024", "256", "127.0.0.1:29500"])
    """
    import signal

    from ..transport.descriptors import raise_open_file_limit
    from .front import StoreFront

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches rank 0, which decides
    logging.basicConfig(level=logging.INFO, format=f"distgrad store process {os.getpid()} "
                        f"({argv[4]}): %(message)s")
    logging.getLogger("distgrad.transport.descriptors").setLevel(logging.WARNING)
    raise_open_file_limit()
    listen_fd, control = int(argv[0]), int(argv[1])
    total, per_address = int(argv[2]), int(argv[3])
    listener = socket.socket(fileno=listen_fd)
    _server, backend = serve_backend()   # held while it serves
    front = StoreFront(listener, ("127.0.0.1", backend), *budget(total, per_address),
                       SILENT_S, control=control, name=f"store on {argv[4]}")
    os.write(1, f"ready {backend}\n".encode())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)   # rank 0 reads no more; nothing else may take descriptor 1
    os.close(devnull)
    front.serve_forever()
    os._exit(0)   # the server's connections close with the process


def serve_here(host: str, port: int):
    """Serve a store on ``host``:``port`` from this process (``distgrad store``, a
    process of its own already): torch's server on a loopback port, the capping
    front on the address named, on a thread. Returns the front (its ``server``
    attribute holds the store; :meth:`~.front.StoreFront.stop` ends it).

    Example::

        >>> front = serve_here("127.0.0.1", 29500)
        >>> front.connections()
        0
    """
    import threading

    from ..transport.descriptors import raise_open_file_limit
    from .front import StoreFront
    from .listen import bound_socket
    raise_open_file_limit()
    listener = bound_socket(host, port)
    try:
        server, backend = serve_backend()
    except BaseException:
        listener.close()
        raise
    total = _env_int("DISTGRAD_STORE_MAX_CONNECTIONS", DEFAULT_TOTAL)
    per_address = _env_int("DISTGRAD_STORE_MAX_PER_ADDRESS", DEFAULT_PER_ADDRESS)
    front = StoreFront(listener, ("127.0.0.1", backend), *budget(total, per_address), SILENT_S,
                       name=f"store on {host}:{port}")
    front.server = server
    _served.append(front)   # serves until this process exits
    threading.Thread(target=front.serve_forever, daemon=True, name="distgrad-store-front").start()
    return front


def serve_backend() -> tuple[dist.TCPStore, int]:
    """torch's TCPStore server on a loopback port of its own: (the store, its port).

    Example::

        >>> server, port = serve_backend()   # server.port == port, listening on 127.0.0.1
    """
    from .listen import bound_socket
    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def budget(total: int, per_address: int) -> tuple[int, int]:
    """The caps (in all, per address) this process's open-file limit affords: each
    relayed connection costs three descriptors (the client's, the relay's, the
    server's end of it).

    Example::

        >>> budget(1024, 256)         # at an open-file limit of 256
        (64, 64)
    """
    from ..transport.descriptors import open_file_limit
    limits = open_file_limit()
    if limits is not None and limits[0] > 0:
        total = min(total, max(1, (limits[0] - _RESERVED) // _PER_RELAYED))
    return total, min(per_address, total)
