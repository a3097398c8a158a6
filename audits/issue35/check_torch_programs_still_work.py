"""Check (second audit): after the exact-sequence change, ordinary torch.distributed.rpc
programs still work over TCP with a secret: 3 workers (spawn), DISTGRAD_SAME_HOST=0,
DISTGRAD_SECRET set, once with every-byte MAC (default) and once with
DISTGRAD_ENCRYPT=1. Each worker: 12 threads x 40 mixed calls to both others
(rpc_sync, rpc_async, remote + to_here + RRef dropped, nested rpc inside a call
that creates and deletes RRefs), 32 MiB tensors both ways, a dist_autograd
forward/backward through two workers, then rpc.shutdown() (graceful). A third
run keeps the same-host path (DISTGRAD_SAME_HOST=1: Unix sockets, shared memory).

PASS when every result is right, no log line mentions an authentication
failure, a gap or a lost worker, and all three exit 0.
Run: cd /work/wt-audit35b && PYTHONPATH=$PWD DISTGRAD_PURE=1 timeout 600 python audits/issue35/check_torch_programs_still_work.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add(a, b):
    return a + b


def nested(to, x):
    import distgrad.rpc as rpc
    rr = rpc.remote(to, add, args=(x, 1))
    v = rr.to_here()
    del rr
    return rpc.rpc_sync(to, add, args=(v, 1))


def worker(rank, cfg, q):
    import logging
    os.environ.update(DISTGRAD_SAME_HOST=cfg["same"], OMP_NUM_THREADS="1",
                      DISTGRAD_SECRET="5e0c1d2b3a4f59687766554433221100ffeeddccbbaa99887766554433221100")
    if cfg["enc"]:
        os.environ["DISTGRAD_ENCRYPT"] = "1"
    logging.basicConfig(level=logging.WARNING, filename=cfg["dir"] + f"/w{rank}.log")
    import torch
    import distgrad.rpc as rpc
    import distgrad.autograd as dist_autograd
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg['store']}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    others = [f"w{r}" for r in range(3) if r != rank]
    bad = []
    big = torch.arange(8 << 20, dtype=torch.float32)   # 32 MiB

    def job(t):
        for i in range(40):
            to = others[(t + i) % 2]
            k = i % 5
            try:
                if k == 0:
                    ok = rpc.rpc_sync(to, add, args=(i, t)) == i + t
                elif k == 1:
                    ok = rpc.rpc_async(to, add, args=(torch.ones(100), i)).wait()[0].item() == 1 + i
                elif k == 2:
                    rr = rpc.remote(to, add, args=(i, 2))
                    ok = rr.to_here() == i + 2
                    del rr
                elif k == 3:
                    ok = rpc.rpc_sync(to, nested, args=(others[(t + i + 1) % 2], i)) == i + 2
                else:
                    if i % 10 == 4 and t < 3:
                        r = rpc.rpc_sync(to, add, args=(big, 1.0))
                        ok = r.shape == big.shape and r[-1].item() == big[-1].item() + 1
                    else:
                        ok = True
                if not ok:
                    bad.append(f"t{t} i{i} k{k} wrong")
            except Exception as e:  # noqa: BLE001
                bad.append(f"t{t} i{i} k{k} {type(e).__name__}: {str(e)[:100]}")
    ths = [threading.Thread(target=job, args=(t,)) for t in range(12)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    try:
        with dist_autograd.context() as cid:
            w = torch.ones(5, requires_grad=True)
            y = rpc.rpc_sync(others[0], torch.mul, args=(w, 2.0))
            z = rpc.rpc_sync(others[1], torch.mul, args=(y, 3.0))
            dist_autograd.backward(cid, [z.sum()])
            if not bool((dist_autograd.get_gradients(cid)[w] == 6).all()):
                bad.append("autograd: wrong gradient")
    except Exception as e:  # noqa: BLE001
        bad.append(f"autograd: {type(e).__name__}: {e}")
    rpc.shutdown()
    q.put((rank, bad))


def run(enc, same="0"):
    d = tempfile.mkdtemp(prefix="chk-torch-")
    cfg = {"dir": d, "store": free_port(), "enc": enc, "same": same}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cfg, q)) for r in range(3)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            r, b = q.get(timeout=400)
            res[r] = b
    except Exception as e:  # noqa: BLE001
        print("  harness: no result", e)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
    logs = "".join(open(f"{d}/w{r}.log").read() for r in range(3) if os.path.exists(f"{d}/w{r}.log"))
    bad = [f"w{r}: {b[:3]}" for r, b in res.items() if b]
    if len(res) != 3:
        bad.append(f"only {sorted(res)} reported")
    if any(p.exitcode != 0 for p in procs):
        bad.append(f"exit codes {[p.exitcode for p in procs]}")
    for word in ("failed authentication", "missing before", "lost worker"):
        if word in logs:
            bad.append(word)
    print(f"  {'encrypt' if enc else 'mac-all' if same == '0' else 'same host (unix+shm)'}: {'FAIL ' + '; '.join(bad) if bad else 'holds'}",
          flush=True)
    return not bad


def main():
    ok = run(False) & run(True) & run(False, same="1")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
