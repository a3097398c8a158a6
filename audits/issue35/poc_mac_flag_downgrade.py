"""PoC: downgrade of the every-byte MAC at the handshake (flag F_MAC_ALL) by an
on-path attacker, and a DISTGRAD_MAC_TENSORS mismatch between two workers.

Real client_handshake/server_handshake over TCP on 127.0.0.1 with a MITM
thread that rewrites the flags byte of HELLO and WELCOME (clears F_MAC_ALL,
or sets it). PASS when every rewritten or mismatched handshake is refused by
at least one side and no side completes with settings other than its own.
Run: PYTHONPATH=/work/wt-audit35 DISTGRAD_PURE=1 timeout 60 python audit/poc_mac_flag_downgrade.py
"""
from __future__ import annotations

import socket
import sys
import threading

from distgrad.transport.handshake import (
    _HELLO,
    _WELCOME,
    F_MAC_ALL,
    HandshakeError,
    client_handshake,
    server_handshake,
)

SECRET = b"s" * 32


def exact(s, n):
    b = bytearray()
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return bytes(b)


def run(client_mac, server_mac, rewrite):
    ls = socket.create_server(("127.0.0.1", 0))
    ms = socket.create_server(("127.0.0.1", 0))
    res = {}

    def server():
        s, _ = ls.accept()
        try:
            res["server"] = ("ok", server_handshake(s, 1, SECRET, False, [0], mac_all=server_mac)[0])
        except (HandshakeError, OSError) as e:
            res["server"] = ("refused", str(e)[:80])
        s.close()

    def mitm():
        c, _ = ms.accept()
        s = socket.create_connection(ls.getsockname())
        try:
            hello = bytearray(exact(c, _HELLO.size))
            if rewrite:
                hello[12] ^= F_MAC_ALL      # flags byte of HELLO
            s.sendall(hello)
            welcome = bytearray(exact(s, _WELCOME.size))
            if rewrite:
                welcome[8] ^= F_MAC_ALL     # flags byte of WELCOME
            c.sendall(welcome)
            c.settimeout(3)
            s.settimeout(3)
            s.sendall(exact(c, 32))
            c.sendall(exact(s, 33))
        except (OSError, EOFError):
            pass
        finally:
            c.close()
            s.close()

    ts = [threading.Thread(target=server, daemon=True), threading.Thread(target=mitm, daemon=True)]
    for t in ts:
        t.start()
    sock = socket.create_connection(ms.getsockname())
    try:
        client_handshake(sock, 0, 1, SECRET, False, mac_all=client_mac)
        res["client"] = ("ok",)
    except (HandshakeError, OSError) as e:
        res["client"] = ("refused", str(e)[:80])
    sock.close()
    for t in ts:
        t.join(10)
    ls.close()
    ms.close()
    return res


bad = []
for cm, sm, rw, name in [(True, True, True, "attacker clears F_MAC_ALL both ways"),
                         (False, False, True, "attacker sets F_MAC_ALL both ways"),
                         (True, False, False, "client MAC_TENSORS=1, server 0"),
                         (False, True, False, "client MAC_TENSORS=0, server 1"),
                         (True, True, False, "control: same settings, no attacker")]:
    r = run(cm, sm, rw)
    both_ok = r.get("client", ("?",))[0] == "ok" and r.get("server", ("?",))[0] == "ok"
    expect_ok = name.startswith("control")
    verdict = "holds" if both_ok == expect_ok else "FAIL"
    if verdict == "FAIL":
        bad.append(name)
    print(f"  {verdict}: {name}: {r}")
print("FAIL: " + ", ".join(bad) if bad else "PASS: every downgrade or mismatch refused")
sys.exit(1 if bad else 0)
