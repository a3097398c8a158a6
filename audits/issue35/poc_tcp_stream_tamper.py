"""PoC (second audit): an on-path attacker tampers with the worker0 -> worker1 TCP
stream in every way other than deletion: reorder two messages, duplicate one,
inject a fabricated one, flip a tensor byte, stall (drop it and all after it,
socket kept open: only liveness can tell); and all of them under encrypt=True.
Mode badframe (a header of 2**30 frames) shows that an on-path party could
always kill the connection, before this fix too (FrameError -> lost): closing on
an authentication failure gives it nothing new. Each mode runs two real workers (spawn), DISTGRAD_SAME_HOST=0,
a secret set, every byte MAC'd (default), or DISTGRAD_ENCRYPT=1.

worker1's published address leads through a proxy that parses the framing
(4-byte frame count, 8-byte sizes, frames) after the handshake (HELLO 29 B,
PROOF 32 B) and acts on the first message over 8 KiB (the m2 call, whose
argument is a 16 KiB tensor; works on ciphertext too).

worker0 issues m1, m2, m3 with rpc_async (timeout 20 s) and records how long
each took to resolve. worker1 appends what it ran to a list, written to a file.

PASS per mode when: worker1 ran nothing out of order, nothing twice, no changed
tensor; it logged an authentication failure (stall: lost for silence); and every
call after the tamper failed within 5 s (stall: 10 s; no hang to the timeout).
Run: cd /work/wt-audit35b && PYTHONPATH=$PWD DISTGRAD_PURE=1 timeout 600 python audits/issue35/poc_tcp_stream_tamper.py [mode[:enc] ...]
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import threading
import time

LOG: list = []


def _append(x, t=None):
    LOG.append((x, None if t is None else float(t.sum())))
    return len(LOG)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, cfg, q):
    import logging
    os.environ.update(DISTGRAD_SAME_HOST="0", OMP_NUM_THREADS="1",
                      DISTGRAD_SECRET="9f1c2a7be0d34c55a1e8f0b6c3d2e4f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5")
    if cfg["enc"]:
        os.environ["DISTGRAD_ENCRYPT"] = "1"
    logging.basicConfig(level=logging.WARNING, filename=cfg["dir"] + f"/w{rank}.log")
    import torch
    import distgrad.rpc as rpc
    from distgrad.transport.socket_transport import SocketTransport
    if rank == 1:
        orig = SocketTransport.listen

        def listen(self, host):
            addr = orig(self, host)
            real = self._tcp.getsockname()[1]
            with open(cfg["dir"] + "/port.tmp", "w") as f:
                f.write(str(real))
            os.replace(cfg["dir"] + "/port.tmp", cfg["dir"] + "/port")
            return addr.replace(f":{real}", f":{cfg['proxy']}", 1)
        SocketTransport.listen = listen
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg['store']}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out = None
    if rank == 0:
        big = torch.ones(4096)
        t0 = time.monotonic()
        futs = [rpc.rpc_async("worker1", _append, args=("m1",), timeout=20),
                rpc.rpc_async("worker1", _append, args=("m2", big), timeout=20),
                rpc.rpc_async("worker1", _append, args=("m3",), timeout=20)]
        res = []
        for f in futs:
            try:
                v = ("ok", f.wait())
            except Exception as e:  # noqa: BLE001
                v = ("error", type(e).__name__)
            res.append((*v, round(time.monotonic() - t0, 2)))
        out = {"calls": res}
        open(cfg["dir"] + "/done", "w").close()
    else:
        end = time.monotonic() + 60
        while not os.path.exists(cfg["dir"] + "/done") and time.monotonic() < end:
            time.sleep(0.05)
        with open(cfg["dir"] + "/ran.json", "w") as f:
            json.dump(LOG, f)
    rpc.shutdown(graceful=False)
    q.put((rank, out))


class Proxy:
    def __init__(self, port, d, mode):
        self.sock = socket.create_server(("127.0.0.1", port))
        self.d, self.mode, self.acted = d, mode, 0
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            while not os.path.exists(self.d + "/port"):
                time.sleep(0.01)
            s = socket.create_connection(("127.0.0.1", int(open(self.d + "/port").read())))
            threading.Thread(target=self.parse, args=(c, s), daemon=True).start()
            threading.Thread(target=self.pump, args=(s, c), daemon=True).start()

    @staticmethod
    def exact(src, n):
        buf = bytearray()
        while len(buf) < n:
            b = src.recv(n - len(buf))
            if not b:
                raise EOFError
            buf += b
        return bytes(buf)

    def read_msg(self, src):
        head = self.exact(src, 4)
        (n,) = struct.unpack("!I", head)
        sizes_raw = self.exact(src, 8 * n)
        sizes = struct.unpack(f"!{n}Q", sizes_raw)
        return head, sizes_raw, [self.exact(src, k) for k in sizes]

    def parse(self, src, dst):
        held = None
        try:
            dst.sendall(self.exact(src, 29))
            dst.sendall(self.exact(src, 32))
            while True:
                head, sizes_raw, frames = self.read_msg(src)
                raw = head + sizes_raw + b"".join(frames)
                if getattr(self, "stalled", False):
                    continue
                if held is not None:       # swap: the next message goes first
                    dst.sendall(raw + held)
                    held = None
                    continue
                if not self.acted and sum(map(len, frames)) > 8192:
                    self.acted = 1
                    m = self.mode
                    if m == "drop":
                        continue
                    if m == "stall":       # drop it and everything after, keep the socket open
                        self.stalled = True
                        continue
                    if m == "swap":
                        held = raw
                        continue
                    if m == "dup":
                        dst.sendall(raw + raw)
                        continue
                    if m == "inject":
                        fake = [os.urandom(40), os.urandom(200)]
                        dst.sendall(struct.pack("!I", 2) + struct.pack("!2Q", 40, 200)
                                    + b"".join(fake) + raw)
                        continue
                    if m == "badframe":   # not a MAC failure: a framing bound broken
                        dst.sendall(struct.pack("!I", 1 << 30))
                        continue
                    if m == "flip":
                        last = bytearray(frames[-1])
                        last[len(last) // 2] ^= 0x01
                        dst.sendall(head + sizes_raw + b"".join(frames[:-1]) + bytes(last))
                        continue
                dst.sendall(raw)
        except (OSError, EOFError):
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def pump(self, src, dst):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                dst.sendall(b)
        except OSError:
            pass


def run(mode, enc):
    d = tempfile.mkdtemp(prefix="poc-tamper-")
    cfg = {"dir": d, "store": free_port(), "proxy": free_port(), "enc": enc}
    proxy = Proxy(cfg["proxy"], d, mode)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cfg, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            r, out = q.get(timeout=120)
            results[r] = out
    except Exception as e:  # noqa: BLE001
        print("  harness: no result", e)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    ran = json.load(open(d + "/ran.json")) if os.path.exists(d + "/ran.json") else None
    w1 = open(d + "/w1.log").read() if os.path.exists(d + "/w1.log") else ""
    calls = (results.get(0) or {}).get("calls")
    names = [x[0] for x in ran] if ran is not None else None
    authfail = "failed authentication" in w1
    bad = []
    if not proxy.acted:
        bad.append("proxy never acted")
    if calls is None or names is None:
        bad.append("no result")
    else:
        if names not in ([], ["m1"], ["m1", "m2"], ["m1", "m2", "m3"]) or names.count("m2") > 1:
            bad.append(f"worker1 ran {names}")
        if any(x[0] == "m2" and x[1] != 4096.0 for x in ran):
            bad.append("changed tensor accepted")
        if mode not in ("stall", "badframe") and not authfail:
            bad.append("no authentication failure logged")
        for st, _, t in calls:
            if st == "error" and t > (10 if mode == "stall" else 5):
                bad.append(f"a call took {t} s to fail")
        if mode != "none" and all(c[0] == "ok" for c in calls):
            bad.append("every call succeeded despite tampering")
    line = [l for l in w1.splitlines() if "failed authentication" in l][:1]
    print(f"  {mode}{' enc' if enc else ''}: worker1 ran {names}; calls {calls}; "
          f"{line[0].split('(')[1][:70] if line else 'no auth warning'} -> "
          f"{'FAIL ' + '; '.join(bad) if bad else 'holds'}", flush=True)
    return not bad


def main():
    modes = sys.argv[1:] or ["swap", "dup", "inject", "flip", "drop:enc", "swap:enc",
                             "dup:enc", "inject:enc", "flip:enc", "stall", "stall:enc", "badframe"]
    ok = True
    for m in modes:
        mode, _, enc = m.partition(":")
        ok &= run(mode, enc == "enc")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
