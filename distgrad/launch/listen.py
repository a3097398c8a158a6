"""Host a TCPStore on the address the user named, and on no other.

torch's ``TCPStore(is_master=True)`` listens on the wildcard address (``::``,
every interface) whatever host it is given: a store started for
``MASTER_ADDR=127.0.0.1`` is reachable from every network the host is on. It
also accepts a socket bound beforehand (``master_listen_fd``), and takes it
over (it listens on it and closes it with the store). So distgrad binds the
named address itself and hands the socket to torch.

When the port is already taken, the store is opened as torch opens it: a
``multi_tenant`` store of this process on that port (torch's own rendezvous
opened first) is then shared, as before; anything else fails as torch fails.

Example::

    >>> store = host_store("127.0.0.1", 29500, None, timedelta(seconds=60), multi_tenant=True)
    >>> # ss -ltn: 127.0.0.1:29500, not *:29500
"""
from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist

from ..errors import DistgradError


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (an address or a name, resolved as
    the clients will: its first address) and ``port``. Raises OSError."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, world_size: int | None, timeout: timedelta,
               multi_tenant: bool = False) -> dist.TCPStore:
    """The hosting side of a TCPStore listening on ``host``:``port`` only (see the
    module docstring). Raises DistgradError when ``host`` is no address of this
    machine; torch's errors otherwise."""
    try:
        sock = bound_socket(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:   # ours (multi_tenant) or another program's: torch says
            return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False, multi_tenant=multi_tenant)
        raise DistgradError(f"cannot host the store on {host}:{port}: {e} (the address must be "
                            "one of this machine's: the store listens on it alone)") from e
    # torch owns the descriptor from here: it listens on it and closes it (once it
    # has it, closing it here too could close another file given the same number)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, multi_tenant=multi_tenant,
                         master_listen_fd=sock.detach())
