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
Rank 0's store runs in a process of its own (``own_process``, :mod:`.keeper`).

Example::

    >>> store = host_store("127.0.0.1", 29500, None, timedelta(seconds=60), multi_tenant=True)
    >>> # ss -ltn: 127.0.0.1:29500, not *:29500
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from datetime import timedelta

import torch.distributed as dist

from ..errors import DistgradError

log = logging.getLogger(__name__)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (an address, or a name: the first
    of its addresses that can be bound) and ``port``. Raises OSError (the first
    address's error when none can be bound)."""
    first: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1024)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise
            first = first or e
            continue
        _warn_if_loopback_name(host, addr[0])
        return sock
    raise first or OSError(f"{host} has no address")


def _warn_if_loopback_name(host: str, bound: str) -> None:
    """A name (not ``localhost``) that resolves to a loopback address here, as a
    host's own name does with Debian's ``127.0.1.1`` line in /etc/hosts: the store
    listens there, where no other host can reach it. Say so."""
    try:
        ipaddress.ip_address(host)
        return   # an address: what the user named
    except ValueError:
        pass
    if host != "localhost" and ipaddress.ip_address(bound.split("%")[0]).is_loopback:
        log.warning("the store's host name %r resolves to %s (loopback) on this machine: it "
                    "listens there, and other hosts cannot reach it. Name this host's network "
                    "address instead (MASTER_ADDR, the tcp:// host, --host)", host, bound)


def host_store(host: str, port: int, world_size: int | None, timeout: timedelta,
               multi_tenant: bool = False, own_process: bool = False) -> dist.TCPStore:
    """The hosting side of a TCPStore listening on ``host``:``port`` only (see the
    module docstring). With ``own_process`` (rank 0's store) the server runs in a
    process of its own behind a front that caps connections (:mod:`.keeper`), and
    this returns a client of it. Raises DistgradError when ``host`` is no address
    of this machine, or the store's process did not start; torch's errors otherwise.

    Example::

        >>> store = host_store("127.0.0.1", 29500, 2, timedelta(seconds=60), own_process=True)
        >>> store.set("k", b"v")
    """
    try:
        if own_process:
            from . import keeper
            return keeper.host(host, port, world_size, timeout)
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
