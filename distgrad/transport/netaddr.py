"""Which local address a worker listens on (and publishes to its peers).

In order: an explicit address (``listen_addr`` / ``DISTGRAD_LISTEN_ADDR``);
the IPv4 address of the interface named by ``DISTGRAD_SOCKET_IFNAME`` (else
``TP_SOCKET_IFNAME``, the variable torch's TensorPipe agent reads); the local
address the kernel would use to reach the rendezvous host (MASTER_ADDR or the
``tcp://`` host), which on the master's own node is the master address itself
and on any other node the interface that routes to it; 127.0.0.1 when there is
no rendezvous host.

Example::

    >>> listen_address(None, "10.0.0.1")     # on a node whose eth0 is 10.0.0.2
    '10.0.0.2'
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys

from ..errors import DistgradError

IFNAME_VARS = ("DISTGRAD_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (Linux), or DistgradError.

    Example::

        >>> interface_address("lo")
        '127.0.0.1'
    """
    if sys.platform != "linux":
        raise DistgradError(f"interface names ({ifname!r}) are read on Linux only; set "
                            "DISTGRAD_LISTEN_ADDR to the address instead")
    import fcntl
    try:
        socket.if_nametoindex(ifname)
    except OSError:
        raise DistgradError(f"no network interface named {ifname!r} (from "
                            f"{'/'.join(IFNAME_VARS)})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise DistgradError(f"network interface {ifname!r} has no IPv4 address ({e}); set "
                                "DISTGRAD_LISTEN_ADDR instead") from None
    return socket.inet_ntoa(req[20:24])


def route_source(host: str) -> str | None:
    """The local address packets to ``host`` leave from (no packet is sent), None
    when ``host`` does not resolve or has no route. IPv4 is preferred, as
    ``socket.bind`` on a name would.

    Example::

        >>> route_source("127.0.0.1")
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    for family, kind, proto, _, addr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)  # UDP: picks the route and source address, sends nothing
                return str(s.getsockname()[0]).split("%")[0]
        except OSError:
            continue
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address literal) is a loopback address.

    Example::

        >>> is_loopback("127.0.0.1"), is_loopback("10.0.0.1")
        (True, False)
    """
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_hint(rank: int, mine: str, peer: int, peer_addr: str) -> str:
    """For workers ``rank`` (listening on ``mine``) and ``peer`` (at ``peer_addr``,
    ``tcp://host:port``) on different hosts: why they cannot connect, if one
    listens on a loopback address; "" otherwise.

    Example::

        >>> loopback_hint(0, "127.0.0.1", 2, "tcp://10.0.0.2:4000")[:40]
        ' (worker 0 listens on the loopback addre'
    """
    theirs = peer_addr[len("tcp://"):].rpartition(":")[0]
    for who, host in ((peer, theirs), (rank, mine)):
        if is_loopback(host):
            return (f" (worker {who} listens on the loopback address {host}, but workers {rank} "
                    f"and {peer} are on different hosts or network namespaces: set MASTER_ADDR to "
                    "an address every host reaches, or DISTGRAD_LISTEN_ADDR / "
                    "DISTGRAD_SOCKET_IFNAME on each worker)")
    return ""


def listen_address(explicit: str | None, master: str | None) -> str:
    """The address to listen on (see the module docstring for the order).

    Example::

        >>> listen_address("10.0.0.7", "10.0.0.1")
        '10.0.0.7'
    """
    if explicit:
        return explicit
    for var in IFNAME_VARS:
        ifname = os.environ.get(var)
        if ifname:
            return interface_address(ifname)
    if not master:
        return "127.0.0.1"
    return route_source(master) or master
