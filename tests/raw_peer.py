"""A raw client that speaks (or fails to speak) the transport's handshake, for the
attack tests: it reads a worker's address from the rendezvous store, connects to
its TCP port or its Unix socket, and sends what it is told.

The handshake (distgrad/transport/handshake.py)::

    client -> server   magic | client rank | server rank | flags | client challenge (16 B)
    server -> client   magic | server rank | flags | server challenge (16 B) | server proof (32 B)
    client -> server   client proof (32 B)
"""
from __future__ import annotations

import json
import os
import socket
import time

from distgrad.launch import sealed
from distgrad.transport import framing
from distgrad.transport.handshake import _HELLO, _WELCOME, F_ENCRYPT, F_MAC_ALL, F_SECRET, MAGIC  # noqa: F401


def worker_address(agent, rank: int) -> tuple[tuple[str, int], str | None, dict]:
    """((host, port), unix socket name or None, tags) of worker ``rank``, as published
    in the store (``tcp://127.0.0.1:PORT#unix=@name#host=...#auth=...``; the entry's
    JSON read without its check: see distgrad/launch/sealed.py)."""
    raw = bytes(agent.store.get(f"worker/{rank}"))
    full = json.loads(raw[len(sealed.MAGIC) + sealed.TAG_BYTES:])["address"]
    addr, *tagged = full.split("#")
    tags = dict(t.partition("=")[::2] for t in tagged)
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return (host.strip("[]"), int(port)), tags.get("unix"), tags


def targets(agent, rank: int) -> list:
    """Where worker ``rank`` accepts connections: its TCP address, and its Unix socket."""
    tcp, unix, _ = worker_address(agent, rank)
    return [tcp] + ([unix] if unix else [])


def connect(target, timeout: float = 5.0) -> socket.socket:
    if isinstance(target, str):  # a Unix socket; '@' is Linux's abstract namespace
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect("\0" + target[1:] if target.startswith("@") else target)
        return s
    return socket.create_connection(target, timeout=timeout)


def secret_flags(kind: str) -> int:
    """A worker's flags with a secret, encryption off: on TCP it MACs every byte."""
    return F_SECRET | (F_MAC_ALL if kind == "tcp" else 0)


def hello(rank: int, server_rank: int, flags: int, challenge: bytes | None = None) -> bytes:
    return _HELLO.pack(MAGIC, rank, server_rank, flags, challenge or os.urandom(16))


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None when the peer closed (or reset) first."""
    buf = b""
    try:
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
    except (TimeoutError, ConnectionError):
        return None
    return buf


def read_welcome(sock: socket.socket):
    """(magic, server rank, flags, server challenge, proof), or None when closed first."""
    data = recv_exact(sock, _WELCOME.size)
    return None if data is None else _WELCOME.unpack(data)


def closed_by_peer(sock: socket.socket, timeout: float = 15.0) -> bool:
    """Whether the worker closes the connection within ``timeout`` s (whatever it
    sends before is read and dropped)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except ConnectionError:
            return True
        except TimeoutError:
            return False
    return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send ``data``; the worker may hang up first, which is what we want."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def framed(frames) -> bytes:
    """One message as the transport frames it on the wire."""
    return framing.pack_header(frames) + b"".join(bytes(memoryview(f)) for f in frames)
