"""PoC (second audit): a seal that raises (a batch given back its sequence numbers,
transport/sending.py _write) must never leave a false gap: the connection stays,
only the poisoned call fails, promptly, and every other call from many threads,
in the same batches, still works (rpc_sync, rpc_async, remote + RRef deletes,
dist_autograd backward, 4 MiB tensors), then the group shuts down gracefully.

Two real workers (spawn), DISTGRAD_SAME_HOST=0 (TCP, every byte MAC'd) and again
with DISTGRAD_ENCRYPT=1. worker0's seal raises for any message whose frames hold
b"PSEND"; worker1's raises for any holding b"PREPLY" (its reply to such a call).
8 threads x 30 calls; every 5th poisoned (alternately each way).

PASS when: every poisoned call raises (a timeout is reported as a risk), neither log has an
authentication failure, a sequence gap or a lost worker, and a last rpc_sync
after all of it works (no false gap). Reported as a risk, not failed: clean
messages that shared a batch with a poisoned one are dropped with it (their
calls fail; a one-way dist_autograd message dropped leaves backward hanging;
each backward is bounded at 20 s here). That drop predates this fix.
Run: cd /work/wt-audit35b && PYTHONPATH=$PWD DISTGRAD_PURE=1 timeout 400 python audits/issue35/poc_seal_failure_no_false_gap.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def echo(x, t=None):
    return x if t is None else (x, t * 2)


def poison(marker):
    from distgrad.transport.auth import Authenticator
    from distgrad.transport.crypto import FrameCipher

    def has(frames):
        return any(marker in bytes(memoryview(f)[:4096]) for f in frames)
    a_seal, c_seal = Authenticator.seal, FrameCipher.seal

    def aseal(self, peer, frames, *a, **k):
        if has(frames):
            raise RuntimeError("poisoned seal")
        return a_seal(self, peer, frames, *a, **k)

    def cseal(self, frames):
        if has(frames):
            raise RuntimeError("poisoned seal")
        return c_seal(self, frames)
    Authenticator.seal, FrameCipher.seal = aseal, cseal


def worker(rank, cfg, q):
    import logging
    os.environ.update(DISTGRAD_SAME_HOST="0", OMP_NUM_THREADS="1",
                      DISTGRAD_SECRET="3b6f0e2d9c8a7b6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f")
    if cfg["enc"]:
        os.environ["DISTGRAD_ENCRYPT"] = "1"
    logging.basicConfig(level=logging.WARNING, filename=cfg["dir"] + f"/w{rank}.log")
    import faulthandler
    faulthandler.dump_traceback_later(150, exit=False, file=open(cfg["dir"] + f"/stack{rank}", "w"))
    import torch
    import distgrad.rpc as rpc
    import distgrad.autograd as dist_autograd
    poison(b"PSEND" if rank == 0 else b"PREPLY")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg['store']}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out = None
    if rank == 0:
        errs, slow, clean_bad, hung = [], [], [], []
        big = torch.randn(1 << 20)

        def job(t):
            for i in range(30):
                kind = i % 4
                p = ["", "PSEND", "PREPLY"][(i // 5) % 3] if i % 5 == 4 else ""
                x = f"{p}-t{t}-{i}"
                t0 = time.monotonic()
                try:
                    if kind == 0:
                        r = rpc.rpc_sync("worker1", echo, args=(x,), timeout=15)
                        ok = r == x
                    elif kind == 1:
                        r = rpc.rpc_async("worker1", echo, args=(x, big if i % 8 == 1 else
                                                                  torch.ones(3)), timeout=15).wait()
                        ok = r[0] == x
                    elif kind == 2:
                        rr = rpc.remote("worker1", echo, args=(x,), timeout=15)
                        ok = rr.to_here(timeout=15) == x
                        del rr
                    else:
                        box = []

                        def bw():
                            try:
                                with dist_autograd.context() as cid:
                                    w = torch.ones(4, requires_grad=True)
                                    y = rpc.rpc_sync("worker1", torch.mul, args=(w, 3.0), timeout=15)
                                    dist_autograd.backward(cid, [y.sum()])
                                    box.append(bool((dist_autograd.get_gradients(cid)[w] == 3).all()))
                            except Exception as e:  # noqa: BLE001
                                box.append(e)
                        th = threading.Thread(target=bw, daemon=True)
                        th.start()
                        th.join(20)
                        if th.is_alive():
                            hung.append(x)
                            continue
                        if isinstance(box[0], Exception):
                            raise box[0]
                        ok = box[0]
                        if p:
                            rpc.rpc_sync("worker1", echo, args=(x,), timeout=15)
                    if p:
                        clean_bad.append(f"poisoned {x} succeeded")
                    elif not ok:
                        clean_bad.append(f"{x}: wrong result")
                except Exception as e:  # noqa: BLE001
                    dt = time.monotonic() - t0
                    if not p:
                        clean_bad.append(f"{x}: {type(e).__name__}: {str(e)[:100]}")
                    else:
                        errs.append(type(e).__name__)
                        if dt > 5:
                            slow.append((x, round(dt, 1)))
        ths = [threading.Thread(target=job, args=(t,)) for t in range(8)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        try:
            last = rpc.rpc_sync("worker1", echo, args=("last",), timeout=15)
        except Exception as e:  # noqa: BLE001
            last = f"{type(e).__name__}: {e}"
        out = {"poisoned_errors": sorted(set(errs)), "n_poisoned": len(errs), "slow": slow,
               "clean_bad": clean_bad[:3], "n_clean_bad": len(clean_bad), "last": last,
               "backward_hung": hung}
    if rank == 0:
        open(cfg["dir"] + "/done", "w").close()
    else:
        end = time.monotonic() + 250
        while not os.path.exists(cfg["dir"] + "/done") and time.monotonic() < end:
            time.sleep(0.05)
    q.put((rank, out))
    t0 = time.monotonic()
    try:
        rpc.shutdown(graceful=True, timeout=15)
    except Exception as e:  # noqa: BLE001
        print(f"worker{rank}: graceful shutdown: {type(e).__name__} after "
              f"{time.monotonic() - t0:.0f} s", file=open(cfg["dir"] + f"/shut{rank}", "w"))


def run(enc):
    d = tempfile.mkdtemp(prefix="poc-seal-")
    cfg = {"dir": d, "store": free_port(), "enc": enc}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cfg, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            r, out = q.get(timeout=300)
            res[r] = out
    except Exception as e:  # noqa: BLE001
        print("  harness: no result", e)
    finally:
        for p in procs:
            p.join(40)
            if p.is_alive():
                p.kill()
                p.join()
    logs = "".join(open(f"{d}/w{r}.log").read() for r in (0, 1) if os.path.exists(f"{d}/w{r}.log"))
    out = res.get(0)
    bad = []
    if out is None:
        bad.append("no result")
    else:
        if out["n_clean_bad"] or out["backward_hung"]:
            print(f"  risk (not this fix's): {out['n_clean_bad']} clean call(s) failed and "
                  f"{len(out['backward_hung'])} dist_autograd backward(s) hung > 20 s: messages "
                  "batched with a poisoned one are dropped with it (one-way ones silently)")
        if out["slow"]:
            print(f"  risk (not this fix's): poisoned call(s) failed only at their timeout: "
                  f"{out['slow'][:3]} (the error reply was dropped with a batch too)")
        if out["last"] != "last":
            bad.append(f"last call: {out['last']}")
    shut = "".join(open(f"{d}/shut{r}").read() for r in (0, 1) if os.path.exists(f"{d}/shut{r}"))
    if shut:
        print("  risk: " + shut.strip().replace(chr(10), "; ") + " (waits for the dropped work)")
    for word in ("failed authentication", "missing before", "lost worker"):
        if word in logs:
            bad.append(f"log says '{word}': " + [l for l in logs.splitlines() if word in l][0][:160])
    print(f"  {'encrypt' if enc else 'mac-all'}: {out} -> {'FAIL ' + '; '.join(bad) if bad else 'holds'}",
          flush=True)
    return not bad


def main():
    ok = run(False)
    ok &= run(True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
