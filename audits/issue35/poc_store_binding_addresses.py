"""PoC: where distgrad's store listens (launch/listen.py host_store), for the
addresses a user may name, and when the port is already held.

For 127.0.0.1, ::1, localhost, 0.0.0.0 and this host's name: host_store() then
`ss -ltn` for the port. Then a squatter (another process, uid 4002 when run as
root) listening on 127.0.0.1:P, with and without SO_REUSEADDR: host_store
must fail, never fall back to torch's wildcard listener.
PASS when each store listens on the named address alone (a name: its first
address) and a held port is refused.
Run: PYTHONPATH=/work/wt-audit35 DISTGRAD_PURE=1 timeout 90 python audit/poc_store_binding_addresses.py
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

from distgrad.launch.listen import host_store


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return sorted({line.split()[3] for line in out.splitlines() if line.strip()})


bad = []
for host in ["127.0.0.1", "::1", "localhost", "0.0.0.0", socket.gethostname()]:
    p = free_port()
    try:
        st = host_store(host, p, None, timedelta(seconds=10))
    except Exception as e:  # noqa: BLE001
        print(f"  {host}: error {type(e).__name__}: {str(e)[:100]}")
        continue
    where = listening(p)
    wild = [w for w in where if w.startswith(("*:", "[::]:", "0.0.0.0:"))]
    ok = (host == "0.0.0.0") == bool(wild) and len(where) == 1
    print(f"  {'holds' if ok else 'FAIL'}: named {host!r}: listens on {where}")
    if not ok:
        bad.append(host)
    del st

SQUAT = r"""
import socket, sys, time
s = socket.socket()
if sys.argv[2] == "1":
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(8)
print("up", flush=True); time.sleep(30)
"""
for reuse in ("0", "1"):
    p = free_port()
    cmd = [sys.executable, "-c", SQUAT, str(p), reuse]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=4002", "--regid=4002", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"] + cmd
    sq = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        sq.stdout.readline()
        t0 = time.monotonic()
        try:
            st = host_store("127.0.0.1", p, None, timedelta(seconds=5))
            res = f"opened a store; listening now: {listening(p)}"
            if any(w.startswith(("*:", "[::]:", "0.0.0.0:")) for w in listening(p)):
                bad.append(f"squatter reuse={reuse}")
                res = "FAIL: " + res
            del st
        except Exception as e:  # noqa: BLE001
            res = f"refused ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        print(f"  squatter on 127.0.0.1:{p} (SO_REUSEADDR={reuse}): {res} "
              f"[{time.monotonic() - t0:.1f}s]")
    finally:
        sq.kill()
        sq.wait()
print("FAIL: " + ", ".join(bad) if bad else "PASS: every store listens where named")
sys.exit(1 if bad else 0)
